"""Rotary position embeddings and the SwiGLU gate, forward and backward.

rotary: x is seen as (A, B, T, D) with arbitrary strides (a Hugging Face query is the (B, H, T, D)
view of a (B, T, H, D) tensor: no copy), cos and sin as (A, B, T, D/2) views with the strides of
their broadcast (0 along the dimensions they do not have). Each program rotates BLOCK_R rows of
D/2 pairs; the backward is the same kernel with the sine negated (a rotation's adjoint). The result
has x's memory layout.

swiglu: gate and up of one shape, either dense in one layout (walked as flat memory; the result
keeps that layout) or rows of their last dimension, each with its own row stride: the two halves of
a packed gate-and-up projection are read where they lie, and their gradients written as the two
halves of one new tensor. Broadcasting inputs are left to the vendor plugins' torch kernels. The
forward optionally reduces the amax of what it writes (swiglu_amax, for the FP8 cast of y).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from hal.arrays import dense_alike, halves_of

from ._launch import LaunchPlan, Plans, cdiv, compute_dtype, next_pow2
from .norm import amax_bits
from .layouts import four_dims, rotary_geometry, storage_view, swiglu_geometry


# The strides stay specialised: knowing 16 divides a row's stride lets Triton prove each row's start
# aligned and issue 16-byte accesses (unspecialised, every access is scalar); the sizes R, T and B
# are not (they only index rows)
@triton.jit(do_not_specialize=["R", "T", "B"])
def rotary_kernel(
    x_ptr, c_ptr, s_ptr, y_ptr, R, T, B, HALF,
    sxa, sxb, sxt, sxd, sya, syb, syt, syd, sca, scb, sct, scd, ssa, ssb, sst, ssd,
    INTERLEAVED: tl.constexpr, NEGATE_SIN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, COMPUTE: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    t = rows % T
    ab = rows // T
    b = ab % B
    a = ab // B
    rmask = rows < R
    xrow = a.to(tl.int64) * sxa + b.to(tl.int64) * sxb + t.to(tl.int64) * sxt
    yrow = a.to(tl.int64) * sya + b.to(tl.int64) * syb + t.to(tl.int64) * syt
    crow = a.to(tl.int64) * sca + b.to(tl.int64) * scb + t.to(tl.int64) * sct
    srow = a.to(tl.int64) * ssa + b.to(tl.int64) * ssb + t.to(tl.int64) * sst
    for h0 in range(0, HALF, BLOCK_H):
        i = h0 + tl.arange(0, BLOCK_H)
        mask = rmask[:, None] & (i < HALF)[None, :]
        if INTERLEAVED:
            d1 = 2 * i
            d2 = 2 * i + 1
        else:
            d1 = i
            d2 = i + HALF
        x1 = tl.load(x_ptr + xrow[:, None] + (d1 * sxd)[None, :], mask=mask, other=0.0).to(COMPUTE)
        x2 = tl.load(x_ptr + xrow[:, None] + (d2 * sxd)[None, :], mask=mask, other=0.0).to(COMPUTE)
        c = tl.load(c_ptr + crow[:, None] + (i * scd)[None, :], mask=mask, other=0.0).to(COMPUTE)
        s = tl.load(s_ptr + srow[:, None] + (i * ssd)[None, :], mask=mask, other=0.0).to(COMPUTE)
        if NEGATE_SIN:
            s = -s
        out_ty = y_ptr.dtype.element_ty
        tl.store(y_ptr + yrow[:, None] + (d1 * syd)[None, :], (x1 * c - x2 * s).to(out_ty), mask=mask)
        tl.store(y_ptr + yrow[:, None] + (d2 * syd)[None, :], (x2 * c + x1 * s).to(out_ty), mask=mask)


#: launch plans by call geometry (a model rotates the same shapes in every layer)
_PLANS = Plans()


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, negate_sin: bool, *, block_r: int, num_warps: int) -> torch.Tensor:
    """Rotate x's pairs by (cos, sin) (by (cos, -sin) for the backward); the result in x's layout."""
    y = torch.empty_like(x)

    def build() -> LaunchPlan:
        geo = rotary_geometry(x, cos, sin)
        assert geo is not None, "rotary_geometry(x, cos, sin) must be checked first"
        (xs, xst), (_, cst), (_, sst) = geo
        yfour = four_dims(tuple(y.shape), tuple(y.stride()))
        assert yfour is not None
        _, yst = yfour
        a, b, t, d = xs
        half = d // 2
        rows = a * b * t
        return LaunchPlan(rotary_kernel, (cdiv(rows, block_r),), (rows, t, b, half, *xst, *yst, *cst, *sst),
                          num_warps=num_warps, INTERLEAVED=interleaved, NEGATE_SIN=negate_sin, BLOCK_R=block_r,
                          BLOCK_H=min(next_pow2(half), 128), COMPUTE=compute_dtype(x.dtype))

    key = (x.shape, x.stride(), y.stride(), cos.shape, cos.stride(), sin.shape, sin.stride(), x.dtype, interleaved, negate_sin, block_r, num_warps)
    _PLANS.get_or_build(key, build)(x, cos, sin, y)
    return y


@triton.jit
def _silu_parts(g):
    """(silu(g), d silu / dg) with s = sigmoid(g): g s and s (1 + g (1 - s))."""
    s = 1.0 / (1.0 + tl.exp(-g))
    return g * s, s * (1.0 + g * (1.0 - s))


# The SwiGLU kernels walk tiles of rows: each tensor is (R, C) rows of its last dimension with its own
# row stride (R = 1 for a dense tensor walked as one flat run, channels_last included), so the two
# halves of a packed gate-and-up projection (``h.chunk(2, -1)``) are read in place. C and the row
# strides stay specialised: knowing 16 divides them lets Triton prove the mask constant over vectors
# and issue 16-byte loads (without it every access is scalar).
@triton.jit
def _row_tile(R, C, col_blocks, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    rows = (pid // col_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = (pid % col_blocks).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    return rows.to(tl.int64)[:, None], cols[None, :], mask


@triton.jit
def swiglu_kernel(g_ptr, u_ptr, y_ptr, amax_ptr, R, C, sg, su, sy, col_blocks, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                  COMPUTE: tl.constexpr, AMAX: tl.constexpr):
    """AMAX (swiglu_amax): the tile's largest |y| (as written) maxed into the int32 word at amax_ptr
    (:func:`hal_triton.norm.amax_bits`), so the FP8 cast of y finds its amax without a pass."""
    r, c, mask = _row_tile(R, C, col_blocks, BLOCK_R, BLOCK_C)
    g = tl.load(g_ptr + r * sg + c, mask=mask, other=0.0).to(COMPUTE)
    u = tl.load(u_ptr + r * su + c, mask=mask, other=0.0).to(COMPUTE)
    silu, _ = _silu_parts(g)
    out = (silu * u).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + r * sy + c, out, mask=mask)
    if AMAX:
        tl.atomic_max(amax_ptr, amax_bits(out, mask))


@triton.jit
def swiglu_bwd_kernel(go_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, R, C, so, sg, su, sdg, sdu, col_blocks, BLOCK_R: tl.constexpr,
                      BLOCK_C: tl.constexpr, COMPUTE: tl.constexpr):
    r, c, mask = _row_tile(R, C, col_blocks, BLOCK_R, BLOCK_C)
    go = tl.load(go_ptr + r * so + c, mask=mask, other=0.0).to(COMPUTE)
    g = tl.load(g_ptr + r * sg + c, mask=mask, other=0.0).to(COMPUTE)
    u = tl.load(u_ptr + r * su + c, mask=mask, other=0.0).to(COMPUTE)
    silu, dsilu = _silu_parts(g)
    tl.store(dg_ptr + r * sdg + c, (go * u * dsilu).to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + r * sdu + c, (go * silu).to(du_ptr.dtype.element_ty), mask=mask)


def _row_plan(kernel: Any, r: int, c: int, strides: tuple[int, ...], dtype: torch.dtype, block_elems: int,
              num_warps: int, **flags: Any) -> LaunchPlan:
    """The launch over (r, c) in tiles of about ``block_elems``: the tile's columns a power of two
    that divides c where one of at least 512 does (no masked tail in every row of a packed MoE
    projection), its rows filling the rest."""
    block_c = min(block_elems, next_pow2(c))
    while block_c > 512 and c % block_c:
        block_c //= 2
    block_r = min(next_pow2(r), max(1, block_elems // block_c))
    col_blocks = cdiv(c, block_c)
    return LaunchPlan(kernel, (cdiv(r, block_r) * col_blocks,), (r, c, *strides, col_blocks), num_warps=num_warps,
                      BLOCK_R=block_r, BLOCK_C=block_c, COMPUTE=compute_dtype(dtype), **flags)


def _output(t: torch.Tensor) -> torch.Tensor:
    """A result for input ``t``: dense inputs keep their layout, rows get a contiguous tensor."""
    return torch.empty_like(t) if dense_alike(t) else torch.empty(t.shape, dtype=t.dtype, device=t.device)


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, block_elems: int, num_warps: int, amax: bool = False) -> Any:
    """``silu(gate) * up``; ``amax``: ``(y, amax)``, amax ``max |float32(y)|`` (0-d float32) reduced
    by the same kernel as it writes y."""
    y = _output(gate)
    geo = swiglu_geometry(gate, up, y)
    assert geo is not None, "swiglu_geometry(gate, up) must be checked first"
    (g, r, c, sg), (u, _, _, su), (yv, _, _, sy) = geo
    word = torch.zeros(1, dtype=torch.int32, device=gate.device) if amax else yv  # (unread without AMAX)
    key = (2, r, c, sg, su, sy, gate.dtype, block_elems, num_warps, amax)
    _PLANS.get_or_build(key, lambda: _row_plan(swiglu_kernel, r, c, (sg, su, sy), gate.dtype, block_elems, num_warps,
                                               AMAX=amax))(g, u, yv, word)
    return (y, word.view(torch.float32).reshape(())) if amax else y


def swiglu_backward(grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, *, block_elems: int,
                    num_warps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_gate, grad_up); for the two halves of one tensor (:func:`hal.arrays.halves_of`) they
    are the two halves of one new tensor of its shape, which hal's autograd node passes on whole."""
    packed = halves_of(gate, up)
    if packed is not None:
        dg, du = torch.empty(packed.shape, dtype=packed.dtype, device=packed.device).chunk(2, dim=-1)
    else:
        dg, du = _output(gate), _output(up)
    geo = swiglu_geometry(grad_out, gate, up, dg, du)
    assert geo is not None, "swiglu_geometry(grad_out, gate, up) must be checked first"
    (go, r, c, so), (g, _, _, sg), (u, _, _, su), (dgv, _, _, sdg), (duv, _, _, sdu) = geo
    key = (3, r, c, so, sg, su, sdg, sdu, gate.dtype, block_elems, num_warps)
    _PLANS.get_or_build(key, lambda: _row_plan(swiglu_bwd_kernel, r, c, (so, sg, su, sdg, sdu), gate.dtype, block_elems,
                                               num_warps))(go, g, u, dgv, duv)
    return dg, du
