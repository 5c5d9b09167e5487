"""Host time of an eager training step of a Hugging Face Llama patched by ``hal.nn.patch`` (with
``hal.optim.AdamW``) against the same model in eager torch (torch's fused AdamW): issue 40's "eager
host time" target, measured on the CPU with a model so small that the kernels' work is negligible
and what is left is what each side spends issuing the step.

The model is ``transformers``' ``LlamaForCausalLM`` built as ``hal bench --models hf_llama1b_train``
builds it (:class:`hal_bench.models_big.HFLlama1BTrain`: the loss in the model's forward, SDPA
attention, tied embeddings, GQA), the same structure and layer count as Llama-3.2-1B (16 layers,
GQA 4/1 here instead of 32/8) at d 64, ffn 256, vocabulary 256, T 16, batch 2, under bf16
autocast (``--amp fp32``: none). The two variants are the ``torch`` and ``hal`` columns of that
row, built by the workload itself (``HFCausalLMTrain.make``).

Printed:

- per-step host time of each variant (``time.thread_time`` of the thread issuing the step: on
  the CPU every op runs synchronously, so that is the step; one torch thread), the median over
  ``--rounds`` rounds of ``--steps`` steps, the variants alternating round by round (a shared
  machine's drift falls on both), and hal over torch with the range of the per-round ratios;
- the same per phase (forward under autocast, backward, optimizer step and zero_grad), for each
  model with each optimizer (so the optimizer's share shows apart from the model's);
- ``hal.ops`` calls per step, by (op, backend, kernel), from ``hal.stats()``;
- per call, at the model's shapes and dtypes: each hal op the patched model calls (under autocast,
  inputs requiring grad, as in the model) against its chosen kernel called in a bare
  ``torch.autograd.Function`` (or directly, where torch's autograd records the kernel), forward and
  forward + backward: what hal's dispatch, autocast handling and autograd node add over the kernel;
- with ``--profile N``: a cProfile of N steps of each variant (functions with the most own time).

    python benchmarks/host_patched_step.py [--rounds 15] [--steps 5] [--amp bf16|fp32] [--layers 16]
        [--no-per-call] [--profile 20]

HAL_TUNE is on (the default a user has) with a fresh tune cache per process (``HAL_TUNE_CACHE``
set to a temporary directory unless given), so the measured choices are this run's own.

History
-------

2026-12-07 (issue 40, "eager host time"; the project's 2-core AMD EPYC VM, torch 2.13.0+cpu,
transformers 5.x, one torch thread, bf16 autocast, load 0-2 from other sessions; base ``19dc5f2``).
Before: torch 27.10 ms/step, hal 33.99 ms (1.25x); by phase forward 10.72 / 14.59 ms, backward
14.07 / 17.10, optimizer (+zero_grad) 2.19 (torch's fused) / 1.90 (hal's): the optimizer is not
it, the model is (+3.9 ms forward, +3.0 ms backward). Per call, hal over its kernel in a bare
autograd Function (forward / forward + backward): rms_norm +0.5 / +11, rotary_embedding +0.4 / +3,
swiglu (recorded by torch's autograd) +1.7 / +2.6, scaled_dot_product_attention +5.6 / +18 us,
against a step gap of about 7000 us over 179 hal calls a step (33 rms_norm, 32 rotary, 16 sdpa, 16
swiglu, 1 linear_cross_entropy forward; 33 + 32 + 16 backward ops in hal's nodes, fused_adamw_):
hal's dispatch was about 1 ms of it. The rest was the kernels the CPU backend chose at these
shapes, the attention above all: the grouped (B, Hkv, G, T, E) query went to torch's math path
(5-D broadcast) forward and hal's GEMM backward (about 20 torch ops) in hal's node, 300 us forward
+ backward a layer against 114 us for torch's flash CPU kernels with ``enable_gqa``, which eager
HF runs.

After (the same VM and day, load 1.2-1.9; the tree of the commit adding this script): the CPU
backend's ``flash`` kernel serves the grouped layout (torch's flash CPU kernels with
``enable_gqa``, recorded by torch's autograd; the measured choice timed it at 150 against 242 us
forward + backward for the ``torch`` kernel in hal's node at this shape); the entry's autocast path
is one prepared function per op (``hal.dispatch.autocast.caller``: SDPA's per-call overhead over its
kernel +5.6 -> +2.4 us forward; it had rebuilt the op's parameter-name tuple four times a call);
the patched attention computes the rotary halves once for q and k. Whole step torch 24.41 ms
(22.84-30.52), hal 27.97 (25.23-37.97): 1.146x (per-round ratios 0.92-1.66, median 1.126); by
phase 24.50 / 28.24 ms, forward 9.53 / 12.68, backward 12.83 / 13.97, optimizer 2.04 / 1.68 (an
earlier run of the same tree: 26.58 / 28.86, 1.086x). hal's own cost per call over its kernel is
now 0-2.4 us forward and 1-5 us forward + backward (rows above); what is left of the gap is the
CPU kernels at these shapes (the rotary kernel's float32 rotation, 11 torch ops, against HF's 6 on
q and k each; the numba rms_norm pair converting to NumPy; the Python of the patched attention)
and is not the CUDA path's, whose kernels are Triton's and cuDNN's.

2026-12-07, later (the same VM, load 0.8-2.5 from other sessions; base: ``66d0b65``'s dispatcher, CPU
backend and hal.nn.patch, against ``21806c5``, beside the other sessions' commits in between;
alternated process by process). Whole step, this script, 3 runs each: base 1.363x, 1.160x,
1.176x (per-round medians 1.244, 1.157, 1.192; phase sums 1.152, 1.141, 1.149), after 1.038x,
1.034x, 0.998x (per-round medians 1.013, 1.046, 1.003; phase sums 1.029, 1.054, 1.033): by phase
(the last run) torch 9.00 / 11.96 / 2.02 ms, hal 10.24 / 11.67 / 1.78 (forward, backward,
optimizer). A process-alternating harness (40 rounds of 2 steps, 6 processes each, the 10th
percentile of rounds) gave 1.14-1.15x -> 1.03-1.04x. What moved:

- the dispatcher (carries to CUDA, where host time is this path): under autocast a call is one key
  and one lookup (``hal.dispatch.autocast.planner``; it had cast-checked every named argument and
  called the entry a second time with autocast off): about 0.6-0.9 us a call without casts, 1.5-1.8
  with bfloat16 SDPA arguments, 2.4-3.6 where arguments are cast (benchmarks/dispatch_overhead.py);
  hal.nn.patch's RMSNorm makes no ``Tensor.to`` calls that return their tensor (about 1.6 us a call);
- the CPU kernels (the VM's alone): rotary_embedding and its backward as one numba pass (8.6 against
  22.1 us at q's (2, 4, 16, 16) bfloat16, bit for bit the torch kernel's results); the numba RMS
  norm runs small calls serially (its OpenMP barrier had cost up to 250 ms a step when another
  process held the second core: one of this script's runs at base showed hal at 258 ms a step),
  reads a float32 weight without a float64 copy and sums the weight gradient of a serial call in
  one block (backward 8.7 -> 4.4 us); the flash kernel's overlap test is torch's C test first.

What is left is the forward (about 1-1.7 ms a step; the backward and the optimizer are now at or
below torch's): per hal call about 2.5 us of entry (the key of three or four tensors, the autocast
state, the lookup), 0.5 of the autocast toggle and about 3 of hal's autograd node (65 node calls a
forward), and outside this script's files the patched attention's Python (the rotary halves made
per layer, ``realized`` per layer, two ``Tensor.to`` that return their tensor, the grouped 5-D
layout's seven view ops a layer, each recorded by autograd): a leaner attention forward,
monkeypatched in a scratch script, took the step from 1.028x to 1.006x (paired medians, one process).

2026-12-07, last (the same VM, load 0.1-1.9 from other sessions; base ``df1fdec``, after ``ccf3670``,
which changes hal/nn/patch_hf.py alone): the patched attention cuts the rotary halves once per forward
(views of HF's cos and sin, found by their identity, released with them; per layer inside
torch.compile, as before), makes no ``Tensor.to`` call that returns its tensor, and leaves the grouped
layout in one permute and reshape. This script with ``--no-per-call``, processes alternated, 3 runs
each: base 1.027x, 1.046x, 1.111x (per-round medians 1.012, 1.023, 1.025; phase sums 1.035, 1.045,
1.051), after 1.019x, 0.954x, 0.932x (per-round medians 1.007, 1.038, 0.990; phase sums 0.999, 1.031,
1.018). The quietest pair: base torch 22.66 ms (21.57-32.76), hal 23.26 (21.37-44.42), forward 8.79 /
9.88; after torch 24.13 (22.75-38.21), hal 24.60 (22.45-36.39), forward 8.88 / 9.77. In one process
(the base's patch_hf loaded beside this one, 16 layers, single forwards alternated 200-300 times),
the forward's paired median moved -441 and -316 us (25th percentiles 10.04 -> 9.57 and 9.91 -> 9.49
ms), where the base against itself gave -108 us. Still left in the forward: hal's entry and autograd
node per call (unchanged) and transformers 5.x's config reads (2.7-2.9 us each through its
``__getattribute__``): the patched attention reads ``_attn_implementation`` and ``output_attentions``
a layer, HF's attention the first only.

2026-12-07, per call (issue 40's per-call part; the same VM, load 0.6-1.0 from other sessions; base
``4b5f27a``, after ``307e756``, which change hal/dispatch alone). Where a forward hal call's host time
went, by ``perf_counter_ns`` loops in one process at the model's shapes: the entry with its cached plan
replaced by one doing nothing 1.8-3.1 us for rms_norm, 2.2-3.8 for rms_norm_backward (runs differed
that much): a tensor's part of the key 0.5 (dtype, device, shape, ``stride()``, requires_grad, about
0.1 each), the autocast state 0.5-0.7, ``is_compiling``, autocast's C flag and grad mode about 0.1
each, the rest the tuple, its hash and the lookup; the autocast toggle around the plan 0.35; hal's node
0.7 over the plainest Function running the same function (torch's saving 0.26 of it, the kept-state
arming and ``ctx.hal`` the rest; setting ``ctx.to_save`` directly was no cheaper), ``Function.apply``
itself about 3.0. Not counted before: the array conversion around the CPU backend's numba RMS norm,
whose general runner's Python cost 1.3 us of a forward and 2.3 us of a backward beside the conversions
themselves. What moved: a torch caller's plan for a NumPy kernel converts exactly the slots its key
names (``hal.dispatch.adapt._torch_into_numpy``; in one process 5.2 -> 4.5 us forward, 9.0 -> 8.0 us
backward, the kernels on NumPy arrays 2.3 and 4.2), and a static ``Optional[float]`` (eps, SDPA's
scale), None or int is keyed inline (it had taken ``argkey``'s two frames). Per call, us, under bf16
autocast with inputs requiring grad (a scratch script, 6 processes per tree alternated, medians over
processes and their ranges): rms_norm forward 14.40 (13.98-14.63) -> 13.38 (13.13-14.69), forward +
backward 46.33 (44.45-47.93) -> 43.77 (42.32-49.27), rms_norm_backward alone (no grad, no autocast)
13.29 (12.92-13.43) -> 12.39 (12.01-13.20); rotary_embedding, whose path did not change, 16.77 -> 16.62
forward and 43.45 -> 42.92 forward + backward. The whole step (this script with ``--no-per-call``,
processes alternated) did not move beyond the noise, as the savings per call predict (about 0.07 ms of
a 23 ms step): 4 runs each, base 0.998x, 0.980x, 1.004x, 0.997x (hal's forward over torch's 1.107,
1.093, 1.091, 1.119), after (``4194c82``, the same for float32 tensors) 0.995x, 0.993x, 0.978x (forward
1.089, 1.094, 1.103; a fourth ran while adapt.py was being edited and is left out); again at
``307e756`` while the VM slowed (torch's own step 24.9 -> 42.4 ms over the series): base 1.028x,
1.027x, 1.092x, 0.990x (forward 1.086, 1.061, 1.150, 1.163), after 0.985x, 0.990x, 0.972x, 1.012x
(forward 1.091, 1.070, 1.103, 1.075). Not done: caching the backward op's decision in the node. A key
exactly the dispatcher's needs the saved tensors' dtype, device, shape, strides and requires_grad as
they are at backward time, which torch does not guarantee are the forward's (``requires_grad_`` on a
leaf and ``.data`` assignment leave the version counter alone), and computing them is most of what the
backward op's entry costs; what a node could skip beyond that (``is_compiling``, type tests) is about
0.3 us a call.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import os
import pstats
import statistics
import tempfile
import time
from typing import Any, Callable

os.environ.setdefault("HAL_TUNE_CACHE", tempfile.mkdtemp(prefix="hal-tune-host-step-"))

import torch  # noqa: E402

import hal  # noqa: E402
from hal.config import choice_for  # noqa: E402
from hal.dispatch.dispatcher import DISPATCHER  # noqa: E402
from hal.registry import OPS  # noqa: E402
from hal_bench.models_big import HFLlama1BTrain  # noqa: E402

CPU = torch.device("cpu")


def workload(args: argparse.Namespace) -> HFLlama1BTrain:
    """Llama-3.2-1B's row at a size where the kernels' work is negligible (module docstring)."""
    w = HFLlama1BTrain("tiny")
    w.shape = dataclasses.replace(w.shape, vocab=256, dim=64, layers=args.layers, heads=4, kv_heads=1, ffn=256)
    w.vocab, w.seq, w.batch = 256, 16, 2
    w.amp_dtype = torch.bfloat16 if args.amp == "bf16" else None
    return w


def phased_step(w: HFLlama1BTrain, model_impl: str, opt_impl: str) -> Callable[[], tuple[float, float, float]]:
    """One training step as the workload's (forward with the loss under autocast, backward, the
    optimizer's step and zero_grad), returning each phase's thread time in seconds."""
    model = w.build_model(0, CPU)
    if model_impl == "hal":
        hal.nn.patch(model)
    if opt_impl == "hal":
        opt: torch.optim.Optimizer = hal.optim.AdamW(model.parameters(), lr=w.lr, eps=w.eps)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=w.lr, eps=w.eps, fused=True)
    tokens = w.tokens(0, CPU)
    amp = w.amp_dtype
    clock = time.thread_time

    def step() -> tuple[float, float, float]:
        t0 = clock()
        with torch.autocast("cpu", dtype=amp or torch.float32, enabled=amp is not None):
            loss = model(input_ids=tokens, labels=tokens).loss
        t1 = clock()
        loss.backward()
        t2 = clock()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = clock()
        return t1 - t0, t2 - t1, t3 - t2

    return step


def time_steps(args: argparse.Namespace, w: HFLlama1BTrain) -> None:
    """The two variants' whole steps (the workload's own), then the phases of every model/optimizer pair."""
    steps = {impl: w.make(impl, None, CPU, 0) for impl in ("torch", "hal")}
    for s in steps.values():
        for _ in range(5):
            s()
    per_round: dict[str, list[float]] = {k: [] for k in steps}
    clock = time.thread_time
    for _ in range(args.rounds):
        for k, s in steps.items():
            t0 = clock()
            for _ in range(args.steps):
                s()
            per_round[k].append((clock() - t0) / args.steps * 1e3)
    med = {k: statistics.median(v) for k, v in per_round.items()}
    ratios = sorted(h / t for h, t in zip(per_round["hal"], per_round["torch"]))
    print(f"whole step, host ms (median of {args.rounds} rounds of {args.steps}, alternating; range over rounds):")
    for k, v in per_round.items():
        print(f"  {k:<6} {med[k]:8.2f}  ({min(v):.2f}-{max(v):.2f})")
    print(f"  hal / torch {med['hal'] / med['torch']:.3f}x  (per-round ratios {ratios[0]:.3f}-{ratios[-1]:.3f}, "
          f"median {statistics.median(ratios):.3f})")

    pairs = [("torch", "torch"), ("hal", "hal"), ("hal", "torch"), ("torch", "hal")]
    phased = {p: phased_step(w, *p) for p in pairs}
    for s in phased.values():
        for _ in range(5):
            s()
    rows: dict[tuple[str, str], list[tuple[float, float, float]]] = {p: [] for p in pairs}
    for _ in range(args.rounds * args.steps):
        for p, s in phased.items():
            rows[p].append(s())
    print("\nby phase, host ms (median over steps): forward (with the loss, under autocast), backward, optimizer step + zero_grad")
    for p, r in rows.items():
        f, b, o = (statistics.median(c) * 1e3 for c in zip(*r))
        print(f"  model {p[0]:<6} optimizer {p[1]:<6} forward {f:7.2f}  backward {b:7.2f}  optimizer {o:6.2f}  "
              f"sum {statistics.median(sum(x) for x in r) * 1e3:7.2f}")


def count_calls(w: HFLlama1BTrain) -> None:
    step = w.make("hal", None, CPU, 0)
    for _ in range(3):
        step()
    hal.reset_stats()
    step()
    calls = {k: v["calls"] for k, v in hal.stats().items() if v["calls"]}
    print(f"\nhal.ops calls in one step of the hal variant ({sum(calls.values())}):")
    for (op, backend, kernel), n in sorted(calls.items(), key=lambda kv: -kv[1]):
        print(f"  {n:5d}  {op} ({backend}/{kernel})")


def _loop(fn: Callable[[], Any], n: int) -> float:
    t0 = time.thread_time()
    for _ in range(n):
        fn()
    return (time.thread_time() - t0) / n * 1e6


def paired(a: Callable[[], Any], b: Callable[[], Any], n: int = 300, reps: int = 15) -> tuple[float, float, float]:
    """Medians of both (us per call) and the median of their paired differences."""
    _loop(a, 30)
    _loop(b, 30)
    ta, tb = [], []
    for _ in range(reps):
        ta.append(_loop(a, n))
        tb.append(_loop(b, n))
    return statistics.median(ta), statistics.median(tb), statistics.median(x - y for x, y in zip(ta, tb))


def _kernel_of(op: str, *args: Any) -> tuple[Callable[..., Any], str]:
    decided = DISPATCHER.decide(OPS[op], args, choice_for(op, None))
    return decided.route.option.fn, decided.route.kind


def _bare_node(fn: Callable[..., Any], bwd: Callable[..., Any], bargs: Callable[..., tuple]) -> Callable[..., Any]:
    """The kernel and its backward kernel in the plainest autograd Function (the peer of hal's node)."""

    class Bare(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *a: Any) -> Any:
            ctx.save_for_backward(*[t for t in a if isinstance(t, torch.Tensor)])
            ctx.a = a
            return fn(*a)

        @staticmethod
        def backward(ctx: Any, go: torch.Tensor) -> tuple:
            ctx.saved_tensors
            r = bwd(*bargs(go, ctx.a))
            r = r if isinstance(r, tuple) else (r,)
            r = (*r, *([None] * (len(ctx.a) - len(r))))
            return tuple(g if isinstance(a, torch.Tensor) else None for g, a in zip(r, ctx.a))

    return Bare.apply


def per_call(args: argparse.Namespace) -> None:
    """hal's ops at the patched model's shapes against their kernels (module docstring)."""
    bf = torch.bfloat16 if args.amp == "bf16" else torch.float32
    amp = lambda: torch.autocast("cpu", dtype=bf, enabled=args.amp == "bf16")  # noqa: E731

    def r(*s: int, dt: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*s, dtype=dt).requires_grad_()

    c = torch.randn(2, 1, 16, 8)
    cases = [
        ("rms_norm", (r(2, 16, 64), (64,), r(64), 1e-5), "rms_norm_backward", lambda go, a: (go, *a)),
        ("rotary_embedding", (r(2, 4, 16, 16, dt=bf), c, c, False), "rotary_embedding_backward", lambda go, a: (go, *a[1:])),
        ("swiglu", (r(2, 16, 256, dt=bf), r(2, 16, 256, dt=bf)), "swiglu_backward", lambda go, a: (go, *a)),
        ("scaled_dot_product_attention", (r(2, 1, 4, 16, 16, dt=bf), r(2, 1, 1, 16, 16, dt=bf), r(2, 1, 1, 16, 16, dt=bf), None, True, 0.25),
         "scaled_dot_product_attention_backward", lambda go, a: (go, *a)),
    ]
    print("\nper call, us (median of paired rounds): hal.ops under autocast with grad-requiring inputs, against its kernel "
          "in a bare autograd Function (or recorded by torch's autograd, as hal's route)")
    for op, a, bop, bargs in cases:
        f = getattr(hal.ops, op)
        with amp():
            out = f(*a)
        go = torch.randn_like(out)
        fn, kind = _kernel_of(op, *a)
        if kind == "node":
            detached = [t.detach() if isinstance(t, torch.Tensor) else t for t in a]
            bwd, _ = _kernel_of(bop, *bargs(go, detached))
            peer = _bare_node(fn, bwd, bargs)
        else:
            peer = fn

        def hal_fwd() -> None:
            with amp():
                f(*a)

        def peer_fwd() -> None:
            with amp(), torch.autocast("cpu", enabled=False):
                peer(*a)

        def hal_fb() -> None:
            with amp():
                y = f(*a)
            y.backward(go)

        def peer_fb() -> None:
            with amp(), torch.autocast("cpu", enabled=False):
                y = peer(*a)
            y.backward(go)

        h, k, d = paired(hal_fwd, peer_fwd)
        h2, k2, d2 = paired(hal_fb, peer_fb)
        print(f"  {op:<30} {kind:<9} forward {h:7.1f} vs {k:7.1f} ({d:+6.1f})   forward + backward {h2:7.1f} vs {k2:7.1f} ({d2:+6.1f})")


def profile(args: argparse.Namespace, w: HFLlama1BTrain) -> None:
    for impl in ("torch", "hal"):
        step = w.make(impl, None, CPU, 0)
        for _ in range(5):
            step()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.profile):
            step()
        prof.disable()
        print(f"\ncProfile of {args.profile} steps, {impl}:")
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--amp", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--no-per-call", action="store_true")
    parser.add_argument("--profile", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    w = workload(args)
    print(f"torch {torch.__version__}, hal {hal.__version__}; HF Llama {args.layers} layers, d 64, GQA 4/1, T 16, batch 2, "
          f"{args.amp}{' autocast' if args.amp == 'bf16' else ''}, one thread; HAL_TUNE_CACHE {os.environ['HAL_TUNE_CACHE']}")
    time_steps(args, w)
    count_calls(w)
    if not args.no_per_call:
        per_call(args)
    if args.profile:
        profile(args, w)


if __name__ == "__main__":
    main()
