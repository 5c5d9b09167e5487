"""Host time of one ResNet layer on the training path, layer by layer: tiny inputs (the device is
never the bottleneck), forward alone and forward + backward, hal next to the torch calls a model
would make instead, then the single hal ops of the training decomposition and one bare Triton
launch. For finding where a training step's host time goes, not for the results table.

    python benchmarks/host_training.py [--device cuda] [--calls 300]

Each row: the best of three rounds of ``calls`` back-to-back calls, in µs per call (launches are
asynchronous, so this is the host's cost).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

import hal
from hal_bench.timing import host_overhead_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    dev = torch.device(args.device)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cl = torch.channels_last
    gen = torch.Generator(device="cpu").manual_seed(int.from_bytes(os.urandom(4), "little"))

    def rand(*shape: int, grad: bool = False, fmt: Any = None) -> torch.Tensor:
        t = torch.randn(*shape, generator=gen).to(dev, dt)
        if fmt is not None:
            t = t.contiguous(memory_format=fmt)
        return t.requires_grad_(grad)

    x = rand(2, 16, 8, 8, grad=True, fmt=cl)
    w = rand(16, 16, 3, 3, grad=True, fmt=cl)
    gamma = (torch.rand(16, generator=gen) + 0.5).to(dev, dt).requires_grad_()
    beta = rand(16, grad=True)
    rm, rv = torch.zeros(16, device=dev, dtype=dt), torch.ones(16, device=dev, dtype=dt)
    g = rand(2, 16, 8, 8, fmt=cl)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def row(name: str, fn: Callable[[], Any]) -> float:
        fn()
        sync()
        us = host_overhead_us(fn, calls=args.calls)
        sync()
        print(f"{name:<72} {us:9.1f} us/call", flush=True)
        return us

    def row_on_thread(name: str, fn: Callable[[], Any]) -> None:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            _on_thread(fn, args.calls)
            sync()
            best = min(best, (time.perf_counter() - t0) / args.calls * 1e6)
        print(f"{name:<72} {best:9.1f} us/call", flush=True)

    def fwd_bwd(f: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            out = f()
            out.backward(g if out.shape == g.shape else torch.ones_like(out))

        return run

    def torch_layer() -> torch.Tensor:
        return F.relu(F.batch_norm(F.conv2d(x, w, None, 1, 1), rm, rv, gamma, beta, True, 0.1, 1e-5))

    def hal_layer() -> torch.Tensor:
        return hal.ops.fused_conv_bn_relu(x, w, None, gamma, beta, rm, rv, 1, 1, 1, 1, 1e-5, 0.1, True)

    print(f"torch {torch.__version__}, hal {hal.__version__}, {dev}, {dt}, (2, 16, 8, 8) channels_last, 3x3 conv 16->16")
    print("-- one layer: conv -> batch norm (training) -> ReLU")
    row("torch: conv2d, batch_norm, relu forward", torch_layer)
    row("torch: conv2d, batch_norm, relu forward + backward", fwd_bwd(torch_layer))
    row("hal.ops.fused_conv_bn_relu training forward (its route)", hal_layer)
    row("hal.ops.fused_conv_bn_relu training forward + backward (its route)", fwd_bwd(hal_layer))
    decision = hal.explain("fused_conv_bn_relu", x, w, None, gamma, beta, rm, rv, 1, 1, 1, 1, 1e-5, 0.1, True)
    print(f"   its route: {decision.route} ({decision.backend}/{decision.kernel})")
    for name, layer in (("torch", torch_layer), ("hal", hal_layer)):
        print(f"   {name}'s autograd graph: {' <- '.join(_graph(layer()))}")
    hal.reset_stats()
    fwd_bwd(hal_layer)()
    print("   hal's kernels in one forward + backward: " + ", ".join(f"{op} {b}/{k} x{c['calls']}" for (op, b, k), c in hal.stats().items()))
    for name, layer in (("torch", torch_layer), ("hal", hal_layer)):
        fwd_us, bwd_us = _split_us(layer, g, sync, args.calls)
        print(f"   {name}: forward {fwd_us:.1f} us, backward {bwd_us:.1f} us (host, best of 3 rounds)")
    with torch.no_grad():  # the kernels that could run these inputs as one autograd node
        plain = hal.explain("fused_conv_bn_relu", x.detach(), w.detach(), None, gamma.detach(), beta.detach(), rm, rv, 1, 1, 1, 1, 1e-5, 0.1, True)
    for cand in plain.candidates:
        if cand.backend == plain.backend and cand.supported and cand.kernel != "composite":
            with hal.use(kernel={"fused_conv_bn_relu": cand.kernel}):
                row(f"hal fused_conv_bn_relu forced {cand.kernel}: forward + backward", fwd_bwd(hal_layer))

    print("-- the ops of the training decomposition, each with autograd, against torch's")
    y = rand(2, 16, 8, 8, grad=True, fmt=cl)
    row("torch: conv2d forward + backward", fwd_bwd(lambda: F.conv2d(x, w, None, 1, 1)))
    row("hal.ops.conv2d forward + backward", fwd_bwd(lambda: hal.ops.conv2d(x, w, None, 1, 1)))
    row("torch: batch_norm training forward + backward", fwd_bwd(lambda: F.batch_norm(y, rm, rv, gamma, beta, True, 0.1, 1e-5)))
    row("hal.ops.batch_norm training forward + backward", fwd_bwd(lambda: hal.ops.batch_norm(y, rm, rv, gamma, beta, True, 0.1, 1e-5)))
    row("torch: relu forward + backward", fwd_bwd(lambda: F.relu(y)))
    row("hal.ops.scale_shift_act(relu) forward + backward", fwd_bwd(lambda: hal.ops.scale_shift_act(y, 1.0, 0.0, "relu")))

    print("-- the same with hal's own autograd nodes (HAL_TORCH_AUTOGRAD=0), and a minimal Python autograd node")
    before = os.environ.get("HAL_TORCH_AUTOGRAD")
    os.environ["HAL_TORCH_AUTOGRAD"] = "0"
    hal.dispatch.reset()
    row("hal.ops.fused_conv_bn_relu training forward + backward, hal's nodes", fwd_bwd(hal_layer))
    row("hal.ops.scale_shift_act(relu) forward + backward, hal's node", fwd_bwd(lambda: hal.ops.scale_shift_act(y, 1.0, 0.0, "relu")))
    if before is None:
        del os.environ["HAL_TORCH_AUTOGRAD"]
    else:
        os.environ["HAL_TORCH_AUTOGRAD"] = before
    hal.dispatch.reset()
    row("torch.autograd.Function around torch.relu: forward + backward", fwd_bwd(lambda: _PythonRelu.apply(y)))

    print("-- backward ops called directly, on this thread and on another (autograd runs CUDA backward nodes on its device thread)")
    yd, gd = y.detach(), g
    direct = {
        "torch: aten.threshold_backward": lambda: torch.ops.aten.threshold_backward(gd, yd, 0.0),
        "hal.ops.scale_shift_act_backward (relu, grad_x only)": lambda: hal.ops.scale_shift_act_backward(gd, yd, 1.0, 0.0, "relu", (True, False, False)),
        "hal.ops.batch_norm_backward (statistics recomputed)": lambda: hal.ops.batch_norm_backward(gd, yd, rm, rv, gamma.detach(), True, 1e-5),
    }
    for name, fn in direct.items():
        row(f"{name}, this thread", fn)
        row_on_thread(f"{name}, another thread", fn)
    row("torch: relu forward with grad (no backward)", lambda: F.relu(y))
    row("hal.ops.scale_shift_act(relu) forward with grad (no backward)", lambda: hal.ops.scale_shift_act(y, 1.0, 0.0, "relu"))

    _transformer_ops(row, rand, fwd_bwd)

    print("-- without autograd")
    with torch.no_grad():
        yd = y.detach()
        row("torch: batch_norm training forward, no grad", lambda: F.batch_norm(yd, rm, rv, gamma, beta, True, 0.1, 1e-5))
        row("hal.ops.batch_norm training forward, no grad", lambda: hal.ops.batch_norm(yd, rm, rv, gamma, beta, True, 0.1, 1e-5))
        row("torch: relu, no grad", lambda: F.relu(yd))
        row("hal.ops.scale_shift_act(relu), no grad", lambda: hal.ops.scale_shift_act(yd, 1.0, 0.0, "relu"))
        row("torch.empty_like", lambda: torch.empty_like(yd))
        if dev.type == "cuda":
            _bare_launches(row, yd)


def _transformer_ops(row: Callable[[str, Callable[[], Any]], float], rand: Callable[..., torch.Tensor], fwd_bwd: Callable) -> None:
    """The hal ops of a Llama layer, forward + backward with autograd, against the torch code a
    model would run instead, and each hal op forced to every other kernel that runs the inputs."""
    x, w = rand(2, 64, 256, grad=True), rand(256, grad=True)
    q, k, v = (rand(2, 4, 64, 64, grad=True) for _ in range(3))
    cos, sin = rand(64, 32), rand(64, 32)
    gate, up = rand(2, 64, 512, grad=True), rand(2, 64, 512, grad=True)

    def rotate(t: torch.Tensor) -> torch.Tensor:
        t1, t2 = t.chunk(2, -1)
        c, s = cos.float(), sin.float()
        return torch.cat((t1.float() * c - t2.float() * s, t2.float() * c + t1.float() * s), -1).to(t.dtype)

    cases = {
        "rms_norm": (lambda: F.rms_norm(x, (256,), w, 1e-6), lambda: hal.ops.rms_norm(x, (256,), w, 1e-6), (x, (256,), w, 1e-6)),
        "rotary_embedding": (lambda: rotate(q), lambda: hal.ops.rotary_embedding(q, cos, sin), (q, cos, sin)),
        "swiglu": (lambda: F.silu(gate) * up, lambda: hal.ops.swiglu(gate, up), (gate, up)),
        "scaled_dot_product_attention": (
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            lambda: hal.ops.scaled_dot_product_attention(q, k, v, None, True),
            (q, k, v, None, True),
        ),
    }
    print("-- the ops of a Llama layer, forward + backward, against the torch code a model would run")
    for op, (peer, ours, op_args) in cases.items():
        row(f"torch: {op} forward + backward", fwd_bwd(peer))
        decision = hal.explain(op, *op_args)
        row(f"hal.ops.{op} forward + backward ({decision.backend}/{decision.kernel}, by {decision.autograd_by})", fwd_bwd(ours))
        for spec in hal.dispatch.DISPATCHER.runtime().kernels(op, decision.backend or ""):
            if spec.name == decision.kernel:
                continue
            with hal.use(kernel={op: spec.name}):
                try:
                    forced = hal.explain(op, *op_args)
                    if forced.error is None:
                        row(f"hal.ops.{op} forward + backward, forced {spec.name} (by {forced.autograd_by})", fwd_bwd(ours))
                except hal.HalError as exc:  # the kernel cannot run these inputs
                    print(f"hal.ops.{op} forced {spec.name}: {type(exc).__name__}")


def _graph(out: torch.Tensor) -> list[str]:
    """The autograd nodes behind ``out``, breadth first from its grad_fn (gradient sinks left out)."""
    names, seen, queue = [], set(), [out.grad_fn]
    while queue:
        node = queue.pop(0)
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ != "AccumulateGrad":
            names.append(type(node).__name__)
        queue += [n for n, _ in node.next_functions]
    return names


def _split_us(layer: Callable[[], torch.Tensor], grad: torch.Tensor, sync: Callable[[], None], calls: int) -> tuple[float, float]:
    """Host µs of the forward and of ``backward()`` of ``layer``, each the best of three rounds."""
    best_f = best_b = float("inf")
    for _ in range(3):
        sync()
        tf = tb = 0.0
        for _ in range(calls):
            t0 = time.perf_counter()
            out = layer()
            t1 = time.perf_counter()
            out.backward(grad)
            tf, tb = tf + t1 - t0, tb + time.perf_counter() - t1
        best_f, best_b = min(best_f, tf / calls * 1e6), min(best_b, tb / calls * 1e6)
    return best_f, best_b


class _PythonRelu(torch.autograd.Function):
    """The least a Python autograd node can do: what hal's generated nodes cost beyond it is hal's."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return torch.relu(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return torch.ops.aten.threshold_backward(grad, x, 0.0)


def _on_thread(fn: Callable[[], Any], calls: int) -> None:
    """``calls`` calls of fn on a fresh thread, waited for (its start is paid once per ``calls``)."""
    import threading

    def loop() -> None:
        for _ in range(calls):
            fn()

    worker = threading.Thread(target=loop)
    worker.start()
    worker.join()


def _bare_launches(row: Callable[[str, Callable[[], Any]], float], t: torch.Tensor) -> None:
    """One Triton launch through hal's launch helper (the fast path) and through Triton itself."""
    import triton
    import triton.language as tl

    from hal_triton._launch import launch

    @triton.jit
    def _copy(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)

    out = torch.empty_like(t)
    n = t.numel()
    row("Triton launch through hal_triton launch() (fast path)", lambda: launch(_copy, (1,), t, out, n, BLOCK=1024))
    row("Triton launch through kernel[grid](...)", lambda: _copy[(1,)](t, out, n, BLOCK=1024))
    row("torch: out.copy_(t)", lambda: out.copy_(t))


if __name__ == "__main__":
    main()
