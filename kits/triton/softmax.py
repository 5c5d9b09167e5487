"""Softmax along any dimension, forward and backward (from the output).

x is seen as (outer, D, inner) with D the softmax dimension:

- inner == 1 (the last dimension): rows. Tile kernel with BLOCK_M rows of BLOCK_N >= D columns in
  registers, or, for long rows, a loop kernel that makes an online max/sum pass and a write pass;
- inner > 1: columns. Each program owns BLOCK_I neighbouring columns of one outer index (loads are
  contiguous along inner) and walks D twice (online max/sum, then write).

A row of -inf gives NaN, as torch.softmax does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import cdiv, compute_dtype, launch


@triton.jit(do_not_specialize=["M"])
def softmax_rows_kernel(x_ptr, y_ptr, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=-float("inf")).to(COMPUTE)
    e = tl.exp(x - tl.max(x, axis=1)[:, None])
    e = tl.where(mask, e, 0.0)
    y = e / tl.sum(e, axis=1)[:, None]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _online_update(m, s, x, valid):
    """Fold the values x (valid lanes) into running lane maxima m and scaled sums s."""
    m_new = tl.maximum(m, tl.where(valid, x, -float("inf")))
    finite = m_new > -float("inf")
    alpha = tl.where(finite, tl.exp(m - m_new), 0.0)
    term = tl.where(valid & finite, tl.exp(x - m_new), 0.0)
    return m_new, s * alpha + term


@triton.jit
def _online_finish(m, s):
    """(maximum, sum of exp(x - maximum)) of a row from its lane maxima and sums."""
    big = tl.max(m, axis=0)
    total = tl.sum(tl.where(m > -float("inf"), s * tl.exp(m - big), 0.0), axis=0)
    return big, total


@triton.jit
def softmax_rows_loop_kernel(x_ptr, y_ptr, N, BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * N
    cols = tl.arange(0, BLOCK_N)
    m = tl.full([BLOCK_N], -float("inf"), COMPUTE)
    s = tl.zeros([BLOCK_N], dtype=COMPUTE)
    for start in range(0, N, BLOCK_N):
        valid = start + cols < N
        x = tl.load(x_ptr + base + start + cols, mask=valid, other=-float("inf")).to(COMPUTE)
        m, s = _online_update(m, s, x, valid)
    big, total = _online_finish(m, s)
    for start in range(0, N, BLOCK_N):
        valid = start + cols < N
        x = tl.load(x_ptr + base + start + cols, mask=valid, other=-float("inf")).to(COMPUTE)
        tl.store(y_ptr + base + start + cols, (tl.exp(x - big) / total).to(y_ptr.dtype.element_ty), mask=valid)


@triton.jit(do_not_specialize=["D", "n_inner_blocks"])
def softmax_cols_kernel(x_ptr, y_ptr, D, INNER, n_inner_blocks, BLOCK_I: tl.constexpr, COMPUTE: tl.constexpr):
    pid = tl.program_id(0)
    outer = pid // n_inner_blocks
    cols = (pid % n_inner_blocks) * BLOCK_I + tl.arange(0, BLOCK_I)
    valid = cols < INNER
    base = outer.to(tl.int64) * D * INNER + cols
    m = tl.full([BLOCK_I], -float("inf"), COMPUTE)
    s = tl.zeros([BLOCK_I], dtype=COMPUTE)
    for d in range(0, D):
        x = tl.load(x_ptr + base + d * INNER, mask=valid, other=-float("inf")).to(COMPUTE)
        m, s = _online_update(m, s, x, valid)
    for d in range(0, D):
        x = tl.load(x_ptr + base + d * INNER, mask=valid, other=0.0).to(COMPUTE)
        tl.store(y_ptr + base + d * INNER, (tl.exp(x - m) / s).to(y_ptr.dtype.element_ty), mask=valid)


@triton.jit(do_not_specialize=["M"])
def softmax_bwd_rows_kernel(g_ptr, y_ptr, dx_ptr, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
    dx = y * (g - tl.sum(g * y, axis=1)[:, None])
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def softmax_bwd_rows_loop_kernel(g_ptr, y_ptr, dx_ptr, N, BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * N
    cols = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=COMPUTE)
    for start in range(0, N, BLOCK_N):
        valid = start + cols < N
        g = tl.load(g_ptr + base + start + cols, mask=valid, other=0.0).to(COMPUTE)
        acc += g * tl.load(y_ptr + base + start + cols, mask=valid, other=0.0).to(COMPUTE)
    dot = tl.sum(acc, axis=0)
    for start in range(0, N, BLOCK_N):
        valid = start + cols < N
        g = tl.load(g_ptr + base + start + cols, mask=valid, other=0.0).to(COMPUTE)
        y = tl.load(y_ptr + base + start + cols, mask=valid, other=0.0).to(COMPUTE)
        tl.store(dx_ptr + base + start + cols, (y * (g - dot)).to(dx_ptr.dtype.element_ty), mask=valid)


@triton.jit(do_not_specialize=["D", "n_inner_blocks"])
def softmax_bwd_cols_kernel(g_ptr, y_ptr, dx_ptr, D, INNER, n_inner_blocks, BLOCK_I: tl.constexpr, COMPUTE: tl.constexpr):
    pid = tl.program_id(0)
    outer = pid // n_inner_blocks
    cols = (pid % n_inner_blocks) * BLOCK_I + tl.arange(0, BLOCK_I)
    valid = cols < INNER
    base = outer.to(tl.int64) * D * INNER + cols
    acc = tl.zeros([BLOCK_I], dtype=COMPUTE)
    for d in range(0, D):
        g = tl.load(g_ptr + base + d * INNER, mask=valid, other=0.0).to(COMPUTE)
        acc += g * tl.load(y_ptr + base + d * INNER, mask=valid, other=0.0).to(COMPUTE)
    for d in range(0, D):
        g = tl.load(g_ptr + base + d * INNER, mask=valid, other=0.0).to(COMPUTE)
        y = tl.load(y_ptr + base + d * INNER, mask=valid, other=0.0).to(COMPUTE)
        tl.store(dx_ptr + base + d * INNER, (y * (g - acc)).to(dx_ptr.dtype.element_ty), mask=valid)


# --- host side ----------------------------------------------------------------------------------


def split(shape: torch.Size, dim: int) -> tuple[int, int, int]:
    """(outer, D, inner) of a shape around ``dim``."""
    outer = 1
    for s in shape[:dim]:
        outer *= int(s)
    inner = 1
    for s in shape[dim + 1 :]:
        inner *= int(s)
    return outer, int(shape[dim]), inner


def softmax(x: torch.Tensor, dim: int, *, block_m: int, block_n: int, block_i: int, num_warps: int) -> torch.Tensor:
    """Softmax of x along ``dim`` (non-negative). Rows use the tile kernel when ``block_n`` covers
    the dimension, else the loop kernel; other dimensions use the column kernel."""
    x = x.contiguous()
    y = torch.empty_like(x)
    outer, d, inner = split(x.shape, dim)
    cdt = compute_dtype(x.dtype)
    if inner == 1 and block_n >= d:
        launch(softmax_rows_kernel, (cdiv(outer, block_m),), x, y, outer, d, num_warps=num_warps, BLOCK_M=block_m, BLOCK_N=block_n, COMPUTE=cdt)
    elif inner == 1:
        launch(softmax_rows_loop_kernel, (outer,), x, y, d, num_warps=num_warps, BLOCK_N=block_n, COMPUTE=cdt)
    else:
        nb = cdiv(inner, block_i)
        launch(softmax_cols_kernel, (outer * nb,), x, y, d, inner, nb, num_warps=num_warps, BLOCK_I=block_i, COMPUTE=cdt)
    return y


def softmax_backward(grad_out: torch.Tensor, out: torch.Tensor, dim: int, *, block_m: int, block_n: int, block_i: int, num_warps: int) -> torch.Tensor:
    """``out * (grad_out - sum(grad_out * out, dim))`` with the kernels of :func:`softmax`."""
    g = grad_out.contiguous()
    y = out.contiguous()
    dx = torch.empty_like(y)
    outer, d, inner = split(y.shape, dim)
    cdt = compute_dtype(y.dtype)
    if inner == 1 and block_n >= d:
        launch(softmax_bwd_rows_kernel, (cdiv(outer, block_m),), g, y, dx, outer, d, num_warps=num_warps, BLOCK_M=block_m, BLOCK_N=block_n, COMPUTE=cdt)
    elif inner == 1:
        launch(softmax_bwd_rows_loop_kernel, (outer,), g, y, dx, d, num_warps=num_warps, BLOCK_N=block_n, COMPUTE=cdt)
    else:
        nb = cdiv(inner, block_i)
        launch(softmax_bwd_cols_kernel, (outer * nb,), g, y, dx, d, inner, nb, num_warps=num_warps, BLOCK_I=block_i, COMPUTE=cdt)
    return dx
