"""Cases of rotary_embedding, swiglu and their backward ops.

rotary_embedding: Llama's layout (B, H, T, D) with one (T, D/2) table, the Hugging Face layout
(q as the (B, H, T, D) view of a (B, T, H, D) tensor, cos/sin per batch row as (B, 1, T, D/2)),
interleaved pairs (GPT-J), float32 tables beside half-precision x, odd sizes, 2-D and 3-D x and an
empty sequence. Angles are real rotary angles (position times frequency), so |cos|, |sin| <= 1.
swiglu: Llama MLP widths, the halves of a packed gate-and-up projection, broadcasting, gates far
into silu's tails (-30..30) and an empty batch; swiglu_amax: swiglu's cases, and infinite and NaN
gates for its amax.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from . import Call, Draw, backward_call, case


def _tables(d: Draw, shape: tuple[int, ...], half: int, table_dtype: str) -> tuple[Any, Any]:
    """cos and sin of rotary angles for tables of ``shape`` (its last dimension is D/2)."""
    positions = d.rng.integers(0, 4096, size=shape[:-1] + (1,)).astype(np.float64)
    inv_freq = 10000.0 ** (-np.arange(half, dtype=np.float64) / half)
    theta = positions * inv_freq
    dt = None if table_dtype == "same" else ("float32" if d.float_dtype in ("float16", "bfloat16") else None)
    return d.tensor(np.cos(theta), dt), d.tensor(np.sin(theta), dt)


def rotary_args(d: Draw, x: tuple[int, ...], table: tuple[int, ...], interleaved: bool = False, hf_layout: bool = False,
                table_dtype: str = "same") -> Call:
    """x of shape ``x``; cos/sin of shape ``table`` (broadcast to x's (..., T, D/2))."""
    half = x[-1] // 2
    if hf_layout:  # drawn (B, T, H, D), used as the (B, H, T, D) view
        b, h, t, dd = x
        xt = d.normal(b, t, h, dd).transpose(1, 2)
    else:
        xt = d.normal(*x)
    cos, sin = _tables(d, table, half, table_dtype)
    return Call({"x": xt, "cos": cos, "sin": sin, "interleaved": interleaved})


def _rotary_backward(d: Draw, **kw: Any) -> Call:
    fwd = rotary_args(d, **kw)
    call = backward_call("rotary_embedding_backward", d, fwd, tuple(fwd.args["x"].shape))
    return call


ROTARY = {
    "llama_heads": (dict(x=(2, 4, 16, 64), table=(16, 32)), True),
    "interleaved_gptj": (dict(x=(2, 4, 16, 64), table=(16, 32), interleaved=True), True),
    "hf_layout_per_batch": (dict(x=(2, 4, 12, 32), table=(2, 1, 12, 16), hf_layout=True), False),
    "float32_tables": (dict(x=(2, 3, 10, 16), table=(10, 8), table_dtype="float32"), False),
    "odd_sizes_3d": (dict(x=(3, 7, 6), table=(7, 3)), False),
    "two_dims": (dict(x=(9, 10), table=(9, 5)), False),
    "head_256": (dict(x=(1, 2, 5, 256), table=(5, 128)), False),
    "empty_sequence": (dict(x=(2, 3, 0, 8), table=(0, 4)), False),
}


def swiglu_args(d: Draw, gate: tuple[int, ...], up: tuple[int, ...], spread: float = 1.0, layout: str = "contiguous") -> Call:
    """gate and up drawn apart in ``layout``, or with layout "halves" as the two halves of one tensor's
    last dimension (``h.chunk(2, -1)``: a packed gate-and-up projection, rows of twice their stride)."""
    if layout == "halves":
        g, u = d.normal(*gate[:-1], 2 * gate[-1], std=spread).chunk(2, dim=-1)
        return Call({"gate": g, "up": u})
    g = d.tensor(np.clip(spread * d.rng.standard_normal(gate), -30.0, 30.0), layout=layout)
    return Call({"gate": g, "up": d.normal(*up, layout=layout if up == gate else "contiguous")})


def _swiglu_backward(d: Draw, **kw: Any) -> Call:
    fwd = swiglu_args(d, **kw)
    shape = np.broadcast_shapes(tuple(fwd.args["gate"].shape), tuple(fwd.args["up"].shape))
    return backward_call("swiglu_backward", d, fwd, shape)


SWIGLU = {
    "llama_mlp": (dict(gate=(2, 16, 688), up=(2, 16, 688)), True),
    "odd_prime": (dict(gate=(7, 13), up=(7, 13)), False),
    "vector_1d": (dict(gate=(1001,), up=(1001,)), False),
    "tails": (dict(gate=(4, 257), up=(4, 257), spread=12.0), False),
    "noncontig": (dict(gate=(5, 40), up=(5, 40), layout="noncontig"), False),
    "packed_halves": (dict(gate=(3, 5, 48), up=(3, 5, 48), spread=3.0, layout="halves"), True),
    "broadcast_up": (dict(gate=(6, 9), up=(9,)), False),
    "broadcast_both": (dict(gate=(6, 1), up=(1, 9)), False),
    "empty_batch": (dict(gate=(0, 8), up=(0, 8)), False),
}

def _swiglu_amax(d: Draw, specials: str = "", **kw: Any) -> Call:
    """swiglu_amax: swiglu's arguments; its results are y (the case dtype) and a float32 amax.
    ``specials``: "inf" makes one gate +inf (y infinite there: amax inf), "nan" adds a NaN gate and
    a -inf gate (silu(-inf) * up is NaN: amax NaN)."""
    call = swiglu_args(d, **kw)
    g = call.args["gate"]
    if specials == "inf":
        g[0, 2] = math.inf
    elif specials == "nan":
        g[1, 1], g[2, 4] = math.nan, -math.inf
    return dataclasses.replace(call, result_dtypes=(d.float_dtype, "float32"))


SWIGLU_AMAX = {
    **{n: (kw, q) for n, (kw, q) in SWIGLU.items()},
    "inf_gate": (dict(gate=(4, 33), up=(4, 33), specials="inf"), False),
    "nan_gate": (dict(gate=(4, 33), up=(4, 33), specials="nan"), False),
}

CASES = {
    "rotary_embedding": [case(n, rotary_args, quick=q, **kw) for n, (kw, q) in ROTARY.items()],
    "rotary_embedding_backward": [case(n, _rotary_backward, quick=q, **kw) for n, (kw, q) in ROTARY.items()],
    "swiglu": [case(n, swiglu_args, quick=q, **kw) for n, (kw, q) in SWIGLU.items()],
    "swiglu_backward": [case(n, _swiglu_backward, quick=q, **kw) for n, (kw, q) in SWIGLU.items()],
    "swiglu_amax": [case(n, _swiglu_amax, quick=q, **kw) for n, (kw, q) in SWIGLU_AMAX.items()],
}
