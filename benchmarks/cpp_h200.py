"""The kits/cpp kernels on an NVIDIA GPU (made for the H200 device call): check, then time against
cuDNN / torch eager and the Triton kernels, in one run.

    python3 benchmarks/cpp_h200.py OUT_DIR

1. Ceilings: copy bandwidth (bytes read + written) measured now.
2. Checks: every C++ kernel (batch norm forward / backward in both layouts, with and without the
   fused ReLU and convolution bias, eval mode, the scalar paths; layer_norm / rms_norm backward;
   AdamW with masters, unscale, skip)
   on fresh random data against torch in float64, outputs poisoned first; relative error
   ||got - ref|| / ||ref|| per output, and whether every element was written.
3. Timings (median of CUDA-event batches, hal_bench.timing.Timer): back-to-back calls ("b2b", what a
   model sees, host overhead included where it exceeds the device time) and CUDA-graph replays
   ("graph", device time only), with the bytes each op must move, TB/s and % of the copy bandwidth;
   a sweep of the C++ launch sizes; host time per call on tiny inputs.

Writes OUT_DIR/cpp_h200.json and OUT_DIR/cpp_h200.txt; prints the table last. About two minutes
on an H200 (NVRTC compiles ~10 modules once, Triton its batch-norm and AdamW kernels).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from hal.conformance.poison import Poisoner
from hal_bench.ceilings import measure
from hal_bench.timing import Timer, host_overhead_us
from hal_cpp import batchnorm as cbn
from hal_cpp import norm as cnorm
from hal_cpp import optim as copt
from hal_backend_cuda.launch import TABLES as launch  # the launch sizes the plugin uses
from hal_backend_cuda.cpp_kernels import KIT

DEV = torch.device("cuda")
SHAPE = (64, 64, 56, 56)
CHECKS: list[dict[str, Any]] = []
TIMES: list[dict[str, Any]] = []
LOG: list[str] = []


def say(line: str) -> None:
    print(line, flush=True)
    LOG.append(line)


# --- checks -------------------------------------------------------------------------------------------

POISON = Poisoner(DEV)
#: relative error allowed per dtype (outputs rounded to the dtype; float32 / float64 accumulation)
REL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 2e-5, torch.float64: 1e-11}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    g, w = got.detach().double(), want.detach().double()
    return float((g - w).norm() / w.norm().clamp_min(1e-300))


def record_check(name: str, dtype: torch.dtype, outputs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    errs = {k: rel_err(g, w) for k, (g, w) in outputs.items()}
    finite = all(bool(torch.isfinite(g).all()) for g, _ in outputs.values())
    ok = finite and all(e <= REL[dtype] for e in errs.values())
    CHECKS.append({"check": name, "dtype": str(dtype)[6:], "ok": ok, "finite": finite, "rel_err": errs})
    say(f"{'ok  ' if ok else 'FAIL'} {name:<58} " + " ".join(f"{k}={v:.2e}" for k, v in errs.items()) + ("" if finite else "  (non-finite)"))


def randn(*shape: int, dtype=torch.float32, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    return (torch.randn(shape, device=DEV, dtype=torch.float64) * scale + shift).to(dtype)


def check_bn(shape, dtype, channels_last: bool, training: bool, relu: bool, conv_bias: bool) -> None:
    c = shape[1]
    fmt = torch.channels_last if channels_last and len(shape) == 4 else torch.contiguous_format
    x = randn(*shape, dtype=dtype, scale=2.0, shift=3.0).contiguous(memory_format=fmt)
    pdt = torch.float64 if dtype == torch.float64 else torch.float32
    w, b, cb = randn(c, dtype=pdt), randn(c, dtype=pdt), (randn(c, dtype=pdt) if conv_bias else None)
    rm, rv = randn(c, dtype=pdt), torch.rand(c, device=DEV, dtype=pdt) + 0.5
    rm64, rv64 = rm.double().clone(), rv.double().clone()  # clones: float64 stats are updated in place
    view = (1, c) + (1,) * (len(shape) - 2)
    xd, wd, bd = (t.double().clone().requires_grad_() for t in (x, w, b))
    ref = F.batch_norm(xd + (cb.double().view(view) if cb is not None else 0.0), rm64, rv64, wd, bd, training, 0.1, 1e-5)
    ref = F.relu(ref) if relu else ref
    out_bytes = x.numel() * x.element_size()
    with POISON.around([(out_bytes, str(dtype)[6:])]):
        y = cbn.batch_norm_forward(KIT, x, w, b, rm, rv, training, 0.1, 1e-5, relu, conv_bias=cb)
    torch.cuda.synchronize()
    name = f"bn {'train' if training else 'eval'}{'+relu' if relu else ''}{'+cbias' if cb is not None else ''} {tuple(shape)} {'NHWC' if fmt == torch.channels_last else 'NCHW'}"
    record_check(name + " fwd", dtype, {"y": (y, ref), "running_mean": (rm, rm64), "running_var": (rv, rv64)})
    g = randn(*shape, dtype=dtype).contiguous(memory_format=fmt)
    ref.backward(g.double())
    with POISON.around([(out_bytes, str(dtype)[6:])]):
        dx, gw, gb = cbn.batch_norm_backward(KIT, g, x, w, b, rm64.to(pdt), rv64.to(pdt), training, 1e-5, relu, (pdt, pdt), conv_bias=cb)
    torch.cuda.synchronize()
    record_check(name + " bwd", dtype, {"dx": (dx, xd.grad), "dw": (gw, wd.grad), "db": (gb, bd.grad)})


def check_norm(shape, dtype, with_weight: bool) -> None:
    n = shape[-1]
    x = randn(*shape, dtype=dtype, scale=2.0, shift=1.0)
    g = randn(*shape, dtype=dtype)
    w = randn(n, dtype=dtype) if with_weight else None
    for rms in (False, True):
        xd = x.double().clone().requires_grad_()
        wd = (w.double().clone() if w is not None else torch.ones(n, device=DEV, dtype=torch.float64)).requires_grad_()
        bd = torch.zeros(n, device=DEV, dtype=torch.float64, requires_grad=True)
        ref = F.rms_norm(xd, (n,), wd, 1e-6) if rms else F.layer_norm(xd, (n,), wd, bd, 1e-5)
        ref.backward(g.double())
        with POISON.around([(x.numel() * x.element_size(), str(dtype)[6:])]):
            dx, gw, gb = cnorm.norm_backward(KIT, g, x, n, w, 1e-6 if rms else 1e-5, rms)
        torch.cuda.synchronize()
        outs = {"dx": (dx, xd.grad), "dw": (gw, wd.grad)}
        if not rms:
            outs["db"] = (gb, bd.grad)
        record_check(f"{'rms' if rms else 'layer'}_norm bwd {tuple(shape)}{'' if with_weight else ' no weight'}", dtype, outs)


def check_adamw(pdtype, sdtype, masters: bool, inv: Any, aligned: bool) -> None:
    sizes = [4096 * 1024 + 3, 4096, 77, 1, copt.CHUNK * 3 + 5]
    off = 0 if aligned else 1
    p = [randn(n + off, dtype=pdtype)[off:] for n in sizes]
    g = [randn(n + off, dtype=pdtype)[off:] for n in sizes]
    m = [randn(n + off, dtype=sdtype, scale=0.1)[off:] for n in sizes]
    v = [(torch.rand(n + off, device=DEV) * 0.1).to(sdtype)[off:] for n in sizes]
    w = [t.float() + 1e-3 * randn(t.numel()) for t in p] if masters else None
    ref = [[t.double().clone() for t in group] for group in (w if masters else p, g, m, v)]  # clone: float64 inputs are updated in place
    lr, b1, b2, eps, wd, step = 1e-3, 0.9, 0.999, 1e-8, 0.01, 10.0
    scale = float(inv.item()) if isinstance(inv, torch.Tensor) else (1.0 if inv is None else inv)
    copt.fused_adamw(KIT, p, g, m, v, w, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, step=step, inv_scale=inv,
                     found_inf=torch.zeros(1, device=DEV))
    torch.cuda.synchronize()
    outs = {}
    for i, (pw, gg, mm, vv) in enumerate(zip(*ref)):
        gs = gg * scale
        mm = b1 * mm + (1 - b1) * gs
        vv = b2 * vv + (1 - b2) * gs * gs
        pw = pw * (1 - lr * wd) - lr / (1 - b1**step) * mm / (vv.sqrt() / math.sqrt(1 - b2**step) + eps)
        outs[f"m{i}"], outs[f"v{i}"], outs[f"p{i}"] = (m[i], mm), (v[i], vv), ((w[i] if masters else p[i]), pw)
    name = (f"adamw {str(pdtype)[6:]}/{str(sdtype)[6:]}{' +masters' if masters else ''} "
            f"inv={'tensor' if isinstance(inv, torch.Tensor) else inv}{'' if aligned else ' unaligned'}")
    record_check(name, sdtype if masters or pdtype == sdtype else torch.float32, outs)
    if masters:  # the params receive their masters rounded
        same = all(torch.equal(a, b.to(pdtype)) for a, b in zip(p, w))
        CHECKS.append({"check": name + ": params are the rounded masters", "ok": same})
        say(f"{'ok  ' if same else 'FAIL'} {name}: params are the rounded masters")
    # a set found_inf skips the step: nothing changes
    before = [t.clone() for t in p + m + v]
    copt.fused_adamw(KIT, p, g, m, v, w, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, step=step, inv_scale=inv,
                     found_inf=torch.ones(1, device=DEV))
    torch.cuda.synchronize()
    same = all(torch.equal(a, b) for a, b in zip(before, p + m + v))
    CHECKS.append({"check": "adamw skips on found_inf", "ok": same})
    say(f"{'ok  ' if same else 'FAIL'} adamw skips on found_inf")


def checks() -> None:
    say("== checks against torch in float64 (relative error of each output)")
    for shape, dtype, cl in ((SHAPE, torch.bfloat16, True), (SHAPE, torch.bfloat16, False), ((32, 256, 14, 14), torch.float32, True),
                             ((8, 3, 7, 7), torch.float16, False), ((8, 5, 7, 7), torch.bfloat16, True), ((512, 1000), torch.float64, False)):
        for training in (True, False):
            check_bn(shape, dtype, cl, training, False, False)
    for cl in (True, False):
        for training in (True, False):
            check_bn(SHAPE, torch.bfloat16, cl, training, True, True)
    for shape, dtype, with_w in (((32768, 4096), torch.bfloat16, True), ((4096, 1000), torch.float32, True), ((512, 768), torch.float16, False)):
        check_norm(shape, dtype, with_w)
    check_adamw(torch.bfloat16, torch.float32, True, torch.tensor([2.0**-10], device=DEV), True)
    check_adamw(torch.bfloat16, torch.float32, True, 0.5, False)
    check_adamw(torch.float32, torch.float32, False, None, True)
    check_adamw(torch.float16, torch.float16, False, 0.25, True)
    check_adamw(torch.float64, torch.float64, False, None, True)


# --- timings ------------------------------------------------------------------------------------------


def graph_us(fn: Callable[[], Any], replays: int = 20) -> float:
    """Median device time of one ``fn()`` from CUDA-graph replays (no host cost)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm on the capture stream: per-stream scratch exists before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / replays)
    return statistics.median(times)


