"""Ragged grouped GEMM (mixture-of-experts): the rows of group g of x times weight[g].

The group sizes stay on the device: nothing here reads them on the host, so a call never
synchronises and can be captured in a CUDA graph.

- ``setup`` (one program) turns the sizes into each group's row range, clamped to x's rows, and
  the prefix of its row tiles. Rows past the last group (sizes summing to fewer than x's rows) form
  a tail group whose output rows are written as zeros; sizes summing to more are cut at x's end.
- ``forward``: the grid is an upper bound on the row tiles, cdiv(M, BLOCK_M) + G + 1, times the
  column tiles; a program finds its group by binary search over the tile prefix and idles when its
  tile is past the end. Programs of one row tile are adjacent, so its rows of x are shared through
  L2 while the weight is streamed. The same kernel computes grad_x with weight read transposed.
- ``weight_grad``: one program per (group, K tile, N tile) walks its group's rows:
  grad_weight[g] = x_g^T @ grad_out_g; an empty group gets zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import bf16_dot_workaround, cdiv, compute_dtype, launch, next_pow2
from .config import GemmConfig


@triton.jit
def mma(a, b, acc, MMA: tl.constexpr):
    """acc + a @ b: MMA 0 tensor cores with exact products ("ieee": float32 is not rounded to
    tf32), 1 integer tensor cores (int8 -> int32, no precision argument), 2 FMAs (float64: Triton 3.6 cannot lower a
    float64 tl.dot for sm_90; small tiles keep the broadcast product in registers)."""
    if MMA == 2:
        acc += tl.sum(a[:, :, None] * b[None, :, :], axis=1)
    elif MMA == 1:
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)  # Triton 3.6 checks acc against out_dtype (default float32)
    else:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    return acc


@triton.jit(do_not_specialize=["G", "M"])
def gg_setup_kernel(sizes_ptr, meta_ptr, G, M, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr):
    """meta[0:BLOCK_G] row starts, [BLOCK_G:2*BLOCK_G] row ends, [2*BLOCK_G:] first row tile of
    groups 0..G (index G is the tail group)."""
    g = tl.arange(0, BLOCK_G)
    sz = tl.load(sizes_ptr + g, mask=g < G, other=0).to(tl.int32)
    sz = tl.maximum(sz, 0)
    total = tl.sum(sz, axis=0)
    tail = M - tl.minimum(total, M)
    sz = tl.where(g == G, tail, sz)
    incl = tl.cumsum(sz, axis=0)
    end = tl.minimum(incl, M)
    start = tl.minimum(incl - sz, M)
    tiles = (end - start + BLOCK_M - 1) // BLOCK_M
    first = tl.cumsum(tiles, axis=0) - tiles
    tl.store(meta_ptr + g, start)
    tl.store(meta_ptr + BLOCK_G + g, end)
    tl.store(meta_ptr + 2 * BLOCK_G + g, first)


@triton.jit(do_not_specialize=["meta_stride", "G", "n_tiles_n"])
def gg_forward_kernel(
    x_ptr, w_ptr, y_ptr, meta_ptr, meta_stride, G, K, N, n_tiles_n,
    sxm, sxk, swg, swk, swn, sym, syn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    MMA: tl.constexpr, ACC: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid = tl.program_id(0)
    tile_m = pid // n_tiles_n
    tile_n = pid % n_tiles_n
    first_ptr = meta_ptr + 2 * meta_stride
    lo = 0
    hi = G
    while lo < hi:  # the last group whose first tile is <= tile_m
        mid = (lo + hi + 1) // 2
        if tl.load(first_ptr + mid) <= tile_m:
            lo = mid
        else:
            hi = mid - 1
    g = lo
    row0 = tl.load(meta_ptr + g) + (tile_m - tl.load(first_ptr + g)) * BLOCK_M
    end = tl.load(meta_ptr + meta_stride + g)
    if row0 < end:
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < end
        cmask = cols < N
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + rows.to(tl.int64)[:, None] * sxm + ks[None, :] * sxk
        b_ptrs = w_ptr + tl.cast(g, tl.int64) * swg + ks[:, None] * swk + cols[None, :] * swn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        k_steps = tl.where(g == G, 0, tl.cdiv(K, BLOCK_K))  # the tail group only writes zeros
        for i in range(0, k_steps):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=rmask[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=cmask[None, :], other=0.0)
            else:
                kmask = ks < K - i * BLOCK_K
                a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=kmask[:, None] & cmask[None, :], other=0.0)
            if DOT_F32:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = mma(a, b, acc, MMA)
            a_ptrs += BLOCK_K * sxk
            b_ptrs += BLOCK_K * swk
        y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * sym + cols[None, :] * syn
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@triton.jit(do_not_specialize=["meta_stride", "n_tiles_k", "n_tiles_n"])
def gg_weight_grad_kernel(
    x_ptr, dy_ptr, dw_ptr, meta_ptr, meta_stride, K, N, n_tiles_k, n_tiles_n,
    sxm, sxk, sym, syn, swg, swk, swn,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, MMA: tl.constexpr, ACC: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid = tl.program_id(0)
    per_group = n_tiles_k * n_tiles_n
    g = pid // per_group
    tile_k = (pid % per_group) // n_tiles_n
    tile_n = pid % n_tiles_n
    start = tl.load(meta_ptr + g)
    end = tl.load(meta_ptr + meta_stride + g)
    ks = tile_k * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kmask = ks < K
    cmask = cols < N
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=ACC)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + r
        rmask = rows < end
        a = tl.load(x_ptr + rows.to(tl.int64)[None, :] * sxm + ks[:, None] * sxk, mask=kmask[:, None] & rmask[None, :], other=0.0)
        b = tl.load(dy_ptr + rows.to(tl.int64)[:, None] * sym + cols[None, :] * syn, mask=rmask[:, None] & cmask[None, :], other=0.0)
        if DOT_F32:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = mma(a, b, acc, MMA)
    out = dw_ptr + tl.cast(g, tl.int64) * swg + ks[:, None] * swk + cols[None, :] * swn
    tl.store(out, acc.to(dw_ptr.dtype.element_ty), mask=kmask[:, None] & cmask[None, :])


# --- host side ----------------------------------------------------------------------------------


#: how GEMM tiles multiply (see ``mma``)
MMA_TENSOR_CORES, MMA_INT8, MMA_FMA = 0, 1, 2


def mma_mode(dtype: torch.dtype) -> int:
    return MMA_INT8 if dtype == torch.int8 else (MMA_FMA if dtype == torch.float64 else MMA_TENSOR_CORES)


def group_table(group_sizes: torch.Tensor, m: int, block_m: int) -> tuple[torch.Tensor, int]:
    """The device table of group row ranges and tile prefixes (see gg_setup_kernel), and its stride."""
    g = int(group_sizes.shape[0])
    block_g = max(16, next_pow2(g + 1))
    meta = torch.empty(3 * block_g, dtype=torch.int32, device=group_sizes.device)
    launch(gg_setup_kernel, (1,), group_sizes, meta, g, m, num_warps=4, BLOCK_M=block_m, BLOCK_G=block_g)
    return meta, block_g


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, w_strides: tuple[int, int, int], n: int, group_sizes: torch.Tensor, cfg: GemmConfig) -> torch.Tensor:
    """(M, n) = rows of each group of x (M, K) times that group's (K, n) matrix, read from ``w``
    with strides (group, k, n)."""
    m, k = (int(s) for s in x.shape)
    g = int(group_sizes.shape[0])
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    meta, stride = group_table(group_sizes, m, cfg.block_m)
    n_tiles_n = cdiv(n, cfg.block_n)
    grid = ((cdiv(m, cfg.block_m) + g + 1) * n_tiles_n,)
    launch(
        gg_forward_kernel, grid,
        x, w, y, meta, stride, g, k, n, n_tiles_n, x.stride(0), x.stride(1), *w_strides, y.stride(0), y.stride(1),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, options=cfg.options,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0,
        MMA=mma_mode(x.dtype), ACC=compute_dtype(x.dtype), DOT_F32=bf16_dot_workaround(x.dtype),
    )
    return y


def grouped_gemm(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor, cfg: GemmConfig) -> torch.Tensor:
    """x (M, K) @ weight[g] (K, N) per group; returns (M, N)."""
    return grouped_matmul(x, weight, tuple(weight.stride()), int(weight.shape[2]), group_sizes, cfg)


def grouped_gemm_backward(
    grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor, cfg_x: GemmConfig, cfg_w: GemmConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x, grad_weight): grad_out_g @ weight[g]^T, and x_g^T @ grad_out_g per group."""
    sg, sk, sn = weight.stride()
    grad_x = grouped_matmul(grad_out, weight, (sg, sn, sk), int(weight.shape[1]), group_sizes, cfg_x)
    g, k, n = (int(s) for s in weight.shape)
    grad_w = torch.empty_like(weight, memory_format=torch.contiguous_format)
    meta, stride = group_table(group_sizes, int(x.shape[0]), cfg_w.block_m)
    n_tiles_k, n_tiles_n = cdiv(k, cfg_w.block_m), cdiv(n, cfg_w.block_n)
    launch(
        gg_weight_grad_kernel, (g * n_tiles_k * n_tiles_n,),
        x, grad_out, grad_w, meta, stride, k, n, n_tiles_k, n_tiles_n,
        x.stride(0), x.stride(1), grad_out.stride(0), grad_out.stride(1), *grad_w.stride(),
        num_warps=cfg_w.num_warps, num_stages=cfg_w.num_stages, options=cfg_w.options,
        BLOCK_K=cfg_w.block_m, BLOCK_N=cfg_w.block_n, BLOCK_R=cfg_w.block_k, MMA=mma_mode(x.dtype),
        ACC=compute_dtype(x.dtype), DOT_F32=bf16_dot_workaround(x.dtype),
    )
    return grad_x, grad_w
