"""The CPU backend's ``flash`` kernel of scaled_dot_product_attention: grouped-query attention as
``hal.nn.patch`` calls it, queries (B, Hkv, G, L, E) over keys and values (B, Hkv, 1, S, E), on
torch's flash CPU kernels with ``enable_gqa`` (recorded by torch's autograd). It is chosen for that
layout (with HAL_TUNE off, by priority), declines others with its reason, and its output and
gradients agree with attention computed in float64 over the keys repeated per group."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import hal

DTYPES = {torch.float32: 2e-5, torch.float64: 1e-12, torch.bfloat16: 3e-2}


def _qkv(b, hkv, g, t, s, e, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv, g, t, e, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(b, hkv, 1, s, e, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(b, hkv, 1, s, e, generator=gen).to(dtype).requires_grad_()
    return q, k, v


def _reference(q, k, v, causal, scale):
    """float64 attention, each key/value head repeated over its group of query heads."""
    b, hkv, g, t, e = q.shape
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(qd.reshape(b, hkv * g, t, e), kd.expand(b, hkv, g, -1, e).reshape(b, hkv * g, -1, e),
                                         vd.expand(b, hkv, g, -1, e).reshape(b, hkv * g, -1, e), is_causal=causal, scale=scale)
    return out.reshape(b, hkv, g, t, e), (qd, kd, vd)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
@pytest.mark.parametrize("causal,t,s", [(True, 16, 16), (False, 7, 13), (True, 5, 9)])
def test_grouped_attention_matches_float64(dtype, causal, t, s) -> None:
    seed = int.from_bytes(os.urandom(4), "little")
    q, k, v = _qkv(2, 2, 3, t, s, 16, dtype, seed)
    scale = 0.3
    with hal.use(kernel={"scaled_dot_product_attention": "flash"}):
        out = hal.ops.scaled_dot_product_attention(q, k, v, None, causal, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert out.grad_fn is not None and "Hal" not in type(out.grad_fn).__name__  # torch's autograd recorded it
    ref, leaves = _reference(q, k, v, causal, scale)
    tol = DTYPES[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol, msg=f"seed {seed}")
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    out.backward(g)
    ref.backward(g.double())
    for name, got, want in zip("qkv", (q, k, v), leaves):
        assert got.grad.shape == got.shape
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=tol * 4, atol=tol * 4, msg=f"d{name}, seed {seed}")


def _chosen(q, k, v, mask=None):
    return hal.explain("scaled_dot_product_attention", q, k, v, mask, mask is None, 0.25)


def test_the_grouped_layout_takes_the_flash_kernel_and_others_keep_the_torch_kernel() -> None:
    q, k, v = _qkv(2, 1, 4, 16, 16, 16, torch.bfloat16, 0)
    text = str(_chosen(q, k, v))
    assert "chosen: cpu/flash" in text and "torch's autograd" in text
    q4, k4, v4 = (x.detach().squeeze(2).requires_grad_() for x in (q[:, :, :1], k, v))  # (B, H, L, E): the torch kernel's
    text = str(_chosen(q4, k4, v4))
    assert "chosen: cpu/torch" in text and "not the grouped layout" in text
    mask = torch.ones(16, 16, dtype=torch.bool)
    text = str(_chosen(q, k, v, mask))
    assert "chosen: cpu/torch" in text and "attn_mask given" in text


def test_flash_declines_empty_and_unequal_head_sizes() -> None:
    q, k, v = _qkv(2, 1, 4, 0, 16, 16, torch.float32, 0)
    assert "empty dimensions" in str(_chosen(q, k, v))
    q, k, _ = _qkv(2, 1, 4, 8, 8, 16, torch.float32, 0)
    v = torch.randn(2, 1, 1, 8, 8, requires_grad=True)
    assert "head sizes differ" in str(_chosen(q, k, v))
