"""NVIDIA launch configurations of the hal.triton kernels (block sizes, warps, stages).

Memory-bound kernels use fixed rules sized for Ampere/Hopper: 16-byte accesses per thread, several
in flight, and enough programs to fill every multiprocessor. GEMM-like kernels pick among the
candidate tiles below by timing them once per device and shape bucket (see :mod:`autotune`); their
first entry is the default where tuning is off (small problems, graph capture, CPU tensors).

On CPU tensors (the Triton interpreter, used by the CI tests) the rules give small blocks, so that
multi-program paths are exercised on tiny inputs.
"""

from __future__ import annotations

import torch

from hal.triton.config import BNConfig, GemmConfig, next_pow2

from ._device import sm_count


def _on_gpu(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


# --- elementwise ---------------------------------------------------------------------------------


def elementwise(x: torch.Tensor) -> dict[str, int]:
    """(block_elems, num_warps) of the affine/activation and quantisation kernels."""
    if not _on_gpu(x):
        return {"block_elems": 64, "num_warps": 4}
    if x.numel() >= 1 << 20:
        return {"block_elems": 4096, "num_warps": 8}
    return {"block_elems": 1024, "num_warps": 4}


# --- row-wise kernels: norms and softmax -----------------------------------------------------------

#: longest row kept in registers by the tile kernels (longer rows use the loop kernels)
MAX_ROW = {torch.float64: 4096, torch.float32: 8192}
MAX_ROW_HALF = 16384


def rows(x: torch.Tensor, n: int) -> dict[str, int]:
    """(block_m, block_n, num_warps) for rows of length n: one row per program up to MAX_ROW with
    about 8-16 elements a thread; short rows are packed several to a program."""
    if not _on_gpu(x):
        block_n = min(next_pow2(n), 32)
        return {"block_m": 2 if block_n >= n else 1, "block_n": block_n, "num_warps": 4}
    limit = MAX_ROW.get(x.dtype, MAX_ROW_HALF)
    block_n = next_pow2(n)
    if block_n > limit:
        return {"block_m": 1, "block_n": 4096, "num_warps": 8}
    num_warps = max(1, min(16, block_n // 512))
    block_m = max(1, min(64, 2048 // block_n))
    return {"block_m": block_m, "block_n": block_n, "num_warps": num_warps}


def persistent_programs(x: torch.Tensor) -> int:
    """Programs of the persistent backward kernels (each keeps a partial row of grad_weight)."""
    return 4 * sm_count(x.device) if _on_gpu(x) else 3


def columns(x: torch.Tensor) -> int:
    """BLOCK_I of the softmax column kernels (neighbouring columns per program)."""
    return 128 if _on_gpu(x) else 4


# --- batch norm ----------------------------------------------------------------------------------


def batch_norm(x: torch.Tensor) -> BNConfig:
    """Tiles along the contiguous axis: channels for channels_last, positions for NCHW."""
    if not _on_gpu(x):
        return BNConfig(block_c=4, block_s=8, num_warps=4, programs=6, finalize_block=4, finalize_rows=4, reduce_block_s=16)
    programs = 4 * sm_count(x.device)
    channels = int(x.shape[1])
    spatial = x.numel() // max(1, int(x.shape[0]) * channels)
    if x.ndim == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        block_c = min(next_pow2(channels), 64)
        block_s = max(8, 2048 // block_c)
        return BNConfig(block_c, block_s, num_warps=4, programs=programs, reduce_block_s=4 * block_s, reduce_warps=8)
    block_s = min(next_pow2(spatial), 1024)
    reduce_s = min(next_pow2(spatial), 4096)
    return BNConfig(max(1, 2048 // block_s), block_s, num_warps=4, programs=programs, reduce_block_s=reduce_s, reduce_warps=8)


# --- optimizers ----------------------------------------------------------------------------------


def multi_tensor(t: torch.Tensor) -> dict[str, int]:
    """(block, iters, num_warps) of the multi-tensor kernels: a program streams iters blocks of one
    tensor (its table search is paid once per iters * block elements)."""
    if not _on_gpu(t):
        return {"block": 32, "iters": 2, "num_warps": 4}
    return {"block": 2048, "iters": 8, "num_warps": 8}


# --- GEMMs ---------------------------------------------------------------------------------------

#: candidate tiles of the floating-point GEMMs (grouped GEMM, linear with fused epilogue)
GEMM_CANDIDATES = (
    GemmConfig(128, 128, 64, 8, 4),
    GemmConfig(128, 256, 64, 8, 3),
    GemmConfig(128, 128, 64, 4, 4),
    GemmConfig(64, 128, 64, 4, 4),
    GemmConfig(128, 64, 64, 4, 4),
)
#: candidates of the grouped GEMM's weight gradient (block_m is the K tile, block_k the rows per step)
GEMM_WGRAD_CANDIDATES = (
    GemmConfig(128, 128, 64, 8, 4),
    GemmConfig(128, 128, 32, 4, 4),
    GemmConfig(128, 256, 64, 8, 3),
)
#: candidates of the int8 GEMM (int8 operands are half the bytes: deeper K tiles)
INT8_CANDIDATES = (
    GemmConfig(128, 256, 128, 8, 3),
    GemmConfig(128, 128, 128, 8, 4),
    GemmConfig(256, 128, 128, 8, 3),
    GemmConfig(128, 128, 64, 4, 4),
)
#: float64 GEMM tiles multiply with FMAs (no float64 tl.dot in Triton 3.6 for sm_90): small tiles
FMA_GEMM = GemmConfig(16, 16, 16, 4, 1)
#: what interpreter runs use: small tiles, many programs
CPU_GEMM = GemmConfig(16, 16, 16, 4, 2)
CPU_INT8_GEMM = GemmConfig(16, 16, 32, 4, 2)
