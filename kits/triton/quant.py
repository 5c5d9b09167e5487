"""Quantisation kernels: quantize, dequantize, fake_quantize (+ backward), and the int32 -> float
dequantising epilogue of int8 GEMMs done by a vendor library.

Arithmetic is float32, as ONNX and torch specify it. Rounding is half to even through the
float32 magic constant 1.5 * 2^23 (adding and subtracting it leaves the nearest even integer), which
needs no libdevice function and runs identically on every vendor and in the interpreter; values are
clamped to +-2^22 first (any such value saturates anyway), and the clamp also keeps the compiler
from contracting the preceding multiply into the add. Launches disable FMA contraction besides.

Parameters read from device tensors are checked where they are loaded, since the host cannot read
them without a synchronisation: an element whose scale is not positive and finite, or whose zero
point is not an integer in the quantised range, gets NaN (float results), so a bad parameter never
passes as plausible numbers; quantize's integer result cannot carry NaN (see ops/quant.py).
quantize maps a NaN input to the top of the quantised range, as ``torch.quantize_per_tensor`` does;
fake_quantize maps a NaN input to quant_min, as torch's CPU kernels clamp with fmin/fmax.

x is contiguous and seen as a (R, C) matrix: for per-channel parameters along ``axis`` either the
channel is the column (axis is the last dimension) or the row modulo the channel count (rows are
(outer, channel) pairs); per-tensor parameters are a number or a one-element tensor.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl

from ._launch import cdiv, launch, next_pow2

Scalar = Union[float, torch.Tensor]

#: how a scale or zero point reaches a kernel
VALUE, ONE, PER_CHANNEL = 0, 1, 2


@triton.jit
def _rne(v):
    v = tl.minimum(tl.maximum(v, -4194304.0), 4194304.0)
    return (v + 12582912.0) - 12582912.0


@triton.jit
def _tile(pid, R, C, n_col_blocks, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = (pid // n_col_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = (pid % n_col_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    return rows, cols, mask, rows.to(tl.int64)[:, None] * C + cols[None, :]


@triton.jit
def _param(ptr, val, rows, cols, mask, channels, MODE: tl.constexpr, PER_ROW: tl.constexpr):
    """A scale or zero point as float32, broadcast to the tile."""
    if MODE == 2:
        if PER_ROW:
            p = tl.load(ptr + (rows % channels)[:, None] + cols[None, :] * 0, mask=mask, other=1.0)
        else:
            p = tl.load(ptr + rows[:, None] * 0 + cols[None, :], mask=mask, other=1.0)
        p = p.to(tl.float32)
    elif MODE == 1:
        p = tl.load(ptr).to(tl.float32)
    else:
        p = val
    return p


@triton.jit
def _valid(s, z, qmin, qmax):
    """Where a scale and zero point are usable: s positive and finite, z an integer in [qmin, qmax]
    (nested where rather than ``&``: either operand may be a scalar, which the interpreter's ``&``
    cannot mix with a tensor)."""
    ok = tl.where(s > 0.0, s < float("inf"), False)
    ok = tl.where(z >= qmin, ok, False)
    ok = tl.where(z <= qmax, ok, False)
    return tl.where(tl.floor(z) == z, ok, False)


@triton.jit
def _fake_codes(x, s, z, qmin, qmax):
    """round(x * (1 / s)) + z clamped to [qmin, qmax], NaN codes (NaN x) to qmin, as torch's fmax."""
    q = _rne(x * (1.0 / s)) + z
    return tl.minimum(tl.maximum(tl.where(q == q, q, qmin), qmin), qmax)


@triton.jit(do_not_specialize=["R", "n_col_blocks", "channels", "qmin", "qmax"])
def quantize_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, s_val, z_val, R, C, n_col_blocks, channels, qmin, qmax,
    S_MODE: tl.constexpr, Z_MODE: tl.constexpr, PER_ROW: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows, cols, mask, offs = _tile(tl.program_id(0), R, C, n_col_blocks, BLOCK_R, BLOCK_C)
    s = _param(s_ptr, s_val, rows, cols, mask, channels, S_MODE, PER_ROW)
    z = _param(z_ptr, z_val, rows, cols, mask, channels, Z_MODE, PER_ROW)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    q = tl.minimum(tl.maximum(_rne(x / s) + z, qmin), qmax)
    q = tl.where(x == x, q, qmax)  # NaN x: the top code, as torch.quantize_per_tensor (ops/quant.py)
    tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["R", "n_col_blocks", "channels"])
