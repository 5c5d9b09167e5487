"""Softmax and scaled dot-product attention."""

from __future__ import annotations

import math
from typing import Any, Optional

from hal.arrays import FLOAT_DTYPES, dtype_name
from hal.registry import declare
from hal.types import OptionalTensor, Tensor

from . import _checks as c
from ._fake import like
from ._tolerances import REDUCTION


def _dim(op: str, x: Any, dim: Any) -> int:
    nd = x.ndim
    d = c.integer(op, "dim", dim, low=-nd, high=nd - 1)
    return d % nd


@declare(dtypes=FLOAT_DTYPES, tolerances=REDUCTION, backward="softmax_backward", gradients="x", reduction=lambda a: int(a["x"].shape[a["dim"]]))
def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """Softmax along ``dim``, as ``F.softmax`` (x of at least one dimension; kernels get dim >= 0)."""


@softmax.checker
def _check_softmax(x, dim):
    c.min_rank("softmax", "x", x, 1)
    c.non_empty("softmax", "x", x)
    c.float_dtype("softmax", "x", x)
    return {"dim": _dim("softmax", x, dim)}


@declare(dtypes=FLOAT_DTYPES, tolerances=REDUCTION, forward="softmax", reduction=lambda a: int(a["out"].shape[a["dim"]]))
def softmax_backward(grad_out: Tensor, out: Tensor, dim: int = -1) -> Tensor:
    """Gradient of softmax from its output: ``out * (grad_out - sum(grad_out * out, dim))``."""


@softmax_backward.checker
def _check_softmax_backward(grad_out, out, dim):
    op = "softmax_backward"
    c.min_rank(op, "out", out, 1)
    c.non_empty(op, "out", out)
    c.float_dtype(op, "out", out)
    c.same_dtype(op, "grad_out", grad_out, "out", out)
    c.shape_is(op, "grad_out", grad_out, c.shape_of(out), "(the shape of out)")
    return {"dim": _dim(op, out, dim)}


def _check_attention(op: str, q: Any, k: Any, v: Any, attn_mask: Any, is_causal: Any, scale: Any) -> dict[str, Any]:
    for name, t in (("q", q), ("k", k), ("v", v)):
        c.min_rank(op, name, t, 2, "(..., sequence, features)")
        c.non_empty(op, name, t)
    c.float_dtype(op, "q", q)
    c.same_dtype(op, "k", k, "q", q)
    c.same_dtype(op, "v", v, "q", q)
    sq, sk, sv = c.shape_of(q), c.shape_of(k), c.shape_of(v)
    if len(sk) != len(sq) or sk[:-2] != sq[:-2] or sk[-1] != sq[-1]:
        raise c.fail(op, "k", f"of shape {sq[:-2] + ('S', sq[-1])} (q's batch dimensions and features)", k)
    if len(sv) != len(sq) or sv[:-2] != sq[:-2] or sv[-2] != sk[-2]:
        raise c.fail(op, "v", f"of shape {sq[:-2] + (sk[-2], 'Ev')} (k's batch and sequence dimensions)", v)
    causal = c.boolean(op, "is_causal", is_causal)
    if attn_mask is not None:
        if causal:
            raise c.fail(op, "attn_mask", "None when is_causal=True (as in torch)", attn_mask)
        if dtype_name(attn_mask) != "bool":
            c.same_dtype(op, "attn_mask", attn_mask, "q", q)
        c.broadcasts_to(op, "attn_mask", attn_mask, sq[:-1] + (sk[-2],), "the scores (..., L, S)")
    s = 1.0 / math.sqrt(sq[-1]) if scale is None else c.number(op, "scale", scale)
    return {"scale": s}


def _attention_k(a: dict) -> int:
    return max(int(a["q"].shape[-1]), int(a["k"].shape[-2]))


@declare(dtypes=FLOAT_DTYPES, tolerances=REDUCTION, backward="scaled_dot_product_attention_backward", gradients=("q", "k", "v"),
         reduction=_attention_k)
def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: OptionalTensor = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
) -> Tensor:
    """``softmax(q @ k^T * scale + mask) @ v`` as ``F.scaled_dot_product_attention`` without dropout.

    q (..., L, E), k (..., S, E), v (..., S, Ev) with equal batch dimensions; attn_mask boolean
    (True = attend) or additive float, broadcastable to (..., L, S); is_causal masks with the
    top-left aligned lower triangle. scale None means 1 / sqrt(E) (kernels receive a float). A
    query row with nothing to attend to (all masked) yields zeros and passes no gradient, as torch
    2.13 does on CPU (its math path and fused CPU kernel both use a "safe" softmax; torch < 2.5 gave
    NaN there).
    """


@scaled_dot_product_attention.checker
def _check_sdpa(q, k, v, attn_mask, is_causal, scale):
    return _check_attention("scaled_dot_product_attention", q, k, v, attn_mask, is_causal, scale)


@declare(dtypes=FLOAT_DTYPES, tolerances=REDUCTION, forward="scaled_dot_product_attention", reduction=_attention_k)
def scaled_dot_product_attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: OptionalTensor = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
) -> tuple:
    """Gradients of scaled_dot_product_attention: (grad_q, grad_k, grad_v); the attention weights
    are recomputed. The mask gets no gradient."""


@scaled_dot_product_attention_backward.checker
def _check_sdpa_backward(grad_out, q, k, v, attn_mask, is_causal, scale):
    op = "scaled_dot_product_attention_backward"
    canon = _check_attention(op, q, k, v, attn_mask, is_causal, scale)
    c.same_dtype(op, "grad_out", grad_out, "q", q)
    c.shape_is(op, "grad_out", grad_out, c.shape_of(q)[:-1] + (int(v.shape[-1]),), "(..., L, Ev)")
    return canon


@softmax.fake
def _fake_softmax(a):
    return like(a["x"])


@softmax_backward.fake
def _fake_softmax_backward(a):
    return like(a["out"])


@scaled_dot_product_attention.fake
def _fake_sdpa(a):
    return like(a["q"], tuple(a["q"].shape[:-1]) + (a["v"].shape[-1],))


@scaled_dot_product_attention_backward.fake
def _fake_sdpa_backward(a):
    return like(a["q"]), like(a["k"]), like(a["v"])


__all__ = ["softmax", "softmax_backward", "scaled_dot_product_attention", "scaled_dot_product_attention_backward"]
