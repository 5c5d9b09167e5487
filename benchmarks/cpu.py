"""hal's CPU backend against the torch call, op by op, on realistic shapes (issue 15's table,
ResNet-50 stage-1 convolutions, transformer widths), with torch tensors and with NumPy arrays.

    .venv/bin/python benchmarks/cpu.py [--ops conv2d,linear] [--json out.json]

Every case times, interleaved in one loop so that machine noise hits all alike, the best of N runs
of: the torch call a PyTorch user writes (``torch``, plus ``extra`` peers where there is more than
one natural call), hal with torch tensors (``hal``) and hal with NumPy arrays (``numpy``). Printed
ratios: torch / hal (> 1: hal is faster) and numpy / hal (the cost of NumPy input; <= 1.2 is the
issue's target). Threads: torch's default (all cores). The issue's targets are judged per row.
Backward ops are timed against autograd's backward of the eager forward, its graph built once
(what a PyTorch training step runs); hal's backward ops recompute what they need from the inputs.
The ``train_step`` rows time what a training step pays for an op: its forward with autograd and
the backward, torch's op against hal's (a hal forward may keep what its backward needs).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

import hal
from hal.arrays import to_numpy

Fn = Callable[[], Any]
FUSED = {"fused_conv_bn_relu", "linear", "scale_shift_act", "fused_adamw_"}


@dataclass
class Case:
    op: str
    name: str
    torch: Fn
    hal: Fn
    numpy: Optional[Fn] = None
    extra: dict[str, Fn] = field(default_factory=dict)
    target: float = 1.0


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed + len(shape)).standard_normal(shape).astype(np.float32))


def _np(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return to_numpy(v)
    if isinstance(v, (list, tuple)):
        return type(v)(_np(x) for x in v)
    return v


def _hal_pair(op: str, *args: Any, **kwargs: Any) -> tuple[Fn, Fn]:
    """The hal call with these torch arguments, and the same with NumPy views of them."""
    fn = getattr(hal.ops, op)
    nargs, nkw = _np(args), {k: _np(v) for k, v in kwargs.items()}
    return (lambda: fn(*args, **kwargs)), (lambda: fn(*nargs, **nkw))


def _autograd(forward: Callable[..., torch.Tensor], inputs: list[torch.Tensor], grad: torch.Tensor) -> Fn:
    """autograd's backward of forward(*inputs), the graph built once."""
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    out = forward(*leaves)
    return lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True)


def _step(forward: Callable[..., torch.Tensor], inputs: list[torch.Tensor], grad: torch.Tensor) -> Fn:
    """A training step's share of an op: forward with autograd, then its backward."""
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    return lambda: torch.autograd.grad(forward(*leaves), leaves, grad)


