"""Per-call overhead of `hal.ops.*` over calling the chosen kernel directly, on tiny inputs.

The kernels are trivial (they return their input), so that the difference is the dispatch alone:
the generated entry function, the cache key, the dictionary lookup and the runner (static argument
substitution, array-type adaptation, call counting). Each row times the hal call and the direct
kernel call in alternating loops and reports the median of the paired differences, which cancels
most of a shared machine's drift. Rows:

  * NumPy arrays, kernel of a NumPy backend (`softmax(x)`: dim -1 canonicalised to 1; and with
    `dim=1` given, no substitution);
  * torch CPU tensors, kernel of a torch backend, eager (grad mode on, then under no_grad);
  * torch CPU tensors requiring grad: the autograd path through `torch.ops.hal.softmax`, against
    `torch.softmax` with autograd (the peer that a hand-written model would call);
  * the peer: a `torch.library.custom_op` wrapping the same trivial kernel, over the bare kernel.

    python benchmarks/dispatch_overhead.py [--repeat 21] [--number 20000] [--json]
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


def loop_ns(fn: Callable[..., Any], args: tuple, number: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(number):
        fn(*args)
    return (time.perf_counter_ns() - t0) / number


def paired(hal_call: tuple, direct_call: tuple, repeat: int, number: int) -> dict[str, float]:
    """Median per-call times of both, and the median of their paired differences (ns)."""
    for fn, args in (hal_call, direct_call):
        loop_ns(fn, args, number // 10)
    hal_t, direct_t = [], []
    for _ in range(repeat):
        hal_t.append(loop_ns(*hal_call, number))
        direct_t.append(loop_ns(*direct_call, number))
    return {
        "hal_ns": round(statistics.median(hal_t)),
        "direct_ns": round(statistics.median(direct_t)),
        "overhead_ns": round(statistics.median(h - d for h, d in zip(hal_t, direct_t))),
    }


def identity_plugin(array_api: str) -> Plugin:
    """A CPU backend whose softmax kernel returns its input: the kernel costs one Python call."""
    p = Plugin(f"bench_{array_api}", "1.0")
    p.define_backend(priority=1000, device_types=("cpu",), array_api=array_api)
    p.kernel("softmax", name="identity")(identity)
    return p


def identity(x, dim):
    return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=21)
    parser.add_argument("--number", type=int, default=20000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rep, num = args.repeat, args.number
    rows: list[dict[str, Any]] = []
    previous = dispatch.install(None)
    try:
        dispatch.install(Runtime.from_plugins([identity_plugin("numpy")]))
        x = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)
        rows.append({"case": "numpy, softmax(x) (dim canonicalised)", **paired((hal.ops.softmax, (x,)), (identity, (x, 1)), rep, num)})
        rows.append({"case": "numpy, softmax(x, 1)", **paired((hal.ops.softmax, (x, 1)), (identity, (x, 1)), rep, num)})

        dispatch.install(Runtime.from_plugins([identity_plugin("torch")]))
        t = torch.randn(4, 4)
        rows.append({"case": "torch, softmax(t, 1), eager", **paired((hal.ops.softmax, (t, 1)), (identity, (t, 1)), rep, num)})
        with torch.no_grad():
            rows.append({"case": "torch, softmax(t, 1), no_grad", **paired((hal.ops.softmax, (t, 1)), (identity, (t, 1)), rep, num)})
        tg = torch.randn(4, 4, requires_grad=True)
        rows.append(
            {
                "case": "torch, requires_grad: torch.ops.hal + autograd vs torch.softmax",
                **paired((hal.ops.softmax, (tg, 1)), (torch.softmax, (tg, 1)), rep, num // 10),
            }
        )

        @torch.library.custom_op("hal_bench::identity", mutates_args=())
        def custom(x: torch.Tensor, dim: int) -> torch.Tensor:
            return x.clone()  # custom ops may not return an alias of an input

        clone = lambda x, dim: x.clone()  # noqa: E731 - the same work without the custom op
        rows.append({"case": "peer: torch.library.custom_op", **paired((custom, (t, 1)), (clone, (t, 1)), rep, num)})
    finally:
        dispatch.install(previous)

    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"torch {torch.__version__}, hal {hal.__version__}; {rep} alternating loops of {num} calls (autograd: {num // 10})")
    print(f"{'case':<66}{'call ns':>9}{'kernel ns':>11}{'overhead ns':>13}")
    for r in rows:
        print(f"{r['case']:<66}{r['hal_ns']:>9}{r['direct_ns']:>11}{r['overhead_ns']:>13}")


if __name__ == "__main__":
    main()
