"""Per-call overhead of `hal.ops.*` over calling the chosen kernel directly, on tiny inputs.

Measured in one run, median of repeated timing loops (time.perf_counter_ns):
  * NumPy arrays through the installed backends (cpu_ref), op `softmax` and op `linear`;
  * torch CPU tensors through a backend whose kernel is a torch call (so the difference is pure
    dispatch: key, cache lookup, runner), eager without autograd;
  * the same through autograd (a tensor requiring grad: routed to torch.ops.hal.*), when available;
  * peer: a `torch.library.custom_op` wrapping the same torch call, over the bare call.

    python benchmarks/dispatch_overhead.py [--repeat 15] [--number 20000] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

import numpy as np
import torch

import hal
from hal import dispatch
from hal.plugin import Plugin
from hal.runtime import Runtime


def median_ns(fn: Callable[..., Any], args: tuple, repeat: int, number: int) -> float:
    """Median over ``repeat`` loops of the mean time of one call in a loop of ``number`` calls."""
    for _ in range(number // 10):
        fn(*args)
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        for _ in range(number):
            fn(*args)
        samples.append((time.perf_counter_ns() - t0) / number)
    return statistics.median(samples)


def chosen_kernel(op: str, *args: Any) -> Callable[..., Any]:
    decision = hal.explain(op, *args)
    rt = dispatch.DISPATCHER.runtime()
    return next(k.fn for k in rt.kernels(op, decision.backend) if k.name == decision.kernel)


def torch_plugin() -> Plugin:
    """A CPU backend whose softmax kernel is one torch call: dispatch overhead without conversion."""
    p = Plugin("bench_torch", "1.0")
    p.define_backend(priority=1000, device_types=("cpu",), array_api="torch")

    @p.kernel("softmax", name="torch")
    def softmax(x, dim):
        return torch.softmax(x, dim)

    return p


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--number", type=int, default=20000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rep, num = args.repeat, args.number
    rows: list[dict[str, Any]] = []

    def row(name: str, hal_ns: float, direct_ns: float) -> None:
        rows.append({"case": name, "hal_ns": round(hal_ns), "direct_ns": round(direct_ns), "overhead_ns": round(hal_ns - direct_ns)})

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 4)).astype(np.float32)
    w = rng.standard_normal((3, 4)).astype(np.float32)
    kernel = chosen_kernel("softmax", x)
    row("numpy softmax (cpu_ref)", median_ns(hal.ops.softmax, (x,), rep, num), median_ns(kernel, (x, 1), rep, num))
    kernel = chosen_kernel("linear", x, w)
    row("numpy linear (cpu_ref)", median_ns(hal.ops.linear, (x, w), rep, num), median_ns(kernel, (x, w, None, "none"), rep, num))

    previous = dispatch.install(Runtime.from_plugins([torch_plugin()]))
    try:
        t = torch.randn(4, 4)
        direct = median_ns(torch.softmax, (t, 1), rep, num)
        row("torch softmax, eager", median_ns(hal.ops.softmax, (t,), rep, num), direct)
        with torch.no_grad():
            row("torch softmax, eager, no_grad", median_ns(hal.ops.softmax, (t,), rep, num), median_ns(torch.softmax, (t, 1), rep, num))
        tg = torch.randn(4, 4, requires_grad=True)
        if dispatch.DISPATCHER.autograd_call is not None:
            row("torch softmax, autograd (torch.ops.hal)", median_ns(hal.ops.softmax, (tg,), rep, num // 4), median_ns(torch.softmax, (tg, 1), rep, num // 4))

        @torch.library.custom_op("hal_bench::softmax", mutates_args=())
        def custom_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
            return torch.softmax(x, dim)

        row("peer: torch.library.custom_op", median_ns(custom_softmax, (t, 1), rep, num), direct)
    finally:
        dispatch.install(previous)

    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"torch {torch.__version__}, hal {hal.__version__}; median of {rep} loops of {num} calls")
    print(f"{'case':<44}{'hal.ops ns':>12}{'direct ns':>12}{'overhead ns':>13}")
    for r in rows:
        print(f"{r['case']:<44}{r['hal_ns']:>12}{r['direct_ns']:>12}{r['overhead_ns']:>13}")


if __name__ == "__main__":
    main()
