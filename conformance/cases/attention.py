"""Cases of softmax, scaled_dot_product_attention and their backward ops.

softmax: reductions along the last, a middle and the first dimension, odd sizes, rows of 32k,
non-contiguous rows, large logits (exp overflows unless the row maximum is subtracted), tiny logits,
and the values the op defines: -inf logits get probability 0, a row of only -inf and a row holding
NaN give NaN (as torch).

Attention: heads of 64, L != S both ways, Ev != E, 3-D inputs, causal masks (top-left aligned, also
with L != S), boolean and additive masks broadcast over batch and heads, a query row with nothing
to attend to (whatever value the op defines there: torch 2.13 and cpu_ref give zeros), an explicit scale, the (B, L, H, E) -> (B, H, L, E) transposed
views attention projections produce, and large logits.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from hal.ops.attention import attention_batch

from . import Call, Draw, Table, backward_call, case, from_table

# --- softmax ------------------------------------------------------------------------------------


def softmax_args(d: Draw, shape: tuple[int, ...], dim: int = -1, layout: str = "contiguous", values: str = "unit", specials: str = "") -> Call:
    """``specials``: "neg_inf" (some -inf logits, one row all -inf) or "nan" (a NaN in one row)."""
    raw = d.magnitude(values) * d.rng.standard_normal(shape)
    rows = np.moveaxis(raw, dim, -1)  # a view: writes land in raw
    if specials == "neg_inf":
        rows[d.rng.random(rows.shape) < 0.3] = -np.inf
        rows[..., 0] = np.where(np.isinf(rows[..., 0]), 1.0, rows[..., 0])  # each row keeps a finite logit
        rows[(0,) * (rows.ndim - 1)] = -np.inf  # except the first, which gives NaN
    elif specials == "nan":
        rows[(-1,) * (rows.ndim - 1) + (rows.shape[-1] // 2,)] = np.nan
    return Call({"x": d.tensor(raw, layout=layout), "dim": dim})


def _softmax_probs(d: Draw, shape: tuple[int, ...], dim: int) -> np.ndarray:
    z = np.moveaxis(d.rng.standard_normal(shape), dim, -1)
    e = np.exp(z - z.max(axis=-1, keepdims=True, initial=-np.inf))
    return np.moveaxis(e / e.sum(axis=-1, keepdims=True), -1, dim)


def softmax_backward_args(d: Draw, shape: tuple[int, ...], dim: int = -1, layout: str = "contiguous") -> Call:
    """``out`` is a softmax output (rows summing to one), rounded to the case dtype."""
    return Call({"grad_out": d.normal(*shape, layout=layout), "out": d.tensor(_softmax_probs(d, shape, dim), layout=layout), "dim": dim})


SOFTMAX_SHAPES: Table = {
    "attention_probs": (dict(shape=(2, 8, 16, 16)), True, True),
    "middle_dim": (dict(shape=(4, 10, 6), dim=1), True, True),
    "first_dim": (dict(shape=(33, 5), dim=0), False, True),
    "odd_prime": (dict(shape=(3, 7, 13)), False, True),
    "vector_1000": (dict(shape=(1000,)), False, False),
    "long_row": (dict(shape=(2, 32768)), False, True),
    "noncontig": (dict(shape=(6, 9, 40), layout="noncontig"), False, True),
}

def _softmax_0d(d: Draw, dim: int) -> Call:
    """A 0-d x: a softmax over one value, 1 (as torch, for dim 0 or -1)."""
    return Call({"x": d.tensor(d.rng.standard_normal()), "dim": dim})


def _softmax_backward_0d(d: Draw) -> Call:
    return Call({"grad_out": d.tensor(d.rng.standard_normal()), "out": d.tensor(1.0), "dim": -1})


SOFTMAX_SHAPES_EMPTY: Table = {
    "empty_rows": (dict(shape=(0, 7)), True, True),
    "empty_reduced_dim": (dict(shape=(3, 0)), False, True),
    "empty_middle_dim": (dict(shape=(2, 0, 5), dim=1), False, True),
}

SOFTMAX = from_table({**SOFTMAX_SHAPES, **SOFTMAX_SHAPES_EMPTY}, softmax_args) + [
    case("large_values", softmax_args, shape=(4, 100), values="big"),
    case("fp16_underflow", softmax_args, shape=(4, 100), values="tiny", dtypes=("float16",)),
    case("neg_inf_logits", softmax_args, shape=(6, 17), specials="neg_inf"),
    case("nan_propagation", softmax_args, shape=(5, 12), specials="nan"),
    case("scalar_0d", _softmax_0d, quick=True, dim=-1),
    case("scalar_0d_dim0", _softmax_0d, dim=0),
]
SOFTMAX_BACKWARD = from_table({**SOFTMAX_SHAPES, **SOFTMAX_SHAPES_EMPTY}, softmax_backward_args, backward=True) + [
    case("scalar_0d", _softmax_backward_0d),
]

# --- scaled_dot_product_attention ------------------------------------------------------------------


def sdpa_args(
    d: Draw,
    q: tuple[int, ...],
    s: int,
    ev: Optional[int] = None,
    causal: bool = False,
    mask: str = "",
    scale: Optional[float] = None,
    heads_transposed: bool = False,
    magnitude: float = 1.0,
    k_batch: Optional[tuple[int, ...]] = None,
    v_batch: Optional[tuple[int, ...]] = None,
) -> Call:
    """q of shape ``q`` = (..., L, E); k (..., s, E), v (..., s, ev). ``mask``: "bool" (L, S) broadcast,
    "float" additive (B, 1, L, S), or "empty_row" (a bool mask whose first query row is all False).
    ``k_batch`` / ``v_batch``: batch dimensions of k / v that broadcast against q's (default q's)."""
    *batch, length, e = q
    ev = e if ev is None else ev

    def qkv(seq: int, feat: int, own: Optional[tuple[int, ...]] = None) -> Any:
        if heads_transposed:  # drawn as (B, L, H, E), used as the (B, H, L, E) view
            b, h = batch
            return d.normal(b, seq, h, feat, std=magnitude).transpose(1, 2)
        return d.normal(*(batch if own is None else own), seq, feat, std=magnitude)

    attn_mask = None
    if mask == "bool":
        attn_mask = d.mask(length, s)
        attn_mask[:, 0] = True  # every query row attends to something
    elif mask == "empty_row":
        attn_mask = d.mask(length, s)
        attn_mask[:, 0] = True
        attn_mask[0, :] = False
    elif mask == "float":
        attn_mask = d.normal(batch[0], *([1] * (len(batch) - 1)), length, s)
    args = {"q": qkv(length, e), "k": qkv(s, e, k_batch), "v": qkv(s, ev, v_batch), "attn_mask": attn_mask, "is_causal": causal, "scale": scale}
    return Call(args)


def _sdpa_backward(d: Draw, **kw: Any) -> Call:
    fwd = sdpa_args(d, **kw)
    q, k, v = fwd.args["q"], fwd.args["k"], fwd.args["v"]
    return backward_call("scaled_dot_product_attention_backward", d, fwd, attention_batch(q, k, v) + (int(q.shape[-2]), int(v.shape[-1])))


SDPA_SHAPES: Table = {
    "heads4_seq16": (dict(q=(2, 4, 16, 32), s=16), True, True),
    "transformer_head64": (dict(q=(1, 8, 64, 64), s=64), False, True),
    "cross_attention_l7_s13": (dict(q=(2, 2, 7, 16), s=13), False, True),
    "value_dim_differs": (dict(q=(2, 2, 9, 16), s=11, ev=24), False, True),
    "three_dims": (dict(q=(3, 10, 8), s=10), False, False),
    "odd_prime": (dict(q=(1, 3, 11, 7), s=13), False, False),
    "causal": (dict(q=(2, 3, 12, 16), s=12, causal=True), True, True),
    "causal_l_lt_s": (dict(q=(1, 2, 5, 16), s=9, causal=True), False, True),
    "causal_l_gt_s": (dict(q=(1, 2, 9, 16), s=5, causal=True), False, False),
    "bool_mask_broadcast": (dict(q=(2, 2, 8, 16), s=10, mask="bool"), False, True),
    "float_mask": (dict(q=(2, 2, 8, 16), s=10, mask="float"), False, True),
    "explicit_scale": (dict(q=(2, 2, 8, 16), s=8, scale=0.3), False, True),
    "heads_transposed_views": (dict(q=(2, 4, 12, 16), s=12, heads_transposed=True), False, True),
    # logits of about +-1000: exp overflows even in float64 unless the row maximum is subtracted
    "large_logits": (dict(q=(1, 2, 8, 16), s=8, magnitude=math.sqrt(250.0)), False, False),
    # batch dimensions broadcasting between q, k and v (as torch's): shared key/value heads, a
    # batch of one, k and v of fewer dimensions
    "broadcast_batch": (dict(q=(2, 3, 6, 8), s=5, k_batch=(1, 3), v_batch=(2, 1)), True, True),
    "broadcast_kv_heads": (dict(q=(2, 4, 6, 8), s=7, k_batch=(2, 1), v_batch=(2, 1), causal=True), False, True),
    "broadcast_query_batch": (dict(q=(1, 2, 5, 8), s=6, k_batch=(3, 2), v_batch=(3, 2)), False, True),
    "broadcast_ranks": (dict(q=(2, 3, 5, 8), s=7, k_batch=(3,), v_batch=(), mask="bool"), False, True),
    # zero-size dimensions: no batch, no queries, no keys (zeros: nothing to attend to), no
    # features (every score 0: uniform attention), no value features
    "empty_batch": (dict(q=(0, 2, 4, 8), s=5), True, True),
    "empty_queries": (dict(q=(1, 2, 0, 8), s=5), False, True),
    "empty_keys": (dict(q=(1, 2, 4, 8), s=0), False, True),
    "empty_keys_causal": (dict(q=(2, 4, 8), s=0, causal=True), False, True),
    "empty_features": (dict(q=(1, 2, 4, 0), s=5, ev=6), False, True),
    "empty_features_causal_mask": (dict(q=(1, 2, 4, 0), s=6, ev=3, causal=True), False, True),
    "empty_value_features": (dict(q=(1, 2, 4, 8), s=5, ev=0), False, True),
}

SDPA = from_table(SDPA_SHAPES, sdpa_args) + [
    case("empty_query_row", sdpa_args, q=(1, 2, 6, 8), s=7, mask="empty_row"),
]
SDPA_BACKWARD = from_table(SDPA_SHAPES, _sdpa_backward, backward=True)

CASES = {
    "softmax": SOFTMAX,
    "softmax_backward": SOFTMAX_BACKWARD,
    "scaled_dot_product_attention": SDPA,
    "scaled_dot_product_attention_backward": SDPA_BACKWARD,
}
