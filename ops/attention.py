"""Softmax and scaled dot-product attention."""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import torch

from hal.arrays import FLOAT_DTYPES, dtype_name
from hal.registry import Autocast, declare
from hal.types import OptionalTensor, Tensor

from . import _checks as c
from . import _empty as e
from ._fake import like
from ._tolerances import REDUCTION

#: where this family's ops stand among hal's (hal.ops: the order of API.md and docs/ops.md)
ORDER = 50


def _dim(op: str, x: Any, dim: Any) -> int:
    """dim >= 0; a 0-d x takes dim 0 or -1, as torch (it is a softmax over one value)."""
    nd = max(1, x.ndim)
    d = c.integer(op, "dim", dim, low=-nd, high=nd - 1)
    return d % nd


def _softmax_k(x: Any, dim: int) -> int:
    """The length softmax sums over (1 for a 0-d x)."""
    return int(x.shape[dim]) if x.ndim else 1


@declare(dtypes=FLOAT_DTYPES, tolerances=REDUCTION, backward="softmax_backward", gradients="x", reduction=lambda a: _softmax_k(a["x"], a["dim"]),
         autocast=Autocast("fp32", devices=("cuda",)))  # torch's CUDA list (fp32_set_opt_dtype); not on the CPU's
def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """Softmax along ``dim``, as ``F.softmax`` (kernels get dim >= 0). A 0-d x is a softmax over
    one value: 1 (NaN for NaN), with dim 0 or -1, as torch."""


@softmax.checker
def _check_softmax(x, dim):
    c.float_dtype("softmax", "x", x)
    return {"dim": _dim("softmax", x, dim)}


def _empty_softmax(a: Mapping[str, Any]) -> Any:
    return e.zeros_like(a["x"])


@declare(dtypes=FLOAT_DTYPES, tolerances=REDUCTION, forward="softmax", reduction=lambda a: _softmax_k(a["out"], a["dim"]))
def softmax_backward(grad_out: Tensor, out: Tensor, dim: int = -1) -> Tensor:
    """Gradient of softmax from its output: ``out * (grad_out - sum(grad_out * out, dim))``."""


@softmax_backward.checker
def _check_softmax_backward(grad_out, out, dim):
    op = "softmax_backward"
    c.float_dtype(op, "out", out)
    c.same_dtype(op, "grad_out", grad_out, "out", out)
    c.shape_is(op, "grad_out", grad_out, c.shape_of(out), "(the shape of out)")
    return {"dim": _dim(op, out, dim)}


def _empty_softmax_backward(a: Mapping[str, Any]) -> Any:
    return e.zeros_like(a["out"])


def _check_attention(op: str, q: Any, k: Any, v: Any, attn_mask: Any, is_causal: Any, scale: Any) -> dict[str, Any]:
    for name, t in (("q", q), ("k", k), ("v", v)):
        c.min_rank(op, name, t, 2, "(..., sequence, features)")
    c.float_dtype(op, "q", q)
    c.same_dtype(op, "k", k, "q", q)
    c.same_dtype(op, "v", v, "q", q)
    sq, sk, sv = c.shape_of(q), c.shape_of(k), c.shape_of(v)
    if sk[-1] != sq[-1]:
        raise c.fail(op, "k", f"an array of {sq[-1]} features (q's last dimension)", k)
    if sv[-2] != sk[-2]:
        raise c.fail(op, "v", f"an array of {sk[-2]} keys (k's sequence dimension)", v)
    batch = sq[:-2]
    for name, t, shape in (("k", k, sk), ("v", v, sv)):
        merged = c.broadcast_shapes(batch, shape[:-2])
        if merged is None:
            raise c.fail(op, name, f"batch dimensions broadcastable with {tuple(batch)} (those of q{', k' if name == 'v' else ''})", t)
        batch = merged
    causal = c.boolean(op, "is_causal", is_causal)
    if attn_mask is not None:
        if causal:
            raise c.fail(op, "attn_mask", "None when is_causal=True (as in torch)", attn_mask)
        if dtype_name(attn_mask) != "bool":
            c.same_dtype(op, "attn_mask", attn_mask, "q", q)
        c.broadcasts_to(op, "attn_mask", attn_mask, batch + (sq[-2], sk[-2]), "the scores (..., L, S)")
    c.result_fits(op, "k", batch + (sq[-2], sv[-1]), c.itemsize(q), "attention output")
    if scale is not None:
        s = c.number(op, "scale", scale)
    else:  # an empty dot product is 0 whatever multiplies it: 1.0 stands in for 1 / sqrt(0)
        s = 1.0 / math.sqrt(sq[-1]) if sq[-1] else 1.0
    return {"scale": s}


def attention_batch(q: Any, k: Any, v: Any) -> tuple[int, ...]:
    """The batch shape of an attention call: q's, k's and v's batch dimensions broadcast."""
    batch = c.broadcast_shapes(c.broadcast_shapes(c.shape_of(q)[:-2], c.shape_of(k)[:-2]) or (), c.shape_of(v)[:-2])
    return batch or ()


def _attention_k(a: dict) -> int:
    return max(int(a["q"].shape[-1]), int(a["k"].shape[-2]))


