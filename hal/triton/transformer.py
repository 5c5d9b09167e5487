"""Rotary position embeddings and the SwiGLU gate, forward and backward.

rotary: x is seen as (A, B, T, D) with arbitrary strides (a Hugging Face query is the (B, H, T, D)
view of a (B, T, H, D) tensor: no copy), cos and sin as (A, B, T, D/2) views with the strides of
their broadcast (0 along the dimensions they do not have). Each program rotates BLOCK_R rows of
D/2 pairs; the backward is the same kernel with the sine negated (a rotation's adjoint). The result
has x's memory layout.

swiglu: gate and up of one shape and one dense layout, walked as flat memory; the result keeps
that layout. Broadcasting inputs are left to the vendor plugins' torch kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import LaunchPlan, Plans, cdiv, compute_dtype, next_pow2
from .layouts import four_dims, rotary_geometry, storage_view


@triton.jit(do_not_specialize=["R", "T", "B", "sxa", "sxb", "sxt", "sya", "syb", "syt", "sca", "scb", "sct", "ssa", "ssb", "sst"])
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


# n stays specialised: knowing 16 divides it lets Triton prove the mask constant over vectors and
# issue 16-byte loads (without it every access is scalar); at most three variants compile
@triton.jit
def swiglu_kernel(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr, COMPUTE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
    silu, _ = _silu_parts(g)
    tl.store(y_ptr + offs, (silu * u).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_bwd_kernel(go_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr, COMPUTE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    go = tl.load(go_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
    silu, dsilu = _silu_parts(g)
    tl.store(dg_ptr + offs, (go * u * dsilu).to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs, (go * silu).to(du_ptr.dtype.element_ty), mask=mask)


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, block_elems: int, num_warps: int) -> torch.Tensor:
    y = torch.empty_like(gate)
    n = gate.numel()
    plan = _PLANS.get_or_build((2, n, gate.dtype, block_elems, num_warps), lambda: LaunchPlan(
        swiglu_kernel, (cdiv(n, block_elems),), (n,), num_warps=num_warps, BLOCK=block_elems, COMPUTE=compute_dtype(gate.dtype)))
    plan(storage_view(gate), storage_view(up), storage_view(y))
    return y


def swiglu_backward(grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, *, block_elems: int, num_warps: int) -> tuple[torch.Tensor, torch.Tensor]:
    dg, du = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    plan = _PLANS.get_or_build((3, n, gate.dtype, block_elems, num_warps), lambda: LaunchPlan(
        swiglu_bwd_kernel, (cdiv(n, block_elems),), (n,), num_warps=num_warps, BLOCK=block_elems, COMPUTE=compute_dtype(gate.dtype)))
    plan(storage_view(grad_out), storage_view(gate), storage_view(up), storage_view(dg), storage_view(du))
    return dg, du