class Times:
    def __init__(self, timer: Timer, copy_bw: float) -> None:
        self.timer, self.bw = timer, copy_bw

    def __call__(self, case: str, impl: str, nbytes: float, fn: Callable[[], Any], graph: bool = True) -> None:
        try:
            b2b = self.timer(fn)["median_us"]
        except Exception as exc:  # a peer that cannot run here says why
            TIMES.append({"case": case, "impl": impl, "error": f"{type(exc).__name__}: {exc}"})
            say(f"{case:<44} {impl:<26} ERROR {type(exc).__name__}: {str(exc)[:120]}")
            return
        dev = float("nan")
        if graph:
            try:
                dev = graph_us(fn)
            except Exception as exc:  # not capturable: the back-to-back time stands alone
                say(f"{case:<44} {impl:<26} (no graph: {type(exc).__name__}: {str(exc)[:80]})")
        best = min(b2b, dev) if not math.isnan(dev) else b2b
        tbs = nbytes / (best * 1e-6) / 1e12
        TIMES.append({"case": case, "impl": impl, "bytes": nbytes, "b2b_us": b2b, "graph_us": dev, "tb_per_s": tbs,
                      "copy_fraction": nbytes / (best * 1e-6) / self.bw})
        say(f"{case:<44} {impl:<26} b2b {b2b:9.1f} us  graph {dev:9.1f} us  {tbs:5.2f} TB/s  {100 * nbytes / (best * 1e-6) / self.bw:5.1f}% of copy")


