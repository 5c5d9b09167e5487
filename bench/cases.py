"""Benchmark cases: typical inputs per op, with their bytes and flops, extra peers and targets.

On a GPU the sizes are those of issue 5's performance table (tensors well beyond L2, ResNet-50
convolutions at batch 64, 8192-class GEMMs, 1B-parameter optimizer steps); on the CPU they are small
so that ``hal bench`` on cpu_ref finishes in seconds. Every op of the registry has a case.

A case builds its inputs only when it runs (``setup(device)``), returning the callables to time:
``hal`` (through ``hal.ops``, dispatch included), ``eager`` (``hal_torch``, or autograd's backward of
the eager forward for backward ops, which is what PyTorch users run), ``compiled`` (torch.compile of
the same eager function) and named ``peers`` (vendor calls such as cuDNN's fused convolution with
pre-folded weights, Liger-Kernel's kernels: ``hal_bench.liger``). ``targets`` are the issues' goals:
ratio >= value, for "eager", "compile", "peer:<name>", "best_peer" (the fastest named peer),
"bw" (fraction of copy bandwidth) and "rate" (fraction of the matrix rate). ``published`` are
figures of peers that cannot run here (``hal_bench.published``), shown beside the row, never judged.

Training rows ("train fwd+bwd") time a forward and a backward pass per run, every column through
autograd alike; they exist where a peer computes the gradient inside its forward pass (Liger's
losses), so that neither the forward nor the backward row alone compares like with like.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

import hal
from hal.gradients import MASK
from hal.registry import get_op
from hal_torch.table import eager, has_eager

from . import liger, published
from .peer import Fn, PeerLike
from .published import Published


@dataclasses.dataclass
class Setup:
    """What a case times, built on the device."""

    hal: Fn
    explain: tuple[str, tuple, dict]  # (op, args, kwargs) for hal.explain: the kernel that ran
    eager: Optional[Fn] = None
    compiled: Optional[Callable[[str], Fn]] = None  # mode -> callable (compiles on first call)
    peers: dict[str, PeerLike] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Case:
    op: str
    name: str
    dtype: str
    setup: Callable[[torch.device], Setup]
    bytes: float = 0.0
    flops: float = 0.0
    compile_mode: Optional[str] = None  # None: torch.compile's default mode; "off": no compile peer
    targets: dict[str, float] = dataclasses.field(default_factory=dict)
    published: tuple[Published, ...] = ()


# --- argument plumbing ---------------------------------------------------------------------------


def canonical(op: str, args: tuple, kwargs: dict) -> tuple:
    """The canonical positional arguments of a call (what kernels and hal_torch functions take)."""
    decl = get_op(op)
    bound = inspect.signature(decl.entry).bind(*args, **kwargs)
    bound.apply_defaults()
    values = [bound.arguments[n] for n in decl.param_names]
    for name, value in ((decl.check(*values) if decl.check else None) or {}).items():
        values[decl.index(name)] = value
    return tuple(values)


def _eager(op: str) -> Optional[Callable[..., Any]]:
    return eager(op) if has_eager(op) else None


def forward(op: str, args: tuple, kwargs: Optional[dict] = None, peers: Optional[dict[str, PeerLike]] = None,
            liger_peer: bool = False) -> Setup:
    """A forward op: hal.ops call, hal_torch function, torch.compile of it (and Liger-Kernel's
    function with ``liger_peer``)."""
    kwargs = kwargs or {}
    entry = getattr(hal.ops, op)
    canon = canonical(op, args, kwargs)
    fn = _eager(op)
    peers = dict(peers or {})
    if liger_peer:
        peers[liger.NAME] = liger.peer(op, "forward", canon)

    def compiled(mode: str) -> Fn:
        c = _compile(fn, mode)
        return lambda: c(*canon)

    return Setup(
        hal=lambda: entry(*args, **kwargs),
        explain=(op, args, kwargs),
        eager=(lambda: fn(*canon)) if fn else None,
        compiled=compiled if fn else None,
        peers=peers,
    )


def _compile(fn: Callable[..., Any], mode: str) -> Callable[..., Any]:
    return torch.compile(fn, mode=None if mode == "default" else mode, dynamic=False)


def _with_leaves(op: str, args: tuple, kwargs: Optional[dict], wrt: tuple[str, ...]) -> tuple[list, tuple[str, ...], Callable[..., Any], list]:
    """The canonical arguments of ``op`` with those named in ``wrt`` replaced by leaves that require
    grad, the parameter names, the eager function and the leaves."""
    canon = list(canonical(op, args, kwargs or {}))
    names = get_op(op).param_names
    fn = _eager(op)
    assert fn is not None
    leaves = []
    for name in wrt:
        i = names.index(name)
        canon[i] = canon[i].detach().requires_grad_(True)
        leaves.append(canon[i])
    return canon, names, fn, leaves


def backward(fwd_op: str, args: tuple, kwargs: Optional[dict], wrt: tuple[str, ...], liger_peer: bool = False) -> Setup:
    """A backward op: hal.ops.<fwd>_backward, against autograd's backward of the eager forward and
    of its torch.compile (graphs built once; each timed run is one backward pass), and with
    ``liger_peer`` autograd's backward of Liger-Kernel's function, timed the same way."""
    op = get_op(fwd_op).backward
    assert op is not None
    canon, names, fn, leaves = _with_leaves(fwd_op, args, kwargs, wrt)
    mutated = set(get_op(fwd_op).mutates)  # running statistics: each graph updates its own copy

    def run(f: Callable[..., Any]) -> tuple[torch.Tensor, Any]:
        call = [c.clone() if n in mutated and isinstance(c, torch.Tensor) else c for n, c in zip(names, canon)]
        with torch.enable_grad():
            return f(*call)

    out = run(fn)
    grad_out = torch.randn_like(out)
    named = dict(zip(names, (c.detach() if isinstance(c, torch.Tensor) else c for c in canon)))
    named["out"] = out.detach()  # backward ops that take the forward's result (softmax_backward)
    named[MASK] = tuple(n in wrt for n in get_op(fwd_op).gradients)  # the gradients the peers compute
    bwd_args = [grad_out] + [named[n] for n in get_op(op).param_names[1:]]
    entry = getattr(hal.ops, op)

    def timed_grad(result: torch.Tensor) -> Fn:
        return lambda: torch.autograd.grad(result, leaves, grad_out, retain_graph=True)

    def compiled(mode: str) -> Fn:
        return timed_grad(run(_compile(fn, mode)))

    peers: dict[str, PeerLike] = {}
    if liger_peer:
        peers[liger.NAME] = liger.peer(fwd_op, "backward", tuple(named[n] for n in names), wrt, grad_out)
    return Setup(hal=lambda: entry(*bwd_args), explain=(op, tuple(bwd_args), {}), eager=timed_grad(out), compiled=compiled, peers=peers)


def train(op: str, args: tuple, kwargs: Optional[dict], wrt: tuple[str, ...], liger_peer: bool = False) -> Setup:
    """A training step of a forward op: forward and backward in every run, each column through
    autograd alike (hal.ops on inputs that require grad, which is hal's autograd route; the eager
    function; its torch.compile; with ``liger_peer`` Liger-Kernel's function)."""
    canon, _, fn, leaves = _with_leaves(op, args, kwargs, wrt)
    plain = tuple(c.detach() if isinstance(c, torch.Tensor) else c for c in canon)

    def step(f: Callable[..., Any]) -> Fn:
        def go() -> Any:
            with torch.enable_grad():
                return torch.autograd.grad(f(*canon), leaves)

        return go

    def compiled(mode: str) -> Fn:
        return step(_compile(fn, mode))

    peers: dict[str, PeerLike] = {}
    if liger_peer:
        peers[liger.NAME] = liger.peer(op, "train", plain, wrt)
    return Setup(hal=step(getattr(hal.ops, op)), explain=(op, tuple(canon), {}), eager=step(fn), compiled=compiled, peers=peers)


def _randn(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
    return (torch.randn(shape, device=device, dtype=torch.float32) * std + mean).to(dtype)


DT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * torch.empty((), dtype=DT[dtype]).element_size()


# --- convolution and batch norm -------------------------------------------------------------------


def _conv_inputs(device, dtype, n, cin, cout, hw, k, channels_last=True):
    t = DT[dtype]
    x = _randn((n, cin, hw, hw), t, device)
    w = _randn((cout, cin, k, k), t, device, std=1 / math.sqrt(cin * k * k))
    if channels_last:
        x, w = x.contiguous(memory_format=torch.channels_last), w.contiguous(memory_format=torch.channels_last)
    bn = dict(
        bn_weight=torch.rand(cout, device=device) + 0.5, bn_bias=torch.randn(cout, device=device),
        running_mean=torch.randn(cout, device=device) * 0.1, running_var=torch.rand(cout, device=device) + 0.5,
    )
    return x, w, bn


def conv_bn_relu_eval(n: int, cin: int, cout: int, hw: int, k: int, dtype: str, compile_mode: str, targets: dict) -> Case:
    pad = k // 2

    def setup(device: torch.device) -> Setup:
        x, w, bn = _conv_inputs(device, dtype, n, cin, cout, hw, k)
        args = (x, w, None, bn["bn_weight"], bn["bn_bias"], bn["running_mean"], bn["running_var"])
        kwargs = dict(padding=pad, training=False)
        peers = {}
        if device.type == "cuda":
            a = torch.rsqrt(bn["running_var"] + 1e-5) * bn["bn_weight"]
            wf = (w.float() * a.view(-1, 1, 1, 1)).to(w.dtype).contiguous(memory_format=torch.channels_last)
            bf = (bn["bn_bias"] - bn["running_mean"] * a).to(w.dtype)
            peers["cudnn_fused_prefolded"] = lambda: torch.cudnn_convolution_relu(x, wf, bf, (1, 1), (pad, pad), (1, 1), 1)
        return forward("fused_conv_bn_relu", args, kwargs, peers)

    ho = hw  # stride 1, same padding
    flops = 2.0 * n * cout * ho * ho * cin * k * k
    byts = _nbytes((n, cin, hw, hw), dtype) + _nbytes((n, cout, ho, ho), dtype) + _nbytes((cout, cin, k, k), dtype)
    name = f"eval {cin}->{cout} {k}x{k} at {hw}x{hw}, batch {n}, channels_last"
    return Case("fused_conv_bn_relu", name, dtype, setup, byts, flops, compile_mode, targets)


def conv_bn_add_relu_eval(n: int, c: int, hw: int, dtype: str, targets: dict) -> Case:
    """A ResNet block's tail in eval, 1x1 conv c/4 -> c, batch norm, residual, ReLU; on a GPU against
    cuDNN's conv + residual + bias + ReLU on weights folded beforehand (the fold's cost is hal's)."""
    cin = max(1, c // 4)

    def setup(device: torch.device) -> Setup:
        x, w, bn = _conv_inputs(device, dtype, n, cin, c, hw, 1)
        residual = _randn((n, c, hw, hw), DT[dtype], device).contiguous(memory_format=torch.channels_last)
        args = (x, w, None, bn["bn_weight"], bn["bn_bias"], bn["running_mean"], bn["running_var"], residual)
        peers = {}
        if device.type == "cuda":
            a = torch.rsqrt(bn["running_var"] + 1e-5) * bn["bn_weight"]
            wf = (w.float() * a.view(-1, 1, 1, 1)).to(w.dtype).contiguous(memory_format=torch.channels_last)
            bf = (bn["bn_bias"] - bn["running_mean"] * a).to(w.dtype)
            peers["cudnn_fused_prefolded"] = lambda: torch.cudnn_convolution_add_relu(x, wf, residual, 1.0, bf, (1, 1), (0, 0), (1, 1), 1)
        return forward("fused_conv_bn_add_relu", args, dict(training=False), peers)

    flops = 2.0 * n * c * hw * hw * cin
    byts = _nbytes((n, cin, hw, hw), dtype) + 2 * _nbytes((n, c, hw, hw), dtype) + _nbytes((c, cin, 1, 1), dtype)
    return Case("fused_conv_bn_add_relu", f"eval {cin}->{c} 1x1 + residual at {hw}x{hw}, batch {n}, channels_last", dtype, setup, byts, flops,
                "off", targets)


def _add_relu_bwd(n: int, c: int, hw: int, dt: str) -> Callable[[torch.device], Setup]:
    def setup(device: torch.device) -> Setup:
        x, w, p = _conv_inputs(device, dt, n, c, c, hw, 3)
        residual = _randn((n, c, hw, hw), DT[dt], device).contiguous(memory_format=torch.channels_last)
        args = (x, w, None, p["bn_weight"], p["bn_bias"], p["running_mean"], p["running_var"], residual)
        return backward("fused_conv_bn_add_relu", args, dict(padding=1, training=True), ("x", "conv_weight", "bn_weight", "bn_bias", "residual"))

    return setup


def conv_bn_relu_train(n: int, c: int, hw: int, dtype: str, compile_mode: str, targets: dict) -> Case:
    """Forward + backward of a training step: hal's two ops against autograd through eager / compile."""

    def setup(device: torch.device) -> Setup:
        x, w, bn = _conv_inputs(device, dtype, n, c, c, hw, 3)
        args = (x, w, None, bn["bn_weight"], bn["bn_bias"], bn["running_mean"], bn["running_var"])
        kwargs = dict(padding=1, training=True)
        canon = canonical("fused_conv_bn_relu", args, kwargs)
        grad_out = torch.randn(n, c, hw, hw, device=device, dtype=x.dtype).contiguous(memory_format=torch.channels_last)
        bwd = (grad_out, x, w, None, bn["bn_weight"], bn["bn_bias"], bn["running_mean"], bn["running_var"], (1, 1), canon[8], (1, 1), 1, 1e-5, True)

        def hal_step() -> Any:
            hal.ops.fused_conv_bn_relu(*args, **kwargs)
            return hal.ops.fused_conv_bn_relu_backward(*bwd)

        fn = _eager("fused_conv_bn_relu")
        leaves = [t.detach().requires_grad_(True) for t in (x, w, bn["bn_weight"], bn["bn_bias"])]
        rest = list(canon)
        rest[0], rest[1], rest[3], rest[4] = leaves

        def step(f: Callable[..., Any]) -> Fn:
            def go() -> Any:
                with torch.enable_grad():
                    return torch.autograd.grad(f(*rest), leaves, grad_out)

            return go

        return Setup(hal=hal_step, explain=("fused_conv_bn_relu", args, kwargs), eager=step(fn),
                     compiled=lambda mode: step(torch.compile(fn, mode=mode, dynamic=False)))

    flops = 3 * 2.0 * n * c * hw * hw * c * 9  # forward, grad_x, grad_w
    return Case("fused_conv_bn_relu", f"train fwd+bwd {c}->{c} 3x3 at {hw}x{hw}, batch {n}, channels_last", dtype, setup,
                flops=flops, compile_mode=compile_mode, targets=targets)


def conv_cases(gpu: bool) -> list[Case]:
    n, c, hw, dt = (64, 64, 56, "bfloat16") if gpu else (2, 8, 12, "float32")

    def conv_setup(device: torch.device) -> Setup:
        x, w, _ = _conv_inputs(device, dt, n, c, c, hw, 3)
        return forward("conv2d", (x, w), dict(padding=1))

    def conv_bwd(device: torch.device) -> Setup:
        x, w, _ = _conv_inputs(device, dt, n, c, c, hw, 3)
        return backward("conv2d", (x, w), dict(padding=1), ("x", "weight"))

    def bn(train: bool, bwd: bool) -> Callable[[torch.device], Setup]:
        def setup(device: torch.device) -> Setup:
            x, _, p = _conv_inputs(device, dt, n, c, c, hw, 1)
            args = (x, p["running_mean"], p["running_var"], p["bn_weight"], p["bn_bias"], train)
            return backward("batch_norm", args, {}, ("x", "weight", "bias")) if bwd else forward("batch_norm", args)

        return setup

    act = _nbytes((n, c, hw, hw), dt)
    flops = 2.0 * n * c * hw * hw * c * 9
    bn_targets = {"eager": 1.0, "bw": 0.8} if gpu else {}  # issue 13
    cases = [
        Case("conv2d", f"{c}->{c} 3x3 at {hw}x{hw}, batch {n}, channels_last", dt, conv_setup, 2 * act, flops),
        Case("conv2d_backward", f"{c}->{c} 3x3 at {hw}x{hw}, batch {n}, channels_last", dt, conv_bwd, 4 * act, 2 * flops,
             targets={"eager": 1.0} if gpu else {}),
        Case("batch_norm", f"training, ({n}, {c}, {hw}, {hw}) channels_last", dt, bn(True, False), 2 * act, targets=bn_targets),
        Case("batch_norm_backward", f"training, ({n}, {c}, {hw}, {hw}) channels_last", dt, bn(True, True), 3 * act, targets=bn_targets),
    ]
    if not gpu:
        return cases + [
            conv_bn_relu_eval(n, c, c, hw, 3, dt, "off", {}),
            conv_bn_relu_train(n, c, hw, dt, "off", {}),
            Case("fused_conv_bn_relu_backward", "training", dt, _fused_bwd(n, c, hw, dt), 3 * act, 2 * flops),
            conv_bn_add_relu_eval(n, c, hw, dt, {}),
            Case("fused_conv_bn_add_relu_backward", "training", dt, _add_relu_bwd(n, c, hw, dt), 4 * act, 2 * flops),
        ]
    infer = {"eager": 2.0, "compile": 2.0, "peer:cudnn_fused_prefolded": 1.0}
    mode = "max-autotune-no-cudagraphs"
    for dtype in ("float16", "bfloat16"):
        cases.append(conv_bn_relu_eval(64, 64, 64, 56, 3, dtype, mode, infer))
        for cin, cout, size, k in ((128, 128, 28, 3), (256, 256, 14, 3), (512, 512, 7, 3), (256, 64, 56, 1), (64, 256, 56, 1)):
            cases.append(conv_bn_relu_eval(64, cin, cout, size, k, dtype, "off", {"eager": 2.0, "peer:cudnn_fused_prefolded": 1.0}))
    cases.append(conv_bn_relu_train(64, 64, 56, "bfloat16", mode, {"eager": 1.3, "compile": 1.0}))
    cases.append(Case("fused_conv_bn_relu_backward", f"training {c}->{c} 3x3 at {hw}x{hw}, batch {n}", dt, _fused_bwd(n, c, hw, dt), 3 * act, 2 * flops, "off"))
    for dtype in ("float16", "bfloat16"):  # the tails of ResNet-50's first and last stages
        for c_out, size in ((256, 56), (2048, 7)):
            cases.append(conv_bn_add_relu_eval(64, c_out, size, dtype, {"eager": 2.0, "peer:cudnn_fused_prefolded": 1.0}))
    cases.append(Case("fused_conv_bn_add_relu_backward", f"training {c}->{c} 3x3 at {hw}x{hw}, batch {n}", dt, _add_relu_bwd(n, c, hw, dt),
                      4 * act, 2 * flops, "off"))
    return cases


def _fused_bwd(n: int, c: int, hw: int, dt: str) -> Callable[[torch.device], Setup]:
    def setup(device: torch.device) -> Setup:
        x, w, p = _conv_inputs(device, dt, n, c, c, hw, 3)
        args = (x, w, None, p["bn_weight"], p["bn_bias"], p["running_mean"], p["running_var"])
        return backward("fused_conv_bn_relu", args, dict(padding=1, training=True), ("x", "conv_weight", "bn_weight", "bn_bias"))

    return setup


# --- elementwise, norms, softmax ----------------------------------------------------------------------


def rowwise_cases(gpu: bool) -> list[Case]:
    rows, cols, dt = (32768, 4096, "bfloat16") if gpu else (256, 512, "float32")
    t = DT[dt]
    big = _nbytes((rows, cols), dt)
    ew = {"bw": 0.9, "compile": 1.0} if gpu else {}
    # issue 5: layer_norm forward >= 85% of copy bandwidth and >= torch.compile; issue 13: the
    # backward passes >= 90% and >= torch.compile, rms_norm and softmax also >= the fastest peer
    # (Liger-Kernel; quack-kernels is published only) in both directions, at >= 90%
    norm_targets = {
        "layer_norm": {"bw": 0.85, "compile": 1.0},
        "layer_norm_backward": {"bw": 0.9, "compile": 1.0},
        "rms_norm": {"bw": 0.9, "compile": 1.0, "best_peer": 1.0},
        "rms_norm_backward": {"bw": 0.9, "compile": 1.0, "best_peer": 1.0},
        "softmax": {"bw": 0.9, "compile": 1.0, "best_peer": 1.0},
        "softmax_backward": {"bw": 0.9, "compile": 1.0, "best_peer": 1.0},
    }

    def x_of(device: torch.device) -> torch.Tensor:
        return _randn((rows, cols), t, device)

    def vec(device: torch.device) -> torch.Tensor:
        return _randn((cols,), t, device)

    def ssa(bwd: bool, bias: bool) -> Callable[[torch.device], Setup]:
        def setup(device: torch.device) -> Setup:
            args = (x_of(device), 1.0, vec(device), "gelu") if bias else (x_of(device), 0.5, 0.25, "relu")
            if bwd:
                return backward("scale_shift_act", args, {}, ("x", "shift") if bias else ("x",))
            return forward("scale_shift_act", args)

        return setup

    def norm(op: str, bwd: bool) -> Callable[[torch.device], Setup]:
        def setup(device: torch.device) -> Setup:
            if op == "layer_norm":
                args, wrt = (x_of(device), (cols,), vec(device), vec(device)), ("x", "weight", "bias")
            elif op == "rms_norm":
                args, wrt = (x_of(device), (cols,), vec(device)), ("x", "weight")
            else:
                args, wrt = (x_of(device), -1), ("x",)
            return backward(op, args, {}, wrt, liger_peer=True) if bwd else forward(op, args, liger_peer=True)

        return setup

    def norm_amax(device: torch.device) -> Setup:
        # rms_norm reducing its result's amax (the FP8 cast of y then needs no pass of its own); the
        # peer is the path it replaces, rms_norm then a one-pass max |y| (the inf-norm: no |y| temporary)
        x, w = x_of(device), vec(device)
        peers = {"rms_norm_then_amax": lambda: _then_amax(hal.ops.rms_norm(x, (cols,), w))}
        return forward("rms_norm_amax", (x, (cols,), w), peers=peers)

    shape = f"({rows}, {cols})"
    out = [
        Case("rms_norm_amax", f"{shape}, amax of y in the pass", dt, norm_amax, 2 * big,
             targets={"bw": 0.85, "peer:rms_norm_then_amax": 1.0} if gpu else {}),
        Case("scale_shift_act", f"bias + gelu, {shape} ({big >> 20} MiB)", dt, ssa(False, True), 2 * big, targets=ew),
        Case("scale_shift_act", f"scalar affine + relu, {shape}", dt, ssa(False, False), 2 * big, targets=ew),
        Case("scale_shift_act_backward", f"bias + gelu, {shape}", dt, ssa(True, True), 3 * big, targets={"bw": 0.85} if gpu else {}),
    ]
    for op in ("layer_norm", "rms_norm", "softmax"):
        for name, bwd, byts in ((op, False, 2 * big), (f"{op}_backward", True, 3 * big)):
            out.append(Case(name, shape, dt, norm(op, bwd), byts, targets=norm_targets[name] if gpu else {},
                            published=published.quack(name) if gpu else ()))
    return out


def _then_amax(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``y`` and ``max |y|`` in float32 by one more pass over y (the peer of the ops that reduce it
    as they write y)."""
    return y, torch.linalg.vector_norm(y, math.inf).float()


# --- GEMMs ---------------------------------------------------------------------------------------


def gemm_cases(gpu: bool) -> list[Case]:
    dt = "bfloat16" if gpu else "float32"
    t = DT[dt]
    shapes = ((8192, 4096, 4096), (16384, 1024, 4096)) if gpu else ((128, 64, 96),)
    cases = []
    for i, (m, k, n) in enumerate(shapes):

        def lin(device: torch.device, m=m, k=k, n=n, act="gelu_tanh") -> Setup:
            x, w, b = _randn((m, k), t, device), _randn((n, k), t, device, std=1 / math.sqrt(k)), _randn((n,), t, device)
            peers = {}
            if device.type == "cuda":
                peers = {
                    "addmm_activation_gelu": lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True),
                    "linear_alone": lambda: F.linear(x, w, b),
                }
            return forward("linear", (x, w, b, act), peers=peers)

        targets = {"peer:addmm_activation_gelu": 1.0}
        if i == 0:
            targets["peer:linear_alone"] = 0.95  # the epilogue costs at most 5% over the GEMM alone
        flops = 2.0 * m * k * n
        cases.append(Case("linear", f"bias + gelu_tanh, (M, K, N) = ({m}, {k}, {n})", dt, lin, flops=flops, targets=targets if gpu else {}))
        if i == 0:
            cases.append(Case("linear", f"bias + gelu (erf), ({m}, {k}, {n})", dt, lambda d, f=lin: f(d, act="gelu"), flops=flops))

            def lin_bwd(device: torch.device, m=m, k=k, n=n) -> Setup:
                x, w, b = _randn((m, k), t, device), _randn((n, k), t, device, std=1 / math.sqrt(k)), _randn((n,), t, device)
                return backward("linear", (x, w, b, "gelu_tanh"), {}, ("x", "weight", "bias"))

            cases.append(Case("linear_backward", f"bias + gelu_tanh, ({m}, {k}, {n})", dt, lin_bwd, flops=2 * flops))
    s = 8192 if gpu else 128

    def mm(bwd: bool) -> Callable[[torch.device], Setup]:
        def setup(device: torch.device) -> Setup:
            a, b = _randn((s, s), t, device), _randn((s, s), t, device)
            return backward("matmul", (a, b), {}, ("a", "b")) if bwd else forward("matmul", (a, b))

        return setup

    cases.append(Case("matmul", f"{s}^3", dt, mm(False), flops=2.0 * s**3, targets={"rate": 0.9} if gpu else {}))
    cases.append(Case("matmul_backward", f"{s}^3", dt, mm(True), flops=4.0 * s**3))
    cases += grouped_cases(gpu)
    return cases


def skewed_sizes(groups: int, total: int, gen: torch.Generator) -> list[int]:
    """Ragged expert loads: lognormal weights (a few hot experts, some nearly idle) summing to total."""
    w = torch.exp(torch.randn(groups, generator=gen, dtype=torch.float64) * 1.0)
    sizes = (w / w.sum() * total).floor().long()
    sizes[torch.argmax(w)] += total - int(sizes.sum())
    return sizes.tolist()


def grouped_cases(gpu: bool) -> list[Case]:
    g, m, k, n, dt = (128, 16384, 4096, 1408, "bfloat16") if gpu else (8, 256, 64, 48, "float32")
    t = DT[dt]

    def inputs(device: torch.device):
        sizes = skewed_sizes(g, m, torch.Generator().manual_seed(5))
        x, w = _randn((m, k), t, device), _randn((g, k, n), t, device, std=1 / math.sqrt(k))
        return x, w, sizes, torch.tensor(sizes, dtype=torch.int32, device=device)

    def fwd(device: torch.device) -> Setup:
        x, w, sizes, gs = inputs(device)
        peers: dict[str, Fn] = {}
        bounds = [0]
        for s in sizes:
            bounds.append(bounds[-1] + s)
        peers["loop_of_matmuls"] = lambda: torch.cat([x[bounds[i] : bounds[i + 1]] @ w[i] for i in range(g)])
        if device.type == "cuda" and hasattr(torch, "_grouped_mm"):
            offs = torch.cumsum(gs, 0, dtype=torch.int32)
            peers["torch_grouped_mm"] = lambda: torch._grouped_mm(x, w, offs=offs)
        return forward("grouped_gemm", (x, w, gs), peers=peers)

    def bwd(device: torch.device) -> Setup:
        x, w, _, gs = inputs(device)
        return backward("grouped_gemm", (x, w, gs), {}, ("x", "weight"))

    flops = 2.0 * m * k * n
    byts = _nbytes((m, k), dt) + _nbytes((g, k, n), dt) + _nbytes((m, n), dt)
    targets = {"peer:torch_grouped_mm": 1.0, "rate": 0.55} if gpu else {}  # issue 5, rate raised by issue 13
    name = f"{g} skewed experts, {m} tokens, K={k}, N={n}"
    return [Case("grouped_gemm", name, dt, fwd, byts, flops, targets=targets), Case("grouped_gemm_backward", name, dt, bwd, 2 * byts, 2 * flops)]


# --- attention ------------------------------------------------------------------------------------


def attention_cases(gpu: bool) -> list[Case]:
    b, h, s, e, dt = (4, 16, 4096, 128, "bfloat16") if gpu else (2, 2, 64, 16, "float32")
    t = DT[dt]

    def qkv(device: torch.device):
        return tuple(_randn((b, h, s, e), t, device) for _ in range(3))

    def fwd(device: torch.device) -> Setup:
        q, k, v = qkv(device)
        peers = {}
        if device.type == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            def peer(backend: Any) -> Fn:
                def go() -> Any:
                    with sdpa_kernel([backend]):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

                return go

            for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
                peers[f"sdpa_{name}"] = peer(backend)
        return forward("scaled_dot_product_attention", (q, k, v), dict(is_causal=True), peers)

    def bwd(device: torch.device) -> Setup:
        q, k, v = qkv(device)
        return backward("scaled_dot_product_attention", (q, k, v), dict(is_causal=True), ("q", "k", "v"))

    flops = 2 * 2.0 * b * h * s * s * e / 2  # two GEMMs, half the scores under the causal mask
    targets = {"best_peer": 0.95} if gpu else {}
    name = f"causal, (B, H, L, E) = ({b}, {h}, {s}, {e})"
    return [Case("scaled_dot_product_attention", name, dt, fwd, flops=flops, targets=targets),
            Case("scaled_dot_product_attention_backward", name, dt, bwd, flops=2.5 * flops)]


# --- transformer pieces and losses ---------------------------------------------------------------


def transformer_cases(gpu: bool) -> list[Case]:
    """Rotary embeddings of a Llama query, (B, H, T, D) with one (T, D/2) float32 table, and the
    SwiGLU gate of its MLP (Llama-7B's head and MLP widths, Liger-Kernel's benchmark models).
    Targets (issues 5 and 13): >= 90% of copy bandwidth and >= the fastest peer (Liger-Kernel)."""
    b, h, s, d, rows, inter, dt = (8, 32, 2048, 128, 16384, 8192, "bfloat16") if gpu else (2, 4, 64, 32, 256, 512, "float32")
    t = DT[dt]
    bw = {"bw": 0.9, "best_peer": 1.0} if gpu else {}

    def tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        theta = torch.arange(s, device=device, dtype=torch.float32)[:, None] * 10000.0 ** (-torch.arange(d // 2, device=device) / (d // 2))
        return theta.cos(), theta.sin()

    def rotary(bwd: bool) -> Callable[[torch.device], Setup]:
        def setup(device: torch.device) -> Setup:
            cos, sin = tables(device)
            args = (_randn((b, h, s, d), t, device), cos, sin)
            if bwd:
                return backward("rotary_embedding", args, {}, ("x",), liger_peer=True)
            return forward("rotary_embedding", args, liger_peer=True)

        return setup

    def swiglu(bwd: bool) -> Callable[[torch.device], Setup]:
        def setup(device: torch.device) -> Setup:
            args = (_randn((rows, inter), t, device), _randn((rows, inter), t, device))
            return backward("swiglu", args, {}, ("gate", "up"), liger_peer=True) if bwd else forward("swiglu", args, liger_peer=True)

        return setup

    def swiglu_amax(device: torch.device) -> Setup:
        # the SwiGLU reducing its result's amax (the down projection's FP8 cast needs no pass for it);
        # the peer is swiglu then a one-pass max |y|
        gate, up = _randn((rows, inter), t, device), _randn((rows, inter), t, device)
        return forward("swiglu_amax", (gate, up), peers={"swiglu_then_amax": lambda: _then_amax(hal.ops.swiglu(gate, up))})

    x = _nbytes((b, h, s, d), dt)
    gu = _nbytes((rows, inter), dt)
    name = f"(B, H, T, D) = ({b}, {h}, {s}, {d}), float32 tables"
    return [
        Case("swiglu_amax", f"({rows}, {inter}), amax of y in the pass", dt, swiglu_amax, 3 * gu,
             targets={"bw": 0.9, "peer:swiglu_then_amax": 1.0} if gpu else {}),
        Case("rotary_embedding", name, dt, rotary(False), 2 * x, targets=bw),
        Case("rotary_embedding_backward", name, dt, rotary(True), 2 * x, targets=bw),
        Case("swiglu", f"({rows}, {inter})", dt, swiglu(False), 3 * gu, targets=bw),
        Case("swiglu_backward", f"({rows}, {inter})", dt, swiglu(True), 5 * gu, targets=bw),
    ]


def loss_cases(gpu: bool) -> list[Case]:
    """Cross-entropy over a 32000-class vocabulary, and a Llama LM head with its loss, each forward,
    backward and as a training step (Liger-Kernel computes these gradients in its forward pass).
    Bytes and flops are the fewest: the logits read once (and their gradient written once), the
    three GEMMs of forward, grad_x and grad_weight. Targets (issue 13, cross-entropy): >= 90% of
    copy bandwidth forward and backward, >= the fastest peer forward and per training step. The
    training rows leave torch.compile out (no target there; it saves two compilations a run)."""
    n, v, k, dt = (8192, 32000, 4096, "bfloat16") if gpu else (64, 500, 32, "float32")
    t = DT[dt]

    def targets_of(device: torch.device) -> torch.Tensor:
        tg = torch.randint(0, v, (n,), device=device)
        tg[::17] = -100
        return tg

    def ce(mode: str) -> Callable[[torch.device], Setup]:
        def setup(device: torch.device) -> Setup:
            args = (_randn((n, v), t, device, std=2.0), targets_of(device))
            return _three_ways("cross_entropy", args, ("logits",), mode)

        return setup

    def lce(mode: str) -> Callable[[torch.device], Setup]:
        def setup(device: torch.device) -> Setup:
            args = (_randn((n, k), t, device), _randn((v, k), t, device, std=k**-0.5), targets_of(device))
            return _three_ways("linear_cross_entropy", args, ("x", "weight"), mode)

        return setup

    logits = _nbytes((n, v), dt)
    flops = 2.0 * n * k * v
    ce_name, lce_name = f"({n}, {v}), mean", f"(N, K, V) = ({n}, {k}, {v}), mean"
    gpu_only = (lambda targets: targets if gpu else {})  # noqa: E731
    quack = (lambda op: published.quack(op) if gpu else ())  # noqa: E731
    return [
        Case("cross_entropy", ce_name, dt, ce("forward"), logits, targets=gpu_only({"bw": 0.9, "best_peer": 1.0}), published=quack("cross_entropy")),
        Case("cross_entropy_backward", ce_name, dt, ce("backward"), 2 * logits, targets=gpu_only({"bw": 0.9}), published=quack("cross_entropy_backward")),
        Case("cross_entropy", f"train fwd+bwd {ce_name}", dt, ce("train"), 2 * logits, compile_mode="off", targets=gpu_only({"best_peer": 1.0})),
        Case("linear_cross_entropy", lce_name, dt, lce("forward"), flops=flops),
        Case("linear_cross_entropy_backward", lce_name, dt, lce("backward"), flops=3 * flops),
        Case("linear_cross_entropy", f"train fwd+bwd {lce_name}", dt, lce("train"), flops=3 * flops, compile_mode="off"),
    ]


def _three_ways(op: str, args: tuple, wrt: tuple[str, ...], mode: str) -> Setup:
    """The forward op, its backward op, or a training step of it, each with Liger-Kernel's peer."""
    if mode == "train":
        return train(op, args, {}, wrt, liger_peer=True)
    if mode == "backward":
        return backward(op, args, {}, wrt, liger_peer=True)
    return forward(op, args, liger_peer=True)


# --- mixed precision ------------------------------------------------------------------------------


def optimizer_cases(gpu: bool) -> list[Case]:
    tensors, per = (64, 1 << 24) if gpu else (8, 1 << 12)  # 1.07B parameters on a GPU
    params_total = tensors * per

    def adam(device: torch.device) -> Setup:
        p = [torch.randn(per, device=device).to(torch.bfloat16) for _ in range(tensors)]
        g = [torch.randn(per, device=device).to(torch.bfloat16) for _ in range(tensors)]
        m = [torch.randn(per, device=device) * 1e-3 for _ in range(tensors)]
        v = [torch.rand(per, device=device) * 1e-6 for _ in range(tensors)]
        w = [t.float() for t in p]
        inv, found = torch.tensor([2.0**-16], device=device), torch.zeros(1, device=device)
        kwargs = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=10.0, master_params=w, inv_scale=inv, found_inf=found)
        setup = forward("fused_adamw_", (p, g, m, v), kwargs)
        if device.type == "cuda":
            setup.peers["torch_adamw_fused_gradscaler"] = _torch_adamw_peer(p, g, device)
            setup.peers["hal_cpp"] = _forced("cpp", lambda: hal.ops.fused_adamw_(p, g, m, v, **kwargs))
        return setup

    def unscale(device: torch.device) -> Setup:
        ts = [torch.randn(per, device=device).to(torch.float16) for _ in range(tensors)]
        return forward("amp_unscale_", (ts, 1.0 - 2.0**-10))

    return [
        Case("fused_adamw_", f"{params_total / 1e6:,.0f}M params in {tensors} tensors, bf16 + fp32 masters, unscale", "bfloat16", adam,
             bytes=28.0 * params_total, targets={"bw": 0.9, "peer:torch_adamw_fused_gradscaler": 1.0} if gpu else {}, compile_mode="off"),
        Case("amp_unscale_", f"{params_total / 1e6:,.0f}M fp16 values in {tensors} tensors", "float16", unscale, bytes=4.0 * params_total, compile_mode="off"),
    ]


def _forced(kernel: str, call: Fn) -> Fn:
    """hal's own ``kernel`` forced (``hal.use(kernel=)``): one the eager ranking puts second, shown
    beside the chosen one (the C++ AdamW, which ranks first in graph replays only)."""

    def run() -> Any:
        with hal.use(kernel=kernel):
            return call()

    return run


def _torch_adamw_peer(params: list[torch.Tensor], grads: list[torch.Tensor], device: torch.device) -> Fn:
    """torch.optim.AdamW(fused=True) on fp32 masters with fp32 grads, stepped by a GradScaler (which
    checks the grads for inf/NaN and hands the scale to the fused kernel), then the masters copied
    into the bf16 model parameters: the same step as hal's fused_adamw_ with master weights."""
    masters = [torch.nn.Parameter(p.float()) for p in params]
    for mp, g in zip(masters, grads):
        mp.grad = g.float()
    opt = torch.optim.AdamW(masters, lr=1e-4, weight_decay=0.01, fused=True)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16)
    scaler.scale(torch.ones((), device=device))  # initialises the scale tensor

    def step() -> None:
        scaler.step(opt)
        scaler.update()
        with torch.no_grad():  # a copy from the masters (leaves) would make the parameters require grad
            torch._foreach_copy_(params, masters)

    return step


# --- quantisation ---------------------------------------------------------------------------------


def quant_cases(gpu: bool) -> list[Case]:
    r, c, dt = (8192, 8192, "bfloat16") if gpu else (128, 256, "float32")
    t = DT[dt]
    n = r * c

    def q_args(device: torch.device):
        x = _randn((r, c), t, device, std=3.0)
        scale = torch.rand(r, device=device) * 0.05 + 0.01
        zp = torch.randint(-8, 8, (r,), device=device, dtype=torch.int32)
        return x, scale, zp

    def quantize(device: torch.device) -> Setup:
        x, s, z = q_args(device)
        return forward("quantize", (x, s, z, 0))

    def dequantize(device: torch.device) -> Setup:
        x, s, z = q_args(device)
        return forward("dequantize", (hal.ops.quantize(x, s, z, 0), s, z, 0))

    def fake(bwd: bool) -> Callable[[torch.device], Setup]:
        def setup(device: torch.device) -> Setup:
            x, s, z = q_args(device)
            args = (x, s, z, -128, 127, 0)
            return backward("fake_quantize", args, {}, ("x",)) if bwd else forward("fake_quantize", args)

        return setup

    size = _nbytes((r, c), dt)
    per = f"({r}, {c}) per-channel"
    return [
        Case("quantize", per, dt, quantize, size + n),
        Case("dequantize", per, "int8", dequantize, n + 4 * n),
        Case("fake_quantize", per, dt, fake(False), 2 * size),
        Case("fake_quantize_backward", per, dt, fake(True), 3 * size),
        int8_case(gpu),
    ]


def int8_case(gpu: bool) -> Case:
    m = k = n = 8192 if gpu else 64

    def setup(device: torch.device) -> Setup:
        xq = torch.randint(-128, 128, (m, k), dtype=torch.int8, device=device)
        wq = torch.randint(-128, 128, (n, k), dtype=torch.int8, device=device)
        xs, ws = torch.tensor([0.02], device=device), torch.rand(n, device=device) * 1e-3
        bias = torch.randn(n, device=device, dtype=torch.float16)
        peers = {}
        if device.type == "cuda":
            xb, wb = xq.to(torch.bfloat16), wq.to(torch.bfloat16)
            peers["bf16_linear"] = lambda: F.linear(xb, wb)
            w_rowmajor = wq.t().contiguous()  # (K, N) row-major: the layout cuBLASLt int8 runs slowly
            peers["int_mm_row_major_b"] = lambda: torch._int_mm(xq, w_rowmajor)
        return forward("int8_linear", (xq, wq, xs, ws, bias, "float16"), peers=peers)

    return Case("int8_linear", f"{m}^3, per-channel scales + bias, fp16 out", "int8", setup, flops=2.0 * m * n * k,
                targets={"peer:bf16_linear": 1.6} if gpu else {}, compile_mode="off")


def fp8_cases(gpu: bool) -> list[Case]:
    """FP8 quantisation (row-wise, amax fused in), dequantisation and the scaled GEMM (per-tensor
    scales, bf16 out), against torch._scaled_mm and the bfloat16 GEMM on CUDA (issue 31's targets)."""
    r, c = (8192, 8192) if gpu else (128, 256)
    m = k = n = 8192 if gpu else 64
    dt = "bfloat16" if gpu else "float32"

    def quantize(device: torch.device) -> Setup:
        return forward("fp8_quantize", (_randn((r, c), DT[dt], device, std=3.0), "e4m3fn", "row"))

    def quantize_transpose(device: torch.device) -> Setup:
        return forward("fp8_quantize_transpose", (_randn((r, c), DT[dt], device, std=3.0), "e4m3fn", "tensor"))

    def quantize_amax(transpose: bool) -> Callable[[torch.device], Setup]:
        # delayed scaling's cast: a given per-tensor scale, the amax reduced in the same pass; the
        # peer is the path it replaces, the cast with that scale then a separate torch.amax
        op, plain = ("fp8_quantize_transpose_amax", hal.ops.fp8_quantize_transpose) if transpose else ("fp8_quantize_amax", hal.ops.fp8_quantize)

        def setup(device: torch.device) -> Setup:
            x = _randn((r, c), DT[dt], device, std=3.0)
            scale = torch.tensor(3.0 * 4 / 448, dtype=torch.float32, device=device)
            peers = {"cast_then_amax": lambda: (plain(x, "e4m3fn", "tensor", scale), torch.amax(x.abs()))}
            return forward(op, (x, scale, "e4m3fn"), peers=peers)

        return setup

    def quantize_from_amax(transpose: bool) -> Callable[[torch.device], Setup]:
        # current scaling with the amax given (reduced by x's producer: rms_norm_amax, swiglu_amax):
        # one pass over x; the peer is the cast that reduces the amax itself (two passes)
        op, plain = ("fp8_quantize_transpose_from_amax", hal.ops.fp8_quantize_transpose) if transpose else ("fp8_quantize_from_amax", hal.ops.fp8_quantize)

        def setup(device: torch.device) -> Setup:
            x = _randn((r, c), DT[dt], device, std=3.0)
            amax = x.float().abs().amax()
            return forward(op, (x, amax, "e4m3fn"), peers={"cast_reducing_amax": lambda: plain(x, "e4m3fn", "tensor")})

        return setup

    def dequantize(device: torch.device) -> Setup:
        q, s = hal.ops.fp8_quantize(_randn((r, c), DT[dt], device, std=3.0), "e4m3fn", "row")
        return forward("fp8_dequantize", (q, s, "e4m3fn", 128, dt))

    def scaled_mm(device: torch.device) -> Setup:
        a, sa = hal.ops.fp8_quantize(_randn((m, k), DT[dt], device), "e4m3fn")
        b, sb = hal.ops.fp8_quantize(_randn((n, k), DT[dt], device), "e4m3fn")
        peers = {}
        if device.type == "cuda" and not torch.version.hip:
            a8, b8 = a.view(torch.float8_e4m3fn), b.view(torch.float8_e4m3fn)
            xb, wb = torch.randn(m, k, device=device, dtype=torch.bfloat16), torch.randn(n, k, device=device, dtype=torch.bfloat16)
            peers["bf16_linear"] = lambda: F.linear(xb, wb)
            peers["torch_scaled_mm"] = lambda: torch._scaled_mm(a8, b8.t(), sa, sb, out_dtype=torch.bfloat16)
        return forward("fp8_scaled_mm", (a, b, sa, sb, None, "e4m3fn", "e4m3fn", "bfloat16"), peers=peers)

    n_el = r * c
    return [
        Case("fp8_quantize", f"({r}, {c}) e4m3fn row-wise", dt, quantize, _nbytes((r, c), dt) + n_el + 4 * r),
        Case("fp8_quantize_transpose", f"({r}, {c}) e4m3fn per tensor, both layouts", dt, quantize_transpose, _nbytes((r, c), dt) + 2 * n_el + 8),
        Case("fp8_quantize_amax", f"({r}, {c}) e4m3fn, given scale, amax in the pass", dt, quantize_amax(False), _nbytes((r, c), dt) + n_el + 8),
        Case("fp8_quantize_transpose_amax", f"({r}, {c}) e4m3fn, given scale, both layouts, amax in the pass", dt, quantize_amax(True),
             _nbytes((r, c), dt) + 2 * n_el + 8),
        Case("fp8_quantize_from_amax", f"({r}, {c}) e4m3fn, amax given", dt, quantize_from_amax(False), _nbytes((r, c), dt) + n_el + 8,
             targets={"peer:cast_reducing_amax": 1.2} if gpu else {}),
        Case("fp8_quantize_transpose_from_amax", f"({r}, {c}) e4m3fn, amax given, both layouts", dt, quantize_from_amax(True),
             _nbytes((r, c), dt) + 2 * n_el + 8, targets={"peer:cast_reducing_amax": 1.2} if gpu else {}),
        Case("fp8_dequantize", f"({r}, {c}) e4m3fn row-wise", "uint8", dequantize, n_el + _nbytes((r, c), dt) + 4 * r),
        Case("fp8_scaled_mm", f"{m}^3 e4m3fn, per-tensor scales, bf16 out", "uint8", scaled_mm, flops=2.0 * m * n * k,
             targets={"peer:bf16_linear": 1.7, "peer:torch_scaled_mm": 0.9} if gpu else {}, compile_mode="off"),
    ]


def all_cases(gpu: bool) -> list[Case]:
    """Every benchmark case, GPU-sized or CPU-sized; the rows compared with Liger-Kernel come early
    (a run cut short by its time limit keeps them)."""
    return (conv_cases(gpu) + rowwise_cases(gpu) + transformer_cases(gpu) + loss_cases(gpu) + gemm_cases(gpu) + attention_cases(gpu)
            + optimizer_cases(gpu) + quant_cases(gpu) + fp8_cases(gpu))
