"""On a GPU with Liger-Kernel installed (the H200 run of benchmarks/h200.sh bench): each Liger-Kernel
peer of hal bench computes the op it stands for, in each way it is timed (forward; backward of a
retained graph, run twice; a training step after a restore), on fresh random float32 inputs,
against the op's eager twin in float64 on the CPU. A peer called with the wrong argument order,
layout or option gives errors of order one, far above the tolerance.

Cannot run here: Liger-Kernel's Triton kernels need a GPU (and CI does not install Liger-Kernel);
skipped with that reason.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import pytest
import torch

from hal.registry import get_op
from hal_torch.table import eager
from hal_bench import liger
from hal_bench.cases import canonical

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: Liger-Kernel's kernels are Triton GPU kernels"),
    pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="Liger-Kernel not installed (benchmarks/h200.sh carries its wheel)"),
]

#: float32 kernels against float64: reduction order stays far below 1e-3; the LM head's GEMMs may run
#: in the matrix units' float32 mode (near 3e-4). A wrong argument or layout gives errors near 1.
TOL = {"linear_cross_entropy": 5e-3}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert torch.isfinite(got).all()
    return float((got - want).norm() / want.norm())


def _inputs(op: str, dev: torch.device) -> tuple[tuple, tuple[str, ...]]:
    """Random float32 inputs of a shape each kernel takes (rows wider than one block of 1024)."""
    r = lambda *s: torch.randn(*s, device=dev)  # noqa: E731
    if op in ("rms_norm", "layer_norm"):
        extra = (r(1536),) if op == "rms_norm" else (r(1536), r(1536))
        return (r(96, 1536), (1536,), *extra), ("x", "weight") if op == "rms_norm" else ("x", "weight", "bias")
    if op == "softmax":
        return (r(96, 1536) * 3, -1), ("x",)
    if op == "swiglu":
        return (r(96, 1536), r(96, 1536)), ("gate", "up")
    if op == "rotary_embedding":
        t, d = 40, 64
        theta = torch.arange(t, device=dev)[:, None] * 10000.0 ** (-torch.arange(d // 2, device=dev) / (d // 2))
        return (r(3, 8, t, d), theta.cos(), theta.sin()), ("x",)
    target = torch.randint(0, 1000, (96,), device=dev)
    target[::9] = -100
    if op == "cross_entropy":
        return (r(96, 1000) * 2, target), ("logits",)
    return (r(96, 128), r(1000, 128) / math.sqrt(128), target), ("x", "weight")


def _reference(op: str, canon: tuple, wrt: tuple[str, ...], grad_out: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The eager twin's result and gradients in float64 on the CPU."""
    names = get_op(op).param_names
    up = [a.detach().cpu().double() if isinstance(a, torch.Tensor) and a.is_floating_point() else
          (a.cpu() if isinstance(a, torch.Tensor) else a) for a in canon]
    leaves = []
    for name in wrt:
        up[names.index(name)].requires_grad_(True)
        leaves.append(up[names.index(name)])
    out = eager(op)(*up)
    g = None if grad_out is None else grad_out.detach().cpu().double()
    return out, list(torch.autograd.grad(out, leaves, g))


@pytest.mark.parametrize("op", sorted(liger.ADAPTERS))
def test_liger_peer_computes_the_op(op: str) -> None:
    dev = torch.device("cuda")
    args, wrt = _inputs(op, dev)
    canon = canonical(op, args, {})
    is_loss = op in ("cross_entropy", "linear_cross_entropy")
    ref_out = eager(op)(*[a.cpu().double() if isinstance(a, torch.Tensor) and a.is_floating_point() else
                          (a.cpu() if isinstance(a, torch.Tensor) else a) for a in canon])
    fwd = liger.peer(op, "forward", canon)
    assert fwd.run is not None, fwd.reason
    tol = TOL.get(op, 1e-3)
    assert _rel(fwd.run(), ref_out) < tol

    grad_out = None if is_loss else torch.randn(ref_out.shape, device=dev)
    _, ref_grads = _reference(op, canon, wrt, grad_out)
    bwd = liger.peer(op, "backward", canon, wrt, grad_out)
    if is_loss:
        assert bwd.run is None and "forward pass" in (bwd.reason or "")
        step = liger.peer(op, "train", canon, wrt)
        assert step.run is not None, step.reason
        for _ in range(2):  # the second step after a restore sees the same inputs as the first
            if step.restore:
                step.restore()
            grads = step.run()
    else:
        assert bwd.run is not None, bwd.reason
        for _ in range(2):  # a retained graph run twice: the timed runs see what the first saw
            if bwd.restore:
                bwd.restore()
            grads = bwd.run()
    for name, got, want in zip(wrt, grads, ref_grads):
        if op == "rotary_embedding":
            got = got.transpose(1, 2)  # the peer's leaf is q stored as (B, T, H, D)
        assert _rel(got, want) < tol, name
