"""Host time of `hal.ops.*` calls on tiny inputs: the dispatch alone, and the autograd path next to
torch's own op.

The kernels are trivial (they return their input, or an input of the right shape), so that what
is measured is hal's path: the generated entry, the cache key, the dictionary lookup, the plan and,
with grad, the autograd node and the backward op's dispatch. Each row times two callables in
alternating loops and reports the medians and the median of the paired differences, which cancels
most of a shared machine's drift. Rows:

  * kernel route: NumPy arrays (``softmax(x)``: dim -1 canonicalised to 1; and ``dim=1`` given),
    torch CPU tensors in grad mode without grad-requiring inputs, and under no_grad, each against
    calling the kernel directly (the "within 2 us of the kernel" budget); and under
    ``torch.autocast`` (bfloat16): softmax and linear with nothing to cast against the kernel, linear
    with three float32 arguments to cast against those casts alone;
  * autograd route, forward: softmax, layer_norm and linear + gelu on a tensor requiring grad,
    against torch.softmax / F.layer_norm / F.gelu(F.linear) with autograd (the "torch's own op +
    5 us" budget); linear + gelu is two hal nodes (its training decomposition);
  * the same two rows for a softmax kernel that is torch.softmax registered ``differentiable``
    (torch's autograd records it: what is left is hal's dispatch);
  * autograd route, forward + backward: the same calls followed by ``backward()``; the backward's
    cost is the difference to the forward row;
  * the peer: a ``torch.library.custom_op`` wrapping the same trivial kernel, over the bare kernel;
  * the installed backends (the CPU backend's real kernels): a small elementwise op,
    ``scale_shift_act(x, 1.0, 0.0, "relu")`` on a (4, 4) NumPy array, against bare NumPy
    (``np.maximum(x, 0)``) and against the same call on a torch tensor (the cost of NumPy input);
    since 2026-12-07 the CPU backend runs it with NumPy's own ufunc for a NumPy caller; and the same
    for ``softmax(x, -1)``, which a NumPy caller's small array now gets from the CPU backend's numba
    kernel (no tensor made) and a tensor from torch's.

Issue 41 item 13 (2026-12-03, the 2-core AMD EPYC VM, AVX2, load 6-8 from other jobs; thread CPU
time, 1 torch thread, base and new checkouts alternated process by process, medians of 15 paired
rounds each, range over processes): ``scale_shift_act`` relu on a (4, 4) NumPy array 32.2 us
(31.9-32.4) before, 18.9 us (18.9-19.0) after, against NumPy's 2.1 us; NumPy call over tensor call
3.45x (3.39-3.52) -> 1.98x (1.94-2.01), softmax 3.29x -> 1.94x, linear + gelu (8, 64) x (64, 64)
1.50x -> 1.26x. What is left of a NumPy call is ``torch.from_numpy`` and ``Tensor.numpy`` (1.7 and
2.2 us on that machine) and freeing the views; the array conversion around the kernel no longer
looks at parameters that hold no array (``hal.dispatch.adapt.array_slots``).

Issue 41 item 13 again (2026-12-07, the same AMD EPYC 2-core VM, AVX2, load 0.4-2.6 from other
sessions; this script with ``--repeat 15 --number 10000``, the base ``270dc74`` and the new tree
alternated process by process, 8 processes each, medians over processes and their ranges):
``scale_shift_act`` relu on a (4, 4) NumPy array 4.07 us (3.85-9.27) -> 1.56 us (1.51-1.57), over
``np.maximum``'s 0.50 us +3.56 -> +1.05 us, NumPy call over tensor call 1.70x (1.67-1.80) -> 0.65x
(0.63-0.69): the CPU backend's ``numpy`` kernel (NumPy's own ``maximum`` for a NumPy caller's array
of up to 4096 elements, no tensor made). Through a torch kernel (the softmax row) 1.61x (1.61-1.75)
-> 1.46x (1.44-1.61): a plan's runner converts exactly the slots its key says hold arrays
(``hal.dispatch.adapt._numpy_into_torch``). What is left there is torch's own conversions: bare
``torch.softmax(torch.from_numpy(x), -1).numpy()`` costs 1.99 us against 1.04 us on the tensor
(``from_numpy`` 0.38 us, ``Tensor.numpy`` 0.53 us, freeing both), and hal's NumPy call 1.00 us over
its tensor call (thread time, one process): about 0.04 us of it is hal's. The trivial-kernel rows
did not move beyond the noise (within 0-4%).

Issue 41 item 13, the softmax row (2026-12-07 16:48-16:52, the same 2-core EPYC VM, now reporting
AVX-512; load 1.6-2.4, then up to 144 from other sessions' test runs for the last rounds; this
script with ``--repeat 15 --number 10000 --json``, base ``1aba61e`` and the new tree alternated
process by process, 8 processes each, medians over processes and their ranges): ``softmax(x, -1)``
on a (4, 4) float32 NumPy array 4.07 us (3.69-5.43) -> 2.18 us (1.95-2.69), NumPy call over tensor
call 1.45x (1.43-1.51) -> 0.75x (0.69-0.83). The conversions could not get cheaper (hal's share was
0.04 us of them): the CPU backend's ``numba`` softmax kernel serves a NumPy caller's C-contiguous
float32/float64 arrays of up to 256 elements in one numba call (0.79 us at (4, 4) against 2.38 for
torch's softmax with ``from_numpy`` and ``Tensor.numpy``; numba's scalar exp loses beyond about 400
elements), and ``hal.explain`` shows it chosen, its measured time, and why a torch caller's tensor
keeps torch's kernel. The other rows did not move beyond the noise.

Issue 40, eager host time (2026-12-07, the same 2-core EPYC VM, load 1-1.7 from other sessions;
this script with ``--repeat 9 --number 5000 --json``, the dispatcher of ``66d0b65`` and of
``4ee1c97`` alternated process by process, 3 processes each, medians): under ``torch.autocast`` a
call's key holds the autocast state and its cached plan does the casts (it had checked each named
argument, cast, and called the entry again with autocast off). Over the kernel: softmax (no CPU rule)
2.28 -> 1.71 us, linear in bfloat16 (nothing to cast) 4.16 -> 2.87 us; linear with three float32
arguments over the three casts alone 5.87 -> 3.51 us. Without autocast +0.03 to +0.06 us (the key's
one more element), within the processes' spread.

    python benchmarks/dispatch_overhead.py [--repeat 21] [--number 20000] [--device cuda] [--json]

With ``--device cuda`` the torch rows use CUDA tensors (the trivial kernels launch nothing; torch's
ops launch theirs): the host cost of each path on a GPU machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

import hal
from hal import dispatch
from hal.plugin import Plugin
from hal.runtime import Runtime


def loop_ns(fn: Callable[..., Any], args: tuple, number: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(number):
        fn(*args)
    return (time.perf_counter_ns() - t0) / number


def paired(hal_call: tuple, peer_call: tuple, repeat: int, number: int) -> dict[str, float]:
    """Median per-call times of both, and the median of their paired differences (ns)."""
    for fn, args in (hal_call, peer_call):
        loop_ns(fn, args, max(1, number // 10))
    hal_t, peer_t = [], []
    for _ in range(repeat):
        hal_t.append(loop_ns(*hal_call, number))
        peer_t.append(loop_ns(*peer_call, number))
    return {
        "hal_ns": round(statistics.median(hal_t)),
        "peer_ns": round(statistics.median(peer_t)),
        "overhead_ns": round(statistics.median(h - d for h, d in zip(hal_t, peer_t))),
    }


def identity(x, dim):
    return x


def trivial_plugin(array_api: str, device_type: str = "cpu") -> Plugin:
    """A CPU backend whose kernels cost one Python call: softmax, layer_norm, linear and
    scale_shift_act return an input of the result's shape (the benchmark's linear is square), and
    their backward ops return grad_out (and parameters of the right shapes)."""
    p = Plugin(f"bench_{array_api}", "1.0")
    p.define_backend(priority=1000, device_types=(device_type,), array_api=array_api)
    p.kernel("softmax", name="identity")(identity)
    p.kernel("softmax_backward", name="identity")(lambda grad_out, out, dim: grad_out)
    p.kernel("layer_norm", name="identity")(lambda x, normalized_shape, weight, bias, eps: x)
    p.kernel("layer_norm_backward", name="identity")(lambda grad_out, x, normalized_shape, weight, eps: (grad_out, weight, weight))
    p.kernel("linear", name="identity")(lambda x, weight, bias, act: x)
    p.kernel("linear_backward", name="identity")(lambda grad_out, x, weight, bias, act, output_mask: (grad_out, weight, bias))
    p.kernel("scale_shift_act", name="identity")(lambda x, scale, shift, act: x)
    p.kernel("scale_shift_act_backward", name="identity")(lambda grad_out, x, scale, shift, act, output_mask: (grad_out, None, None))
    return p


def forward_backward(fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any) -> None:
        fn(*args).backward(GRAD)

    return run


GRAD = torch.ones(4, 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=21)
    parser.add_argument("--number", type=int, default=20000)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for the torch rows on CUDA tensors")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    dev = torch.device(args.device)
    torch.set_num_threads(1)  # tiny tensors: no intra-op parallelism on either side (steadier on a shared machine)
    rep, num, slow = args.repeat, args.number, max(1, args.number // 10)
    rows: list[dict[str, Any]] = []

    def row(case: str, hal_call: tuple, peer_call: tuple, number: int = num) -> None:
        rows.append({"case": case, **paired(hal_call, peer_call, rep, number)})

    previous = dispatch.install(None)
    try:
        dispatch.install(Runtime.from_plugins([trivial_plugin("numpy")]))
        x = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)
        row("kernel route: numpy, softmax(x) (dim canonicalised) vs the kernel", (hal.ops.softmax, (x,)), (identity, (x, 1)))
        row("kernel route: numpy, softmax(x, 1) vs the kernel", (hal.ops.softmax, (x, 1)), (identity, (x, 1)))

        dispatch.install(Runtime.from_plugins([trivial_plugin("torch", dev.type)]))
        t = torch.randn(4, 4, device=dev)
        row("kernel route: torch, softmax(t, 1), grad mode vs the kernel", (hal.ops.softmax, (t, 1)), (identity, (t, 1)))
        with torch.no_grad():
            row("kernel route: torch, softmax(t, 1), no_grad vs the kernel", (hal.ops.softmax, (t, 1)), (identity, (t, 1)))
        # under torch.autocast (entered once, outside the loops): the autocast state is part of the
        # call's key, and the cached plan casts what the op's rule names, then runs with autocast off
        w4, b4 = torch.randn(4, 4, device=dev), torch.randn(4, device=dev)
        half = torch.bfloat16
        lin = lambda x, w, b: hal.ops.linear(x, w, b)  # noqa: E731
        casts = lambda x, w, b: (x.to(half), w.to(half), b.to(half))  # noqa: E731 - what the rule does, without hal
        with torch.autocast(dev.type, dtype=half):
            row("kernel route under autocast: softmax(t, 1) vs the kernel", (hal.ops.softmax, (t, 1)), (identity, (t, 1)))
            row("kernel route under autocast: linear(x, w, b) in bfloat16 (nothing to cast) vs the kernel",
                (lin, (t.to(half), w4.to(half), b4.to(half))), (identity, (t, 1)))
            row("kernel route under autocast: linear(x, w, b) in float32 (3 casts) vs the 3 casts",
                (lin, (t, w4, b4)), (casts, (t, w4, b4)))

        tg = torch.randn(4, 4, device=dev, requires_grad=True)
        w, b = torch.randn(4, device=dev, requires_grad=True), torch.randn(4, device=dev, requires_grad=True)
        wl = torch.randn(4, 4, device=dev, requires_grad=True)
        global GRAD
        GRAD = GRAD.to(dev)
        hal_ln = lambda x: hal.ops.layer_norm(x, (4,), w, b)  # noqa: E731
        torch_ln = lambda x: F.layer_norm(x, (4,), w, b)  # noqa: E731
        hal_lin = lambda x: hal.ops.linear(x, wl, b, "gelu")  # noqa: E731
        torch_lin = lambda x: F.gelu(F.linear(x, wl, b))  # noqa: E731
        hal_sm = lambda x: hal.ops.softmax(x, 1)  # noqa: E731
        torch_sm = lambda x: torch.softmax(x, 1)  # noqa: E731
        for name, h, p in (("softmax", hal_sm, torch_sm), ("layer_norm", hal_ln, torch_ln), ("linear + gelu", hal_lin, torch_lin)):
            row(f"autograd forward: {name} vs torch's", (h, (tg,)), (p, (tg,)), slow)
            row(f"autograd forward + backward: {name} vs torch's", (forward_backward(h), (tg,)), (forward_backward(p), (tg,)), slow)

        # a kernel that is torch's own op, registered differentiable: torch's autograd records it
        recorded = Plugin("bench_recorded", "1.0")
        recorded.define_backend(priority=1000, device_types=(dev.type,), array_api="torch")
        recorded.kernel("softmax", name="torch", differentiable=True)(lambda x, dim: torch.softmax(x, dim))
        dispatch.install(Runtime.from_plugins([recorded]))
        name = "softmax, recorded by torch's autograd,"
        row(f"autograd forward: {name} vs torch's", (hal_sm, (tg,)), (torch_sm, (tg,)), slow)
        row(f"autograd forward + backward: {name} vs torch's", (forward_backward(hal_sm), (tg,)), (forward_backward(torch_sm), (tg,)), slow)

        @torch.library.custom_op("hal_bench::identity", mutates_args=())
        def custom(x: torch.Tensor, dim: int) -> torch.Tensor:
            return x.clone()  # custom ops may not return an alias of an input

        clone = lambda x, dim: x.clone()  # noqa: E731 - the same work without the custom op
        row("peer: torch.library.custom_op vs the same work", (custom, (t, 1)), (clone, (t, 1)))
    finally:
        dispatch.install(previous)

    relu = lambda x: hal.ops.scale_shift_act(x, 1.0, 0.0, "relu")  # noqa: E731
    row("installed backends: numpy, scale_shift_act relu vs np.maximum", (relu, (x,)), (np.maximum, (x, 0)))
    row("installed backends: scale_shift_act relu, numpy vs torch tensor", (relu, (x,)), (relu, (torch.from_numpy(x.copy()),)))
    softmax = lambda x: hal.ops.softmax(x, -1)  # noqa: E731 - numba's kernel for a NumPy caller (since 2026-12-07), torch's for a tensor
    row("installed backends: softmax, numpy vs torch tensor", (softmax, (x,)), (softmax, (torch.from_numpy(x.copy()),)))

    backward_rows = {}
    for r in rows:
        if r["case"].startswith("autograd forward + backward: "):
            name = r["case"].split(": ", 1)[1]
            fwd = next(f for f in rows if f["case"] == f"autograd forward: {name}")
            backward_rows[name] = r["overhead_ns"] - fwd["overhead_ns"]
    if args.json:
        print(json.dumps({"rows": rows, "backward_overhead_ns": backward_rows}, indent=2))
        return
    print(f"torch {torch.__version__}, hal {hal.__version__}, tensors on {dev}; {rep} alternating loops of {num} calls (autograd rows: {slow})")
    print(f"{'case':<78}{'hal ns':>9}{'peer ns':>10}{'overhead ns':>13}")
    for r in rows:
        print(f"{r['case']:<78}{r['hal_ns']:>9}{r['peer_ns']:>10}{r['overhead_ns']:>13}")
    for name, ns in backward_rows.items():
        print(f"backward pass alone, {name}: hal over torch {ns} ns")


if __name__ == "__main__":
    main()