def time_bn(t: Times) -> None:
    from hal_triton import batchnorm as tbn

    for cl in (True, False):
        fmt = torch.channels_last if cl else torch.contiguous_format
        tag = "NHWC" if cl else "NCHW"
        x = randn(*SHAPE, dtype=torch.bfloat16, scale=2.0, shift=1.0).contiguous(memory_format=fmt)
        g = randn(*SHAPE, dtype=torch.bfloat16).contiguous(memory_format=fmt)
        w, b = torch.rand(64, device=DEV) + 0.5, randn(64)
        rm, rv = torch.zeros(64, device=DEV), torch.ones(64, device=DEV)
        act = x.numel() * x.element_size()
        cfg = launch.batch_norm(x)
        f32 = (torch.float32, torch.float32)
        case = f"bn train fwd {tag} bf16 {SHAPE}"
        t(case, "cpp", 2 * act, lambda: cbn.batch_norm_forward(KIT, x, w, b, rm, rv, True, 0.1, 1e-5, False))
        t(case, "triton", 2 * act, lambda: tbn.batch_norm_forward(x, w, b, rm, rv, True, 0.1, 1e-5, False, cfg))
        t(case, "eager (cuDNN)", 2 * act, lambda: F.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5))
        case = f"bn train bwd {tag} bf16 {SHAPE}"
        t(case, "cpp", 3 * act, lambda: cbn.batch_norm_backward(KIT, g, x, w, None, rm, rv, True, 1e-5, False, f32))
        t(case, "triton", 3 * act, lambda: tbn.batch_norm_backward(g, x, w, None, rm, rv, True, 1e-5, False, cfg, f32))
        if cl:
            _, mean, var, reserve = torch.ops.aten.cudnn_batch_norm(x, w, b, rm, rv, True, 0.1, 1e-5)
            t(case, "eager (cuDNN bwd, saved stats)", 3 * act,
              lambda: torch.ops.aten.cudnn_batch_norm_backward(x, g, w, rm, rv, mean, var, 1e-5, reserve))
        _, mean, invstd = torch.ops.aten.native_batch_norm(x, w, b, rm, rv, True, 0.1, 1e-5)
        t(case, "eager (native bwd, saved stats)", 3 * act,
          lambda: torch.ops.aten.native_batch_norm_backward(g, x, w, rm, rv, mean, invstd, True, 1e-5, [True, True, True]))
        case = f"bn train fwd+relu {tag} bf16 {SHAPE}"
        t(case, "cpp", 2 * act, lambda: cbn.batch_norm_forward(KIT, x, w, b, rm, rv, True, 0.1, 1e-5, True))
        t(case, "triton", 2 * act, lambda: tbn.batch_norm_forward(x, w, b, rm, rv, True, 0.1, 1e-5, True, cfg))
        t(case, "eager (cuDNN + relu_)", 2 * act, lambda: F.relu_(F.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5)))
        case = f"bn train bwd+relu {tag} bf16 {SHAPE}"
        t(case, "cpp", 3 * act, lambda: cbn.batch_norm_backward(KIT, g, x, w, b, rm, rv, True, 1e-5, True, f32))
        t(case, "triton", 3 * act, lambda: tbn.batch_norm_backward(g, x, w, b, rm, rv, True, 1e-5, True, cfg, f32))
        if cl:
            say("-- cpp launch sizes (reduce / apply blocks per SM) at the NHWC case")
            for red in (1, 2, 4, 8):
                for app in (4, 8, 16):
                    c = cbn.Config(red, app)
                    t(f"bn fwd NHWC cfg red={red} app={app}", "cpp", 2 * act,
                      lambda: cbn.batch_norm_forward(KIT, x, w, b, rm, rv, True, 0.1, 1e-5, False, cfg=c))
                    t(f"bn bwd NHWC cfg red={red} app={app}", "cpp", 3 * act,
                      lambda: cbn.batch_norm_backward(KIT, g, x, w, None, rm, rv, True, 1e-5, False, f32, cfg=c))
    x = randn(32, 256, 28, 28, scale=2.0).contiguous(memory_format=torch.channels_last)
    w, b, rm, rv = torch.rand(256, device=DEV) + 0.5, randn(256), torch.zeros(256, device=DEV), torch.ones(256, device=DEV)
    act = x.numel() * 4
    case = "bn train fwd NHWC fp32 (32, 256, 28, 28)"
    t(case, "cpp", 2 * act, lambda: cbn.batch_norm_forward(KIT, x, w, b, rm, rv, True, 0.1, 1e-5, False))
    t(case, "triton", 2 * act, lambda: tbn.batch_norm_forward(x, w, b, rm, rv, True, 0.1, 1e-5, False, launch.batch_norm(x)))
    t(case, "eager (cuDNN)", 2 * act, lambda: F.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5))


