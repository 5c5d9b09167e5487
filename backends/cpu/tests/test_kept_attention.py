"""scaled_dot_product_attention on the CPU backend keeps the flash forward's output and log-sum-exp
for its backward op where hal's node differentiates the call (HAL_TORCH_AUTOGRAD=0; by default
torch's autograd records the flash kernel itself): gradients through hal's autograd equal torch's,
the forward runs once, and a changed output or input makes the backward run the forward again."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import hal
from hal_backend_cpu import attention


def _draw(rng: np.random.Generator, lq: int = 24, lk: int = 24) -> tuple[torch.Tensor, ...]:
    t = lambda *s: torch.from_numpy(rng.standard_normal(s)).float()  # noqa: E731
    return t(2, 3, lq, 16), t(2, 3, lk, 16), t(2, 3, lk, 16), t(2, 3, lq, 16)


pytestmark = pytest.mark.usefixtures("hal_nodes")


@pytest.fixture
def forwards(monkeypatch) -> list:
    """One entry per run of the flash forward kernel (the real one runs)."""
    runs: list = []
    real = attention._flash_forward
    monkeypatch.setattr(attention, "_flash_forward", lambda *a, **kw: runs.append(1) or real(*a, **kw))
    return runs


@pytest.mark.parametrize("causal, lq, lk", [(True, 24, 24), (False, 24, 40), (True, 40, 24)])
def test_autograd_gradients_match_torch_with_one_forward(rng, forwards, causal, lq, lk):
    q, k, v, g = _draw(rng, lq, lk)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with hal.use(backend="cpu"):
        out = hal.ops.scaled_dot_product_attention(*leaves, is_causal=causal)
    assert leaves[0] in attention.KEPT
    out.backward(g)
    assert forwards == [1] and leaves[0] not in attention.KEPT
    want = [t.clone().double().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*want, is_causal=causal).backward(g.double())
    for got, ref in zip(leaves, want):
        torch.testing.assert_close(got.grad.double(), ref.grad, rtol=1e-4, atol=1e-5)


def test_a_changed_output_or_input_runs_the_forward_again(rng, forwards):
    q, k, v, g = _draw(rng)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with hal.use(backend="cpu"):
        out = hal.ops.scaled_dot_product_attention(*leaves, is_causal=True)
        with torch.no_grad():
            out.mul_(2.0)  # the kept output is no longer the forward's
            assert leaves[0] in attention.KEPT  # the same q, k, v: only the output's version tells
            got = hal.ops.scaled_dot_product_attention_backward(g, *leaves, None, True, 0.25)
    assert len(forwards) == 2
    want = torch.autograd.grad(F.scaled_dot_product_attention(*leaves, is_causal=True), leaves, g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
