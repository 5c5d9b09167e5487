"""linear_cross_entropy on the fast CPU backend: a training forward (hal's autograd node, mean or sum)
turns each block's logits into gradients and keeps them for the backward op, which only scales them
by grad_out; a backward op called on its own (nothing kept) computes the logits again. Both give
torch's gradients of ``F.cross_entropy(x @ w.T + b, t)``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import hal
from hal_backend_cpu import loss as loss_module


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bfloat16"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_training_forward_keeps_the_gradients_its_backward_scales(dtype: torch.dtype, reduction: str, rng: np.random.Generator) -> None:
    n, k, v = 37, 24, 70
    draw = lambda *shape, scale=1.0: (torch.from_numpy(rng.standard_normal(shape)) * scale).to(dtype).requires_grad_(True)  # noqa: E731
    x, w, b = draw(n, k), draw(v, k, scale=0.3), draw(v)
    t = torch.from_numpy(rng.integers(0, v, n))
    t[[3, 11]] = -100
    g = torch.tensor(float(rng.uniform(0.5, 3.5)), dtype=torch.float64)
    with hal.use(backend="cpu"):
        loss = hal.ops.linear_cross_entropy(x, w, t, b, label_smoothing=0.1, reduction=reduction)
        assert x in loss_module._KEPT
        loss.backward(g.to(loss.dtype))
        assert x not in loss_module._KEPT
        recomputed = hal.ops.linear_cross_entropy_backward(g.to(loss.dtype), x.detach(), w.detach(), t, b.detach(), -100, 0.1, reduction)
    assert not any(loss_module._KEPT._entries)  # a call without autograd keeps nothing
    refs = [p.detach().double().requires_grad_(True) for p in (x, w, b)]
    F.cross_entropy(refs[0] @ refs[1].T + refs[2], t, label_smoothing=0.1, reduction=reduction).backward(g)
    for got, again, ref in zip((x.grad, w.grad, b.grad), recomputed, refs):
        scale = float(ref.grad.abs().max())
        tol = {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 2e-2, "atol": 1e-2 * scale}
        torch.testing.assert_close(got.double(), ref.grad, **tol)
        torch.testing.assert_close(got, again, **tol)