def dequantize_kernel(
    q_ptr, out_ptr, s_ptr, z_ptr, s_val, z_val, R, C, n_col_blocks, channels,
    S_MODE: tl.constexpr, Z_MODE: tl.constexpr, PER_ROW: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows, cols, mask, offs = _tile(tl.program_id(0), R, C, n_col_blocks, BLOCK_R, BLOCK_C)
    s = _param(s_ptr, s_val, rows, cols, mask, channels, S_MODE, PER_ROW)
    z = _param(z_ptr, z_val, rows, cols, mask, channels, Z_MODE, PER_ROW)
    q = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.float32)
    if q_ptr.dtype.element_ty.is_int_signed():  # the range of q's dtype: int8 or uint8
        ok = _valid(s, z, -128.0, 127.0)
    else:
        ok = _valid(s, z, 0.0, 255.0)
    out = tl.where(ok, (q - z) * s, float("nan"))
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["R", "n_col_blocks", "channels", "qmin", "qmax"])
def fake_quantize_kernel(
    x_ptr, out_ptr, s_ptr, z_ptr, s_val, z_val, R, C, n_col_blocks, channels, qmin, qmax,
    S_MODE: tl.constexpr, Z_MODE: tl.constexpr, PER_ROW: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows, cols, mask, offs = _tile(tl.program_id(0), R, C, n_col_blocks, BLOCK_R, BLOCK_C)
    s = _param(s_ptr, s_val, rows, cols, mask, channels, S_MODE, PER_ROW)
    z = _param(z_ptr, z_val, rows, cols, mask, channels, Z_MODE, PER_ROW)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = tl.where(_valid(s, z, qmin, qmax), (_fake_codes(x, s, z, qmin, qmax) - z) * s, float("nan"))
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["R", "n_col_blocks", "channels", "qmin", "qmax"])
def fake_quantize_bwd_kernel(
    g_ptr, x_ptr, dx_ptr, s_ptr, z_ptr, s_val, z_val, R, C, n_col_blocks, channels, qmin, qmax,
    S_MODE: tl.constexpr, Z_MODE: tl.constexpr, PER_ROW: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows, cols, mask, offs = _tile(tl.program_id(0), R, C, n_col_blocks, BLOCK_R, BLOCK_C)
    s = _param(s_ptr, s_val, rows, cols, mask, channels, S_MODE, PER_ROW)
    z = _param(z_ptr, z_val, rows, cols, mask, channels, Z_MODE, PER_ROW)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    q = _rne(x * (1.0 / s)) + z
    dx = tl.where(_valid(s, z, qmin, qmax), tl.where((q >= qmin) & (q <= qmax), g, 0.0), float("nan"))
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["R", "n_col_blocks"])
def int32_dequant_kernel(
    acc_ptr, out_ptr, xs_ptr, ws_ptr, bias_ptr, xs_val, ws_val, R, C, n_col_blocks,
    XS_MODE: tl.constexpr, WS_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """out = acc * x_scale * w_scale[col] + bias[col] for an int32 GEMM result."""
    rows, cols, mask, offs = _tile(tl.program_id(0), R, C, n_col_blocks, BLOCK_R, BLOCK_C)
    v = tl.load(acc_ptr + offs, mask=mask, other=0).to(tl.float32)
    xs = _param(xs_ptr, xs_val, rows, cols, mask, C, XS_MODE, False)
    ws = _param(ws_ptr, ws_val, rows, cols, mask, C, WS_MODE, False)
    v = tl.where(_valid(xs, 0.0, 0.0, 0.0), v * xs, float("nan"))
    v = tl.where(_valid(ws, 0.0, 0.0, 0.0), v * ws, float("nan"))
    if HAS_BIAS:
        v = v + tl.load(bias_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=mask)


# --- host side ----------------------------------------------------------------------------------


class _Plan:
    """(R, C, channels, per_row) of a contiguous x for per-tensor or per-channel parameters."""

    def __init__(self, x: torch.Tensor, axis: Optional[int]) -> None:
        n = x.numel()
        if axis is None:
            self.rows, self.cols, self.channels, self.per_row = 1, n, 1, False
            return
        ch = int(x.shape[axis])
        inner = 1
        for size in x.shape[axis + 1 :]:
            inner *= int(size)
        if inner == 1:
            self.rows, self.cols, self.channels, self.per_row = n // ch, ch, ch, False
        else:
            self.rows, self.cols, self.channels, self.per_row = n // inner, inner, ch, True


def _mode(v: Scalar, default_ptr: torch.Tensor) -> tuple[torch.Tensor, float, int]:
    if isinstance(v, torch.Tensor):
        return v.reshape(-1), 0.0, (PER_CHANNEL if v.numel() > 1 else ONE)
    return default_ptr, float(v), VALUE


def _grid(plan: _Plan, block_elems: int) -> tuple[tuple[int], int, int, int]:
    block_c = min(next_pow2(plan.cols), block_elems)
    block_r = max(1, block_elems // block_c)
    ncb = cdiv(plan.cols, block_c)
    return (cdiv(plan.rows, block_r) * ncb,), ncb, block_r, block_c


def _run(kernel, inputs: tuple, x: torch.Tensor, scale: Scalar, zero_point: Scalar, axis: Optional[int], extra: tuple,
         block_elems: int, num_warps: int) -> None:
    plan = _Plan(x, axis)
    sp, sv, sm = _mode(scale, x)
    zp, zv, zm = _mode(zero_point, x)
    grid, ncb, block_r, block_c = _grid(plan, block_elems)
    launch(kernel, grid, *inputs, sp, zp, sv, zv, plan.rows, plan.cols, ncb, plan.channels, *extra,
           num_warps=num_warps, fp_fusion=False, S_MODE=sm, Z_MODE=zm, PER_ROW=plan.per_row, BLOCK_R=block_r, BLOCK_C=block_c)


def quantize(x: torch.Tensor, scale: Scalar, zero_point: Scalar, axis: Optional[int], dtype: torch.dtype, qmin: int, qmax: int,
             *, block_elems: int, num_warps: int) -> torch.Tensor:
    x = x.contiguous()
    q = torch.empty(x.shape, dtype=dtype, device=x.device)
    _run(quantize_kernel, (x, q), x, scale, zero_point, axis, (qmin, qmax), block_elems, num_warps)
    return q


def dequantize(q: torch.Tensor, scale: Scalar, zero_point: Scalar, axis: Optional[int], out_dtype: torch.dtype,
               *, block_elems: int, num_warps: int) -> torch.Tensor:
    q = q.contiguous()
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    _run(dequantize_kernel, (q, out), q, scale, zero_point, axis, (), block_elems, num_warps)
    return out


def fake_quantize(x: torch.Tensor, scale: Scalar, zero_point: Scalar, qmin: int, qmax: int, axis: Optional[int],
                  *, block_elems: int, num_warps: int) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    _run(fake_quantize_kernel, (x, out), x, scale, zero_point, axis, (qmin, qmax), block_elems, num_warps)
    return out


def fake_quantize_backward(grad_out: torch.Tensor, x: torch.Tensor, scale: Scalar, zero_point: Scalar, qmin: int, qmax: int,
                           axis: Optional[int], *, block_elems: int, num_warps: int) -> torch.Tensor:
    x = x.contiguous()
    g = grad_out.contiguous()
    dx = torch.empty_like(x)
    _run(fake_quantize_bwd_kernel, (g, x, dx), x, scale, zero_point, axis, (qmin, qmax), block_elems, num_warps)
    return dx


def int32_dequant(acc: torch.Tensor, x_scale: Scalar, w_scale: Scalar, bias: Optional[torch.Tensor], out_dtype: torch.dtype,
                  *, block_elems: int, num_warps: int) -> torch.Tensor:
    """acc (M, N) int32 -> acc * x_scale * w_scale[n] + bias[n] in out_dtype."""
    m, n = (int(s) for s in acc.shape)
    out = torch.empty((m, n), dtype=out_dtype, device=acc.device)
    xp, xv, xm = _mode(x_scale, acc)
    wp, wv, wm = _mode(w_scale, acc)
    plan = _Plan(acc, 1)
    grid, ncb, block_r, block_c = _grid(plan, block_elems)
    launch(int32_dequant_kernel, grid, acc, out, xp, wp, bias if bias is not None else acc, xv, wv, m, n, ncb,
           num_warps=num_warps, fp_fusion=False, XS_MODE=xm, WS_MODE=wm, HAS_BIAS=bias is not None, BLOCK_R=block_r, BLOCK_C=block_c)
    return out
