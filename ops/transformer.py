"""Elementwise pieces of a transformer block: rotary position embeddings and the SwiGLU gate."""

from __future__ import annotations

from typing import Any

import torch

from hal.arrays import FLOAT_DTYPES, dtype_name
from hal.registry import declare
from hal.types import Tensor

from . import _checks as c
from . import _empty as e
from ._fake import like, new_array
from ._tolerances import ELEMENTWISE, REDUCTION

#: where this family's ops stand among hal's (hal.ops: the order of API.md and docs/ops.md)
ORDER = 90

# --- rotary_embedding ---------------------------------------------------------------------------


def _check_rotary(op: str, x: Any, cos: Any, sin: Any, interleaved: Any) -> None:
    c.min_rank(op, "x", x, 2, "(..., T, D)")
    c.float_dtype(op, "x", x)
    d = int(x.shape[-1])
    if d % 2:
        raise c.fail(op, "x", "an array whose last dimension D is even (D/2 rotated pairs)", x)
    half = c.shape_of(x)[:-1] + (d // 2,)
    allowed = sorted({dtype_name(x)} | ({"float32"} if dtype_name(x) in ("float16", "bfloat16") else set()))
    for name, v in (("cos", cos), ("sin", sin)):
        c.dtype_in(op, name, v, allowed, f"the dtype of 'x', or float32 beside half precision")
        c.broadcasts_to(op, name, v, half, "x with its last dimension halved")
        if isinstance(v, torch.Tensor) and v.requires_grad and torch.is_grad_enabled():
            raise c.fail(op, name, "a tensor that does not require grad (rotary_embedding gives cos and sin no gradient); pass it .detach()ed", v)
    c.boolean(op, "interleaved", interleaved)


@declare(dtypes=FLOAT_DTYPES, tolerances=ELEMENTWISE, backward="rotary_embedding_backward", gradients="x")
def rotary_embedding(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """Rotary position embedding over the last dimension D (even) of x ``(..., T, D)``.

    cos and sin broadcast to ``(..., T, D/2)`` (x's dtype, or float32 beside half-precision x).
    Non-interleaved (Llama, GPT-NeoX) rotates the halves ``x1 = x[..., :D/2]``, ``x2 = x[..., D/2:]``
    into ``cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)``; interleaved (GPT-J) rotates the pairs
    ``(x[..., 2i], x[..., 2i+1])`` the same way. Computed in float32 (float64 for float64 x) and
    rounded once into x's dtype. cos and sin get no gradient.
    """


@rotary_embedding.checker
def _check_rotary_embedding(x, cos, sin, interleaved):
    _check_rotary("rotary_embedding", x, cos, sin, interleaved)


@rotary_embedding.fake
def _fake_rotary(a):
    return like(a["x"])


@rotary_embedding.empty
def _empty_rotary(a):
    return new_array(a["x"], c.shape_of(a["x"]))


@declare(dtypes=FLOAT_DTYPES, tolerances=ELEMENTWISE, forward="rotary_embedding", dtype_from="grad_out")
def rotary_embedding_backward(grad_out: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """Gradient of rotary_embedding with respect to x: grad_out rotated back (by -theta)."""


@rotary_embedding_backward.checker
def _check_rotary_embedding_backward(grad_out, cos, sin, interleaved):
    _check_rotary("rotary_embedding_backward", grad_out, cos, sin, interleaved)


@rotary_embedding_backward.fake
def _fake_rotary_backward(a):
    return like(a["grad_out"])


@rotary_embedding_backward.empty
def _empty_rotary_backward(a):
    return new_array(a["grad_out"], c.shape_of(a["grad_out"]))


# --- swiglu -------------------------------------------------------------------------------------


def broadcast_shape(op: str, a: Any, b: Any, a_name: str, b_name: str) -> tuple[int, ...]:
    """The broadcast shape of two arrays (torch's rules), or an error naming both."""
    sa, sb = c.shape_of(a), c.shape_of(b)
    out = []
    for i in range(max(len(sa), len(sb))):
        x = sa[len(sa) - 1 - i] if i < len(sa) else 1
        y = sb[len(sb) - 1 - i] if i < len(sb) else 1
        if x != y and 1 not in (x, y):
            raise c.fail(op, b_name, f"broadcastable with '{a_name}' {sa}", b)
        out.append(y if x == 1 else x)
    return tuple(reversed(out))


def _check_swiglu(op: str, gate: Any, up: Any) -> tuple[int, ...]:
    c.float_dtype(op, "gate", gate)
    c.same_dtype(op, "up", up, "gate", gate)
    return broadcast_shape(op, gate, up, "gate", "up")


@declare(dtypes=FLOAT_DTYPES, tolerances=ELEMENTWISE, backward="swiglu_backward", gradients=("gate", "up"),
         halves=("gate", "up"))
def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """The SwiGLU gate of a Llama MLP, ``F.silu(gate) * up`` (broadcasting as torch does), computed
    in float32 (float64 for float64) and rounded once."""


@swiglu.checker
def _check_swiglu_entry(gate, up):
    _check_swiglu("swiglu", gate, up)


@swiglu.fake
def _fake_swiglu(a):
    return like(a["gate"], torch.broadcast_shapes(a["gate"].shape, a["up"].shape))


@swiglu.empty
def _empty_swiglu(a):
    return new_array(a["gate"], broadcast_shape("swiglu", a["gate"], a["up"], "gate", "up"))


def _broadcast_factor(a) -> int:
    """Elements of grad_out summed into one element of grad_gate or grad_up (the larger of the two)."""
    out = c.numel(a["grad_out"])
    return max(1, out // max(1, min(c.numel(a["gate"]), c.numel(a["up"]))))


# grad_gate and grad_up sum over broadcast dimensions: reduction tolerances, widened by that sum's length.
@declare(dtypes=FLOAT_DTYPES, tolerances=REDUCTION, forward="swiglu", reduction=_broadcast_factor)
def swiglu_backward(grad_out: Tensor, gate: Tensor, up: Tensor) -> tuple:
    """Gradients of swiglu: ``(grad_gate, grad_up)``, each summed back to its input's shape where
    it was broadcast."""


@swiglu_backward.checker
def _check_swiglu_backward(grad_out, gate, up):
    op = "swiglu_backward"
    shape = _check_swiglu(op, gate, up)
    c.same_dtype(op, "grad_out", grad_out, "gate", gate)
    c.shape_is(op, "grad_out", grad_out, shape, "(the broadcast shape of gate and up)")


@swiglu_backward.fake
def _fake_swiglu_backward(a):
    return like(a["gate"]), like(a["up"])


@swiglu_backward.empty
def _empty_swiglu_backward(a):
    """Gradients summed over no element: zeros of each input's shape."""
    gate, up = a["gate"], a["up"]
    return new_array(gate, c.shape_of(gate), 0.0), new_array(up, c.shape_of(up), 0.0)


# swiglu with the amax of its result: the input of a Llama MLP's down projection, cast to FP8 with one
# current scale per tensor, needs max |y| first; reduced as y is written, that pass is saved.
# Gradients are swiglu's, by the same backward op (the amax has none).
@declare(dtypes=FLOAT_DTYPES, tolerances=ELEMENTWISE, backward="swiglu_backward", gradients=("gate", "up"),
         halves=("gate", "up"), nondifferentiable_results=1)
def swiglu_amax(gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """swiglu that also returns the amax of its result, ``(y, amax)``: y is ``swiglu(gate, up)``,
    amax ``max |float32(y)|`` over all of y, of the values as written in y's dtype (a 0-d float32;
    NaN propagates, as ``torch.amax``; 0 for an empty y), reduced while y is written: what an FP8
    cast of y with one current scale per tensor needs first (``hal.fp8``). Gradients are swiglu's
    (swiglu_backward); the amax has none."""


@swiglu_amax.checker
def _check_swiglu_amax(gate, up):
    _check_swiglu("swiglu_amax", gate, up)


@swiglu_amax.fake
def _fake_swiglu_amax(a):
    return like(a["gate"], torch.broadcast_shapes(a["gate"].shape, a["up"].shape)), like(a["gate"], (), torch.float32)


@swiglu_amax.empty
def _empty_swiglu_amax(a):
    """swiglu's empty result, and amax 0 (the max of nothing)."""
    gate = a["gate"]
    return new_array(gate, broadcast_shape("swiglu_amax", gate, a["up"], "gate", "up")), e.zeros(gate, (), "float32")


__all__ = ["rotary_embedding", "rotary_embedding_backward", "swiglu", "swiglu_backward", "swiglu_amax"]