def time_norm(t: Times) -> None:
    from hal_triton import norm as tnorm

    x = randn(32768, 4096, dtype=torch.bfloat16, scale=2.0, shift=1.0)
    g = randn(32768, 4096, dtype=torch.bfloat16)
    w = randn(4096, dtype=torch.bfloat16)
    nbytes = 3 * x.numel() * 2
    rows = launch.rows(x, 4096)
    progs = launch.persistent_programs(x)
    for rms in (False, True):
        case = f"{'rms' if rms else 'layer'}_norm bwd bf16 (32768, 4096)"
        eps = 1e-6 if rms else 1e-5
        t(case, "cpp", nbytes, lambda: cnorm.norm_backward(KIT, g, x, 4096, w, eps, rms))
        t(case, "triton", nbytes, lambda: tnorm.norm_backward(g, x, 4096, w, eps, rms, programs=progs, **rows))
        if not rms:
            _, mean, rstd = torch.ops.aten.native_layer_norm(x, [4096], w, None, eps)
            t(case, "eager (native bwd, saved stats)", nbytes, lambda: torch.ops.aten.native_layer_norm_backward(
                g, x, [4096], mean, rstd, w, torch.zeros_like(w), [True, True, True]))
    for bpsm in (1, 2, 3, 4):
        cnorm.BLOCKS_PER_SM = bpsm
        t(f"layer_norm bwd blocks/SM={bpsm}", "cpp", nbytes, lambda: cnorm.norm_backward(KIT, g, x, 4096, w, 1e-5, False))
    cnorm.BLOCKS_PER_SM = 2


