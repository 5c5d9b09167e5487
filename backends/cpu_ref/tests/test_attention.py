"""cpu_ref's softmax and scaled dot-product attention, and their backwards, against PyTorch in
float64 (and hal_torch's versions)."""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from refcheck import (
    LOW_PRECISION,
    assert_all_close64,
    canonical,
    check_in_dtype,
    randn,
    vjp,
)

import hal
from hal_torch.table import eager

# --- softmax ---------------------------------------------------------------------------------------

#: (id, x shape, dim)
SOFTMAX_CASES = [
    ("vector", (7,), 0),
    ("last_dim", (3, 11), -1),
    ("middle_dim", (2, 13, 3), 1),
    ("long_row", (2, 4099), 1),
    ("size_one", (4, 1), -1),
]
SOFTMAX_IDS = [c[0] for c in SOFTMAX_CASES]


@pytest.mark.parametrize("case", SOFTMAX_CASES, ids=SOFTMAX_IDS)
def test_softmax(case, rng):
    _, shape, dim = case
    x = randn(rng, *shape) * 5
    want = F.softmax(x, dim)
    assert_all_close64(hal.ops.softmax(x, dim), want)
    assert_all_close64(eager("softmax")(*canonical(hal.ops.softmax, x, dim)), want)


@pytest.mark.parametrize("case", SOFTMAX_CASES, ids=SOFTMAX_IDS)
def test_softmax_backward(case, rng):
    _, shape, dim = case
    x, g = randn(rng, *shape), randn(rng, *shape)
    out = F.softmax(x, dim)
    want = vjp(lambda t: F.softmax(t, dim), (x,), g)[0]
    assert_all_close64(hal.ops.softmax_backward(g, out, dim), want)
    assert_all_close64(eager("softmax_backward")(*canonical(hal.ops.softmax_backward, g, out, dim)), want)


# --- scaled dot-product attention ------------------------------------------------------------------

#: (id, q shape (..., L, E), S, Ev, mask kind, is_causal, scale, non-contiguous q/k/v)
SDPA_CASES = [
    ("square", (2, 3, 7, 8), 7, 8, None, False, None, False),
    ("L_lt_S", (1, 2, 5, 16), 11, 9, None, False, None, False),
    ("one_batch_dim", (3, 7, 5), 4, 6, None, False, None, False),
    ("unbatched_2d", (7, 5), 3, 2, None, False, None, False),
    ("long_keys", (1, 1, 3, 8), 1031, 4, None, False, None, False),
    ("custom_scale", (2, 2, 5, 4), 6, 4, None, False, 0.3, False),
    ("non_contiguous", (2, 3, 5, 4), 6, 4, None, False, None, True),
    ("bool_mask_full", (2, 3, 6, 4), 5, 4, "bool_full", False, None, False),
    ("bool_mask_LS", (2, 3, 6, 4), 5, 4, "bool_LS", False, None, False),
    ("bool_mask_keys", (2, 3, 6, 4), 5, 4, "bool_S", False, None, False),
    ("bool_mask_empty_row", (2, 1, 6, 4), 5, 4, "bool_empty_row", False, None, False),
    ("float_mask_broadcast", (2, 3, 6, 4), 5, 4, "float_H1S", False, None, False),
    ("float_mask_neg_inf", (2, 3, 6, 4), 5, 4, "float_neg_inf", False, None, True),
    ("causal_square", (2, 2, 7, 4), 7, 4, None, True, None, False),
    ("causal_L_lt_S", (1, 2, 4, 8), 9, 3, None, True, None, False),
    ("causal_L_gt_S", (1, 2, 9, 8), 4, 3, None, True, 0.5, False),
]
SDPA_IDS = [c[0] for c in SDPA_CASES]


def _mask(rng, kind: Optional[str], batch: tuple[int, ...], length: int, keys: int) -> Optional[torch.Tensor]:
    """An attention mask of the given kind: bool (True = attend) or additive float."""
    if kind is None:
        return None
    if kind.startswith("bool"):
        shape = {"bool_full": (*batch, length, keys), "bool_LS": (length, keys), "bool_S": (keys,)}.get(kind, (length, keys))
        mask = torch.from_numpy(rng.random(shape) < 0.6)
        if kind == "bool_empty_row":
            mask[1] = False  # query 1 may attend to nothing
        return mask
    if kind == "float_H1S":
        return randn(rng, batch[-1], 1, keys)
    values = randn(rng, *batch, length, keys)
    return values.masked_fill(torch.from_numpy(rng.random(values.shape) < 0.3), -math.inf)


def _sdpa_args(rng, q_shape, keys, ev, mask_kind, transposed):
    *batch, length, e = q_shape
    shapes = ((*batch, length, e), (*batch, keys, e), (*batch, keys, ev))
    if transposed:  # (B, L, H, E) memory, viewed as (B, H, L, E), as attention heads usually are
        q, k, v = (randn(rng, s[0], s[2], s[1], s[3]).transpose(1, 2) for s in shapes)
        assert not q.is_contiguous()
    else:
        q, k, v = (randn(rng, *s) for s in shapes)
    return q, k, v, _mask(rng, mask_kind, tuple(batch), length, keys)