def cases() -> list[Case]:
    out: list[Case] = []

    def add_step(op: str, name: str, torch_forward: Callable[..., torch.Tensor], hal_forward: Callable[..., torch.Tensor],
                 inputs: list[torch.Tensor], grad: torch.Tensor) -> None:
        """Forward + backward through autograd, torch's op against hal's (no NumPy column: arrays
        have no autograd). A backward op timed alone recomputes what its forward had at hand;
        here hal's forward may keep it for the backward, as torch's does."""
        out.append(Case(op, name, _step(torch_forward, inputs, grad), _step(hal_forward, inputs, grad)))

    def add(op: str, name: str, torch_fn: Fn, *args: Any, extra: Optional[dict[str, Fn]] = None, **kwargs: Any) -> None:
        h, n = _hal_pair(op, *args, **kwargs)
        out.append(Case(op, name, torch_fn, h, n, extra or {}, 1.3 if (op in FUSED and name.endswith("*")) else 1.0))

    # convolution and batch norm: ResNet-50 stage 1, issue 15's (8, 64, 56, 56) x (64, 64, 3, 3)
    x, w, b = _rand(8, 64, 56, 56), _rand(64, 64, 3, 3) * 0.05, _rand(64)
    add("conv2d", "r50_3x3_b8", lambda: F.conv2d(x, w, b, 1, 1), x, w, b, padding=1)
    g = _rand(8, 64, 56, 56, seed=1)
    add("conv2d_backward", "r50_3x3_b8", _autograd(lambda a, c: F.conv2d(a, c, None, 1, 1), [x, w], g), g, x, w, padding=1)
    rm, rv, gam, bet = _rand(64) * 0.1, torch.rand(64) + 0.5, _rand(64), _rand(64)
    add("batch_norm", "eval_b8", lambda: F.batch_norm(x, rm, rv, gam, bet, False), x, rm, rv, gam, bet)
    rm2, rv2 = rm.clone(), rv.clone()
    add("batch_norm", "train_b8", lambda: F.batch_norm(x, rm2, rv2, gam, bet, True), x, rm2, rv2, gam, bet, training=True)
    add("batch_norm_backward", "train_b8", _autograd(lambda a, c: F.batch_norm(a, None, None, c, None, True), [x, gam], g), g, x, None, None, gam, training=True)
    rm3, rv3 = rm.clone(), rv.clone()
    add_step("batch_norm", "train_step_b8", lambda a, c, d: F.batch_norm(a, rm3, rv3, c, d, True),
             lambda a, c, d: hal.ops.batch_norm(a, rm3, rv3, c, d, True), [x, gam, bet], g)
    add("fused_conv_bn_relu", "eval_b8*", lambda: F.relu(F.batch_norm(F.conv2d(x, w, b, 1, 1), rm, rv, gam, bet, False)),
        x, w, b, gam, bet, rm, rv, padding=1)
    add("fused_conv_bn_relu", "train_b8", lambda: F.relu(F.batch_norm(F.conv2d(x, w, b, 1, 1), rm2, rv2, gam, bet, True)),
        x, w, b, gam, bet, rm2, rv2, padding=1, training=True)
    add("fused_conv_bn_relu_backward", "train_b8",
        _autograd(lambda a, c: F.relu(F.batch_norm(F.conv2d(a, c, None, 1, 1), None, None, gam, bet, True)), [x, w], g),
        g, x, w, None, gam, bet, None, None, padding=1, training=True)

    # elementwise: per channel on the conv output, per feature on a transformer activation
    s_c, h_c = torch.rand(64, 1, 1) + 0.5, _rand(64, 1, 1)
    add("scale_shift_act", "channel_relu_b8*", lambda: F.relu(x * s_c + h_c), x, s_c, h_c, "relu")
    t = _rand(4096, 1024)
    s_r, h_r = torch.rand(1024) + 0.5, _rand(1024)
    add("scale_shift_act", "row_gelu_4096x1024*", lambda: F.gelu(t * s_r + h_r), t, s_r, h_r, "gelu")
    add("scale_shift_act", "row_silu_4096x1024*", lambda: F.silu(t * s_r + h_r), t, s_r, h_r, "silu")
    gt = _rand(4096, 1024, seed=2)
    add("scale_shift_act_backward", "row_gelu_4096x1024",
        _autograd(lambda a, c, d: F.gelu(a * c + d), [t, s_r, h_r], gt), gt, t, s_r, h_r, "gelu")

    # GEMMs: issue 15's (2048, 1024) x (1024, 1024)
    a, wl, bl = _rand(2048, 1024), _rand(1024, 1024) * 0.03, _rand(1024)
    add("linear", "2048x1024x1024", lambda: F.linear(a, wl, bl), a, wl, bl)
    for act, fn in (("relu", F.relu), ("gelu", F.gelu), ("gelu_tanh", lambda z: F.gelu(z, approximate="tanh"))):
        add("linear", f"2048x1024x1024_{act}*", lambda fn=fn: fn(F.linear(a, wl, bl)), a, wl, bl, act)
    ga = _rand(2048, 1024, seed=3)
    add("linear_backward", "2048x1024x1024_gelu", _autograd(lambda p, q, r: F.gelu(F.linear(p, q, r)), [a, wl, bl], ga), ga, a, wl, bl, "gelu")
    add("matmul", "2048x1024x1024", lambda: a @ wl, a, wl)
    add("matmul_backward", "2048x1024x1024", _autograd(lambda p, q: p @ q, [a, wl], ga), ga, a, wl)
    xg, wg, sizes = _rand(4096, 512), _rand(8, 512, 512) * 0.05, torch.full((8,), 512, dtype=torch.int64)
    add("grouped_gemm", "moe_8x512", lambda: torch.cat([p @ wg[i] for i, p in enumerate(xg.split(512))]), xg, wg, sizes)
    gg = _rand(4096, 512, seed=4)
    add("grouped_gemm_backward", "moe_8x512",
        _autograd(lambda p, q: torch.cat([r @ q[i] for i, r in enumerate(p.split(512))]), [xg, wg], gg), gg, xg, wg, sizes)

    # norms, softmax, attention at transformer widths (issue 15's (4096, 1024))
    wn, bn_ = torch.rand(1024) + 0.5, _rand(1024)
    add("layer_norm", "4096x1024", lambda: F.layer_norm(t, (1024,), wn, bn_), t, 1024, wn, bn_)
    add("layer_norm_backward", "4096x1024", _autograd(lambda p, q: F.layer_norm(p, (1024,), q, bn_), [t, wn], gt), gt, t, 1024, wn)
    add_step("layer_norm", "train_step_4096x1024", lambda p, q, r: F.layer_norm(p, (1024,), q, r),
             lambda p, q, r: hal.ops.layer_norm(p, 1024, q, r), [t, wn, bn_], gt)
    add("rms_norm", "4096x1024", lambda: F.rms_norm(t, (1024,), wn, 1e-6), t, 1024, wn, 1e-6)
    add("rms_norm_backward", "4096x1024", _autograd(lambda p, q: F.rms_norm(p, (1024,), q, 1e-6), [t, wn], gt), gt, t, 1024, wn, 1e-6)
    add("softmax", "4096x1024", lambda: torch.softmax(t, -1), t, -1)
    sm = torch.softmax(t, -1)
    add("softmax_backward", "4096x1024", lambda: torch._softmax_backward_data(gt, sm, 1, sm.dtype), gt, sm, -1)
    q, k, v = (_rand(4, 8, 512, 64, seed=i) for i in range(3))
    add("scaled_dot_product_attention", "b4_h8_512_causal", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v, is_causal=True)
    go = _rand(4, 8, 512, 64, seed=5)
    add("scaled_dot_product_attention_backward", "b4_h8_512_causal",
        _autograd(lambda p, r, s: F.scaled_dot_product_attention(p, r, s, is_causal=True), [q, k, v], go), go, q, k, v, is_causal=True)

    add_step("scaled_dot_product_attention", "train_step_b4_h8_512_causal",
             lambda p, r, s_: F.scaled_dot_product_attention(p, r, s_, is_causal=True),
             lambda p, r, s_: hal.ops.scaled_dot_product_attention(p, r, s_, is_causal=True), [q, k, v], go)
    rm4, rv4 = rm.clone(), rv.clone()
    add_step("fused_conv_bn_relu", "train_step_b8",
             lambda a, c: F.relu(F.batch_norm(F.conv2d(a, c, None, 1, 1), rm4, rv4, gam, bet, True)),
             lambda a, c: hal.ops.fused_conv_bn_relu(a, c, None, gam, bet, rm4, rv4, padding=1, training=True), [x, w], g)

    # optimizer steps: 64 tensors of 256K float32 (16M parameters)
    ps = [_rand(256 * 1024, seed=i) for i in range(64)]
    gs = [_rand(256 * 1024, seed=100 + i) * 1e-3 for i in range(64)]
    one = torch.ones(1)
    found = torch.zeros(1)
    add("amp_unscale_", "64x256K", lambda: torch._amp_foreach_non_finite_check_and_unscale_(gs, found, one), gs, 1.0)
    ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    peers = {}
    for mode, flags in (("foreach", {"foreach": True}), ("fused", {"fused": True})):
        params = [torch.nn.Parameter(p.clone()) for p in ps]
        for p, gr in zip(params, gs):
            p.grad = gr
        opt = torch.optim.AdamW(params, lr=1e-3, **flags)
        peers[f"AdamW({mode})"] = opt.step
    params = [torch.nn.Parameter(p.clone()) for p in ps]
    for p, gr in zip(params, gs):
        p.grad = gr
    default = torch.optim.AdamW(params, lr=1e-3)
    add("fused_adamw_", "64x256K*", default.step, ps, gs, ms, vs, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2, step=3.0, extra=peers)

    # quantisation
    add("quantize", "4096x1024", lambda: torch.quantize_per_tensor(t, 0.02, 3, torch.qint8).int_repr(), t, 0.02, 3)
    qt = torch.quantize_per_tensor(t, 0.02, 3, torch.qint8)
    qi = qt.int_repr()
    add("dequantize", "4096x1024", qt.dequantize, qi, 0.02, 3)
    add("fake_quantize", "4096x1024", lambda: torch.fake_quantize_per_tensor_affine(t, 0.02, 3, -128, 127), t, 0.02, 3)
    add("fake_quantize_backward", "4096x1024", _autograd(lambda p: torch.fake_quantize_per_tensor_affine(p, 0.02, 3, -128, 127), [t], gt), gt, t, 0.02, 3)
    xq, wq = torch.randint(-128, 128, (2048, 1024), dtype=torch.int8), torch.randint(-128, 128, (1024, 1024), dtype=torch.int8)
    ws = torch.rand(1024) * 1e-3
    add("int8_linear", "2048x1024x1024", lambda: (torch._int_mm(xq, wq.t()).float() * 0.01 * ws + bl), xq, wq, 0.01, ws, bl, "float32")
    return out


