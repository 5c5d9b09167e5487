"""Tiled GEMM C = A @ B with a fused epilogue, for linear and int8_linear.

One kernel, two accumulators: floating inputs accumulate in float32 (float64 for float64) and
int8 inputs in int32 (exact). The epilogue runs on the accumulator in registers before the single
store: int8 dequantisation (``* x_scale * w_scale[n]``), ``+ bias[n]``, then an activation. Program
ids are swizzled in groups of GROUP_M row tiles so that neighbouring programs share B tiles in L2.

linear's B is the (N, K) weight read through transposed strides, so no copy is made.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl

from ._launch import bf16_dot_workaround, cdiv, compute_dtype, launch
from .activation import ACT_CODES, act_fwd
from .config import GemmConfig
from .grouped_gemm import mma, mma_mode

Scale = Union[float, torch.Tensor]


@triton.jit
def tile_rows_cols(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The rows and columns of C that program ``pid`` computes: tiles ordered in groups of GROUP_M
    tile rows, so that the programs running together share A's rows and B's columns in L2."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % group_rows
    tile_n = (pid % per_group) // group_rows
    return tile_m * BLOCK_M + tl.arange(0, BLOCK_M), tile_n * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit(do_not_specialize=["M", "act"])
def gemm_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, xs_ptr, ws_ptr, xs_val, ws_val,
    M, N, K, sam, sak, sbk, sbn, scm, scn, act,
    HAS_BIAS: tl.constexpr, INT8: tl.constexpr, XS_TENSOR: tl.constexpr, WS_MODE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, MMA: tl.constexpr, ACC: tl.constexpr, COMPUTE: tl.constexpr, DOT_F32: tl.constexpr,
):
    """WS_MODE: 0 a number, 1 a one-element tensor, 2 one value per output column."""
    rows, cols = tile_rows_cols(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    ks = tl.arange(0, BLOCK_K)
    rmask = rows < M
    cmask = cols < N
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * sam + ks[None, :] * sak
    b_ptrs = b_ptr + ks[:, None] * sbk + cols.to(tl.int64)[None, :] * sbn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    zero = 0 if INT8 else 0.0  # the padding value, of the operands' kind
    for i in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=rmask[:, None], other=zero)
            b = tl.load(b_ptrs, mask=cmask[None, :], other=zero)
        else:
            kmask = ks < K - i * BLOCK_K
            a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=zero)
            b = tl.load(b_ptrs, mask=kmask[:, None] & cmask[None, :], other=zero)
        if DOT_F32:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = mma(a, b, acc, MMA)
        a_ptrs += BLOCK_K * sak
        b_ptrs += BLOCK_K * sbk
    out = acc.to(COMPUTE)
    if INT8:
        if XS_TENSOR:
            out = out * tl.load(xs_ptr).to(COMPUTE)
        else:
            out = out * xs_val
        if WS_MODE == 2:
            out = out * tl.load(ws_ptr + cols, mask=cmask, other=0.0).to(COMPUTE)[None, :]
        elif WS_MODE == 1:
            out = out * tl.load(ws_ptr).to(COMPUTE)
        else:
            out = out * ws_val
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(COMPUTE)[None, :]
    out = act_fwd(out, act)
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * scm + cols[None, :] * scn
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


# --- host side ----------------------------------------------------------------------------------


GROUP_M = 8


def _run(a: torch.Tensor, b_nk: torch.Tensor, out: torch.Tensor, bias: Optional[torch.Tensor], act: str, cfg: GemmConfig,
         int8: bool, xs: Scale = 1.0, ws: Scale = 1.0) -> torch.Tensor:
    m, k = (int(s) for s in a.shape)
    n = int(b_nk.shape[0])
    xs_tensor = isinstance(xs, torch.Tensor)
    ws_mode = 0 if not isinstance(ws, torch.Tensor) else (2 if ws.numel() > 1 else 1)
    grid = (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n),)
    launch(
        gemm_kernel, grid,
        a, b_nk, out, bias if bias is not None else out,
        xs if xs_tensor else out, ws if ws_mode else out,
        0.0 if xs_tensor else float(xs), 0.0 if ws_mode else float(ws),
        m, n, k, a.stride(0), a.stride(1), b_nk.stride(1), b_nk.stride(0), out.stride(0), out.stride(1), ACT_CODES[act],
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, options=cfg.options,
        HAS_BIAS=bias is not None, INT8=int8, XS_TENSOR=xs_tensor, WS_MODE=ws_mode,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=GROUP_M, EVEN_K=k % cfg.block_k == 0,
        MMA=mma_mode(a.dtype), ACC=tl.int32 if int8 else compute_dtype(a.dtype),
        COMPUTE=tl.float32 if int8 else compute_dtype(a.dtype), DOT_F32=bf16_dot_workaround(a.dtype),
    )
    return out


def linear(x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], act: str, cfg: GemmConfig) -> torch.Tensor:
    """act(x2 @ weight.T + bias) for a 2-D x2 (M, K) and weight (N, K); returns (M, N)."""
    out = torch.empty((x2.shape[0], weight.shape[0]), dtype=x2.dtype, device=x2.device)
    return _run(x2, weight, out, bias, act, cfg, int8=False)


def int8_linear(x2: torch.Tensor, w_q: torch.Tensor, x_scale: Scale, w_scale: Scale, bias: Optional[torch.Tensor], out_dtype: torch.dtype, cfg: GemmConfig) -> torch.Tensor:
    """(x2 @ w_q.T in int32) * x_scale * w_scale[n] + bias, in out_dtype, for int8 x2 (M, K), w_q (N, K)."""
    out = torch.empty((x2.shape[0], w_q.shape[0]), dtype=out_dtype, device=x2.device)
    return _run(x2, w_q, out, bias, "none", cfg, int8=True, xs=x_scale, ws=w_scale)