@declare(dtypes=FLOAT_DTYPES, tolerances=REDUCTION, backward="scaled_dot_product_attention_backward", gradients=("q", "k", "v"),
         reduction=_attention_k, autocast=Autocast("lower"))
def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: OptionalTensor = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
) -> Tensor:
    """``softmax(q @ k^T * scale + mask) @ v`` as ``F.scaled_dot_product_attention`` without dropout.

    q (..., L, E), k (..., S, E), v (..., S, Ev) whose batch dimensions broadcast (as torch's: a
    key/value head shared by several query heads, a batch of one); the result is (batch, L, Ev)
    for the broadcast batch. attn_mask boolean (True = attend) or additive float, broadcastable to
    (batch, L, S); is_causal masks with the top-left aligned lower triangle. scale None means
    1 / sqrt(E) (kernels receive a float; 1.0 for E = 0, whose scores are 0 whatever the scale). A
    query row with nothing to attend to (all masked, or S = 0) yields zeros and passes no
    gradient, as torch 2.13 does on CPU (its math path and fused CPU kernel both use a "safe"
    softmax; torch < 2.5 gave NaN there).
    """


@scaled_dot_product_attention.checker
def _check_sdpa(q, k, v, attn_mask, is_causal, scale):
    return _check_attention("scaled_dot_product_attention", q, k, v, attn_mask, is_causal, scale)


def _unit_features(t: Any) -> Any:
    """Zeros of t's shape with one feature: the queries or keys of E = 0, whose scores are all 0."""
    return e.zeros(t, c.shape_of(t)[:-1] + (1,))


def _scores_of_zero(a: Mapping[str, Any]) -> bool:
    """E = 0 with queries, keys and values: every score is 0 (the attention is not empty)."""
    q, k, v = a["q"], a["k"], a["v"]
    sizes = (int(q.shape[-2]), int(k.shape[-2]), int(v.shape[-1]), *attention_batch(q, k, v))
    return int(q.shape[-1]) == 0 and 0 not in sizes


def _empty_scaled_dot_product_attention(a: Mapping[str, Any]) -> Any:
    """Zeros when there is nothing to attend to (S = 0) or nothing to compute (no queries, values
    or batch); for E = 0 the scores are all 0: the attention of zero vectors of one feature."""
    from hal.ops import scaled_dot_product_attention

    q, k, v = a["q"], a["k"], a["v"]
    if _scores_of_zero(a):
        return scaled_dot_product_attention(_unit_features(q), _unit_features(k), v, a["attn_mask"], a["is_causal"], a["scale"])
    return e.zeros(q, attention_batch(q, k, v) + (int(q.shape[-2]), int(v.shape[-1])))


def _attention_backward_k(a: dict) -> int:
    """Terms summed into one gradient element: over E or S (grad_q), over L (grad_k, grad_v), times
    the batch entries that share a broadcast key or value head (their gradients are summed)."""
    q, k, v = a["q"], a["k"], a["v"]
    batch = math.prod(attention_batch(q, k, v))
    shared = max(batch // max(1, math.prod(c.shape_of(t)[:-2])) for t in (k, v))
    return max(int(q.shape[-1]), int(k.shape[-2]), int(q.shape[-2])) * max(1, shared)


@declare(dtypes=FLOAT_DTYPES, tolerances=REDUCTION, forward="scaled_dot_product_attention", reduction=_attention_backward_k)
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
    c.shape_is(op, "grad_out", grad_out, attention_batch(q, k, v) + (int(q.shape[-2]), int(v.shape[-1])), "(batch, L, Ev)")
    return canon


@softmax.fake
def _fake_softmax(a):
    return like(a["x"])


@softmax_backward.fake
def _fake_softmax_backward(a):
    return like(a["out"])


@scaled_dot_product_attention.fake
def _fake_sdpa(a):
    q, k, v = a["q"], a["k"], a["v"]
    batch = tuple(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    return like(q, batch + (q.shape[-2], v.shape[-1]))


@scaled_dot_product_attention_backward.fake
def _fake_sdpa_backward(a):
    return like(a["q"]), like(a["k"]), like(a["v"])


def _empty_scaled_dot_product_attention_backward(a: Mapping[str, Any]) -> tuple:
    """Zero gradients (of empty or unread inputs), except grad_v for E = 0: the attention weights
    of zero scores times grad_out."""
    from hal.ops import scaled_dot_product_attention_backward

    q, k, v = a["q"], a["k"], a["v"]
    grad_v = e.zeros_like(v)
    if _scores_of_zero(a) and not e.has_empty(a["grad_out"]):
        args = (a["grad_out"], _unit_features(q), _unit_features(k), v, a["attn_mask"], a["is_causal"], a["scale"])
        grad_v = scaled_dot_product_attention_backward(*args)[2]
    return e.zeros_like(q), e.zeros_like(k), grad_v


# zero-size inputs: each op's empty rule (the dispatcher answers such calls with it, no kernel runs)
softmax.empty(_empty_softmax)
softmax_backward.empty(_empty_softmax_backward)
scaled_dot_product_attention.empty(_empty_scaled_dot_product_attention)
scaled_dot_product_attention_backward.empty(_empty_scaled_dot_product_attention_backward)


__all__ = ["softmax", "softmax_backward", "scaled_dot_product_attention", "scaled_dot_product_attention_backward"]