def _sdpa(q, k, v, mask, causal, scale):
    if mask is not None and mask.ndim == 1:
        mask = mask[None]  # the same broadcast; torch 2.13's fused CPU kernel rejects 1-D masks
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


def _sdpa_grads(grad_out, q, k, v, mask, causal, scale):
    return vjp(lambda q_, k_, v_: _sdpa(q_, k_, v_, mask, causal, scale), (q, k, v), grad_out)


@pytest.mark.parametrize("case", SDPA_CASES, ids=SDPA_IDS)
def test_sdpa(case, rng):
    _, q_shape, keys, ev, mask_kind, causal, scale, transposed = case
    q, k, v, mask = _sdpa_args(rng, q_shape, keys, ev, mask_kind, transposed)
    want = _sdpa(q, k, v, mask, causal, scale)
    assert_all_close64(hal.ops.scaled_dot_product_attention(q, k, v, mask, causal, scale), want)
    canon = canonical(hal.ops.scaled_dot_product_attention, q, k, v, mask, causal, scale)
    assert_all_close64(eager("scaled_dot_product_attention")(*canon), want)


@pytest.mark.parametrize("case", SDPA_CASES, ids=SDPA_IDS)
def test_sdpa_backward(case, rng):
    _, q_shape, keys, ev, mask_kind, causal, scale, transposed = case
    q, k, v, mask = _sdpa_args(rng, q_shape, keys, ev, mask_kind, transposed)
    g = randn(rng, *q.shape[:-1], ev)
    want = _sdpa_grads(g, q, k, v, mask, causal, scale)
    entry = hal.ops.scaled_dot_product_attention_backward
    assert_all_close64(entry(g, q, k, v, mask, causal, scale), want)
    assert_all_close64(eager(entry.op.name)(*canonical(entry, g, q, k, v, mask, causal, scale)), want)


def test_sdpa_row_with_nothing_to_attend_is_zero(rng):
    """torch 2.13 gives 0 (not NaN) for a fully masked query row, and no gradient through it."""
    q, k, v, mask = _sdpa_args(rng, (2, 1, 6, 4), 5, 3, "bool_empty_row", False)
    out = hal.ops.scaled_dot_product_attention(q, k, v, mask)
    assert torch.equal(out[..., 1, :], torch.zeros_like(out[..., 1, :]))
    assert torch.isfinite(out).all()
    grad_q = hal.ops.scaled_dot_product_attention_backward(randn(rng, 2, 1, 6, 3), q, k, v, mask)[0]
    assert torch.equal(grad_q[..., 1, :], torch.zeros_like(grad_q[..., 1, :]))


@pytest.mark.parametrize(
    "mask, causal, match",
    [
        ("bool", True, r"argument 'attn_mask' must be None when is_causal=True"),
        ("wrong_shape", False, r"argument 'attn_mask' must be broadcastable"),
        ("float32", False, r"argument 'attn_mask' must be of the same dtype as 'q'"),
    ],
    ids=["mask_and_causal", "mask_shape", "mask_dtype"],
)
def test_sdpa_bad_mask_names_the_argument(mask, causal, match, rng):
    q, k, v, _ = _sdpa_args(rng, (2, 5, 4), 6, 4, None, False)
    m = {"bool": torch.ones(5, 6, dtype=torch.bool), "wrong_shape": randn(rng, 5, 5), "float32": randn(rng, 5, 6).float()}[mask]
    with pytest.raises(hal.InvalidArgumentError, match=match):
        hal.ops.scaled_dot_product_attention(q, k, v, m, causal)


# --- every op of the family in every dtype, with torch and NumPy arrays ---------------------------


def _sample_softmax(rng):
    return hal.ops.softmax, (randn(rng, 3, 37), 1), F.softmax


def _sample_softmax_backward(rng):
    out = F.softmax(randn(rng, 3, 37), 1)
    return hal.ops.softmax_backward, (randn(rng, 3, 37), out, 1), lambda g, y, d: torch._softmax_backward_data(g, y, d, y.dtype)


def _sample_sdpa(rng):
    q, k, v, mask = _sdpa_args(rng, (2, 2, 5, 8), 33, 4, "float_H1S", False)
    return hal.ops.scaled_dot_product_attention, (q, k, v, mask, False, None), _sdpa


def _sample_sdpa_backward(rng):
    q, k, v, mask = _sdpa_args(rng, (2, 2, 5, 8), 33, 4, "bool_full", False)
    g = randn(rng, 2, 2, 5, 4)
    return hal.ops.scaled_dot_product_attention_backward, (g, q, k, v, mask, False, 0.25), _sdpa_grads


SAMPLES = {
    "softmax": _sample_softmax,
    "softmax_backward": _sample_softmax_backward,
    "scaled_dot_product_attention": _sample_sdpa,
    "scaled_dot_product_attention_backward": _sample_sdpa_backward,
}


@pytest.mark.parametrize("array", ["torch", "numpy"])
@pytest.mark.parametrize("dtype", ["float64", *LOW_PRECISION])
@pytest.mark.parametrize("op", list(SAMPLES))
def test_dtypes_and_array_types(op, dtype, array, rng):
    check_in_dtype(SAMPLES[op], dtype, array, rng)
