"""The CPU backend's training batch norm keeps its batch statistics for the backward op of the same
x where hal's node differentiates the call (HAL_TORCH_AUTOGRAD=0; by default torch's autograd
records torch's batch norm, and nothing is kept): gradients through hal's autograd equal torch's,
and after an in-place change of x the backward recomputes from the new data."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import hal
from hal_torch.conv import KEPT


def _draw(rng: np.random.Generator, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    t = lambda *s: torch.from_numpy(rng.standard_normal(s)).to(dtype)  # noqa: E731
    x = t(4, 6, 5, 5).contiguous(memory_format=torch.channels_last)
    return x, t(6) + 2.0, t(6), t(4, 6, 5, 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autograd_gradients_match_torch_and_use_the_kept_statistics(rng, dtype, monkeypatch, hal_nodes):
    x, w, b, g = _draw(rng, dtype)
    recomputed = []
    real = torch.native_batch_norm
    monkeypatch.setattr(torch, "native_batch_norm", lambda *a: recomputed.append(a[5]) or real(*a))
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    with hal.use(backend="cpu"):
        out = hal.ops.batch_norm(leaves[0], None, None, leaves[1], leaves[2], True, 0.1, 1e-5)
    assert leaves[0] in KEPT
    out.backward(g)
    assert leaves[0] not in KEPT and recomputed == [True], recomputed  # the forward's one call, none in the backward
    want = [t.detach().double().requires_grad_() for t in (x, w, b)]
    F.batch_norm(want[0], None, None, want[1], want[2], True, 0.1, 1e-5).backward(g.double())
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for got, ref in zip(leaves, want):
        torch.testing.assert_close(got.grad.double(), ref.grad, rtol=tol, atol=tol)


def test_an_in_place_change_between_forward_and_backward_recomputes(rng):
    x, w, b, g = _draw(rng, torch.float32)
    with hal.use(backend="cpu"):
        hal.ops.batch_norm(x, None, None, w, b, True, 0.1, 1e-5)
        x.mul_(3.0).add_(1.0)
        gx, gw, gb = hal.ops.batch_norm_backward(g, x, None, None, w, True, 1e-5)
    xr = x.double().requires_grad_()
    wr, br = w.double().requires_grad_(), b.double().requires_grad_()
    F.batch_norm(xr, None, None, wr, br, True, 0.1, 1e-5).backward(g.double())
    for got, ref in zip((gx, gw, gb), (xr.grad, wr.grad, br.grad)):
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_layer_norm_keeps_its_statistics_and_gradients_match_torch(rng, hal_nodes):
    from hal_backend_cpu.norm import KEPT as LN_KEPT

    t = lambda *s: torch.from_numpy(rng.standard_normal(s)).float()  # noqa: E731
    x, w, b, g = t(6, 5, 32) * 3 + 2, t(32) + 1.5, t(32), t(6, 5, 32)
    leaves = [v.clone().requires_grad_() for v in (x, w, b)]
    with hal.use(backend="cpu"):
        out = hal.ops.layer_norm(leaves[0], 32, leaves[1], leaves[2])
        assert leaves[0] in LN_KEPT
        out.backward(g)
        assert leaves[0] not in LN_KEPT
        hal.ops.layer_norm(x, 32, w, b)
        assert x not in LN_KEPT  # no autograd: no backward op to come, nothing kept (hal.integration.kept.arm)
        x.mul_(0.5).add_(4.0)
        changed = hal.ops.layer_norm_backward(g, x, 32, w)
    for xs, got in ((leaves[0].detach(), [v.grad for v in leaves]), (x, changed)):
        want = [v.detach().double().requires_grad_() for v in (xs, w, b)]
        F.layer_norm(want[0], (32,), want[1], want[2]).backward(g.double())
        for a, e in zip(got, want):
            torch.testing.assert_close(a.double(), e.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_by_default_torch_records_batch_norm_and_nothing_is_kept(rng, dtype):
    x, w, b, g = _draw(rng, dtype)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    with hal.use(backend="cpu"):
        assert hal.explain("batch_norm", leaves[0], None, None, leaves[1], leaves[2], True, 0.1, 1e-5).autograd_by == "torch"
        out = hal.ops.batch_norm(leaves[0], None, None, leaves[1], leaves[2], True, 0.1, 1e-5)
    assert leaves[0] not in KEPT and "Hal" not in type(out.grad_fn).__name__
    out.backward(g)
    want = [t.detach().double().requires_grad_() for t in (x, w, b)]
    F.batch_norm(want[0], None, None, want[1], want[2], True, 0.1, 1e-5).backward(g.double())
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for got, ref in zip(leaves, want):
        torch.testing.assert_close(got.grad.double(), ref.grad, rtol=tol, atol=tol)