def time_adamw(t: Times) -> None:
    from hal_triton import optim as topt

    sizes = [4096 * 4096] * 64 + [4096] * 64  # 1.074 B params: 64 weight matrices and 64 vectors
    p = [torch.randn(n, device=DEV, dtype=torch.bfloat16) for n in sizes]
    g = [torch.randn(n, device=DEV, dtype=torch.bfloat16) for n in sizes]
    w = [t_.float() for t_ in p]
    m = [torch.zeros(n, device=DEV) for n in sizes]
    v = [torch.zeros(n, device=DEV) for n in sizes]
    inv, found = torch.tensor([2.0**-12], device=DEV), torch.zeros(1, device=DEV)
    n = sum(sizes)
    nbytes = 28.0 * n  # bf16 grad + fp32 master, m, v read; fp32 master, m, v + bf16 param written
    kw = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=10.0, inv_scale=inv, found_inf=found)
    case = f"adamw {n / 1e9:.2f}B bf16+fp32 masters+unscale"
    t(case, "cpp", nbytes, lambda: copt.fused_adamw(KIT, p, g, m, v, w, **kw), graph=False)
    t(case, "triton", nbytes, lambda: topt.fused_adamw(p, g, m, v, w, **kw, **launch.multi_tensor(p[0])), graph=False)
    g32 = [t_.float() for t_ in g]
    steps = [torch.tensor(10.0, device=DEV) for _ in sizes]
    # torch's fused AdamW on the fp32 masters with fp32 grads (its bytes: 32 B/param), no bf16 copy
    t(case, "torch._fused_adamw_ (fp32)", nbytes, lambda: torch._fused_adamw_(
        w, g32, m, v, [], steps, lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False,
        maximize=False, grad_scale=inv, found_inf=found), graph=False)