def best_of(fns: dict[str, Fn], budget_s: float = 1.0) -> dict[str, float]:
    """Best time in ms of each callable, runs interleaved; N chosen from a first timing."""
    for f in fns.values():
        f()  # warm-up (numba compiles, oneDNN builds its primitives, folds are cached)
    start = time.perf_counter()
    for f in fns.values():
        f()
    once = max(time.perf_counter() - start, 1e-6)
    n = int(min(30, max(5, budget_s / once)))
    best = {k: math.inf for k in fns}
    for _ in range(n):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            best[k] = min(best[k], time.perf_counter() - t0)
    return {k: v * 1e3 for k, v in best.items()}


def kernel_of(case: Case) -> str:
    """The backend/kernel hal ran (from hal.stats of one fresh call)."""
    before = hal.stats()
    case.hal()
    after = hal.stats()
    ran = [k for k, v in after.items() if v["calls"] > before.get(k, {"calls": 0})["calls"] and k[0] == case.op]
    return ",".join(f"{b}/{k}" for _, b, k in ran) or "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", help="comma-separated op names (default: all)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    wanted = set(args.ops.split(",")) if args.ops else None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"# {time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, commit {commit}, load {open('/proc/loadavg').read().split()[0]}")
    print(f"{'op':<38}{'case':<24}{'torch ms':>9}{'hal ms':>9}{'ratio':>7}{'numpy':>7}  target  kernel / extra peers")
    rows = []
    for case in cases():
        if wanted and case.op not in wanted:
            continue
        fns = {"torch": case.torch, "hal": case.hal, **({"numpy": case.numpy} if case.numpy else {}), **case.extra}
        ms = best_of(fns)
        ratio = ms["torch"] / ms["hal"]
        np_ratio = ms["numpy"] / ms["hal"] if "numpy" in ms else None
        met = ratio >= case.target and (np_ratio is None or np_ratio <= 1.2)
        extra = " ".join(f"{k} {ms[k]:.2f} ms ({ms[k] / ms['hal']:.2f}x)" for k in case.extra)
        kern = kernel_of(case)
        print(f"{case.op:<38}{case.name:<24}{ms['torch']:>9.2f}{ms['hal']:>9.2f}{ratio:>7.2f}{np_ratio or math.nan:>7.2f}  "
              f">={case.target:.1f} {'met' if met else 'MISSED'}  {kern} {extra}")
        rows.append({"op": case.op, "case": case.name, "ms": ms, "ratio": ratio, "numpy_ratio": np_ratio, "target": case.target, "met": met, "kernel": kern})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"commit": commit, "threads": torch.get_num_threads(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