def host_times() -> None:
    from hal_triton import batchnorm as tbn

    say("-- host time per call, tiny inputs (us)")
    x = randn(2, 64, 4, 4, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    w, b, rm, rv = torch.rand(64, device=DEV) + 0.5, randn(64), torch.zeros(64, device=DEV), torch.ones(64, device=DEV)
    cfg = launch.batch_norm(x)
    for name, fn in (("cpp", lambda: cbn.batch_norm_forward(KIT, x, w, b, rm, rv, True, 0.1, 1e-5, False)),
                     ("triton", lambda: tbn.batch_norm_forward(x, w, b, rm, rv, True, 0.1, 1e-5, False, cfg)),
                     ("eager", lambda: F.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5))):
        us = host_overhead_us(fn, calls=300)
        TIMES.append({"case": "host time bn fwd (2, 64, 4, 4)", "impl": name, "host_us": us})
        say(f"host time bn train fwd {name:<8} {us:7.1f} us")


def dispatch() -> None:
    """The registered kernels through hal's dispatcher, each forced by name (needs stevedore, which
    the plugin discovery imports: carried as a wheel in the lead's device calls)."""
    import importlib.util

    if importlib.util.find_spec("stevedore") is None:
        say("-- dispatch: skipped (stevedore is not installed; carry .whl as benchmarks/h200.sh does)")
        return
    import hal

    x = randn(8, 64, 14, 14, dtype=torch.bfloat16, scale=2.0).contiguous(memory_format=torch.channels_last)
    w, b, rm, rv = torch.rand(64, device=DEV) + 0.5, randn(64), torch.zeros(64, device=DEV), torch.ones(64, device=DEV)
    with hal.use(kernel="cpp"):
        decision = hal.explain("batch_norm", x, rm, rv, w, b, training=True)
        y = hal.ops.batch_norm(x, rm, rv, w, b, training=True)
    ref = F.batch_norm(x.double(), torch.zeros(64, device=DEV, dtype=torch.float64), torch.ones(64, device=DEV, dtype=torch.float64),
                       w.double(), b.double(), True)
    say(f"-- dispatch: batch_norm ran {decision.backend}/{decision.kernel}")
    record_check("dispatch hal.ops.batch_norm forced to cpp", torch.bfloat16, {"y": (y, ref)})


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    props = torch.cuda.get_device_properties(DEV)
    say(f"device {props.name} sm_{props.major}{props.minor} {props.multi_processor_count} SMs; torch {torch.__version__}")
    timer = Timer(DEV, budget_s=0.2)
    ceil = measure(DEV, timer)
    say(f"copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul {ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")
    for section in (checks, dispatch, lambda: time_bn(Times(timer, ceil["copy_bytes_per_s"])),
                    lambda: time_norm(Times(timer, ceil["copy_bytes_per_s"])),
                    lambda: time_adamw(Times(timer, ceil["copy_bytes_per_s"])), host_times):
        try:
            section()
        except Exception:
            say("SECTION FAILED\n" + traceback.format_exc())
        torch.cuda.empty_cache()
        (out / "cpp_h200.json").write_text(json.dumps({"ceilings": ceil, "checks": CHECKS, "times": TIMES}, indent=1))
    failed = [c["check"] for c in CHECKS if not c["ok"]]
    say(f"== {len(CHECKS) - len(failed)} of {len(CHECKS)} checks ok{': failed ' + ', '.join(failed) if failed else ''}; {time.time() - t0:.0f} s")
    (out / "cpp_h200.txt").write_text("\n".join(LOG) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/cpp-h200")
