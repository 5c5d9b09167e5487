"""NVIDIA launch tables of the hal_triton kernels (block sizes, warps, stages): the plugin's
:class:`~hal_triton.tables.LaunchTables`.

Memory-bound kernels use fixed rules sized for Ampere/Hopper: 16-byte accesses per thread, several
in flight, and enough programs to fill every multiprocessor. GEMM-like kernels pick among the
candidate tiles below by timing them once per device and shape bucket (:mod:`hal_triton.autotune`);
their first entry is the default where tuning is off (small problems, graph capture).
"""

from __future__ import annotations

from pathlib import Path

import torch

from hal_triton.config import BNConfig, GemmConfig, NormBwdConfig, next_pow2
from hal_triton.tables import INTERPRETER, LaunchTables, interpreted, norm_backward_candidates

from ._device import slug, sm_count

#: longest row kept in registers by the tile kernels (longer rows use the loop kernels)
MAX_ROW = {torch.float64: 4096, torch.float32: 8192}
MAX_ROW_HALF = 16384

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
#: the norm backward's prefetching candidates (rows multiple, programs per SM) beside the default of
#: ``rows`` with 4 programs per SM: a program of 8 warps on a 4096-element bf16 row keeps the next
#: row's x and grad_out (16 KB) in flight while it reduces the current one; 2 to 8 programs per SM
#: trade waves of programs against partial rows to sum; 2 rows over twice the warps (at most 16)
#: put 32 KB in flight per program
NORM_BWD_VARIANTS = ((1, 2), (1, 4), (1, 8), (2, 2))
#: at most 128 registers a thread for the prefetching launches, so that two programs of 8 warps
#: share an SM's 64K: ptxas (Triton 3.9, sm_90a) gave layer_norm's prefetching kernel at 4096 bf16
#: 141 without the cap (one program an SM, as many bytes in flight as without prefetch) and 128 with
#: it, spilling nothing
NORM_BWD_OPTIONS = (("maxnreg", 128),)
#: the transposed FP8 casts' larger tiles (block_r, block_c, num_warps) beside the default of
#: ``elementwise`` (64 x 64 over 8 warps from a million elements: 8 KB of bf16 read a program, q_t
#: written in rows of 64 bytes): 128 columns make q_t's rows and q's 128-byte lines, 128 rows 256
#: bytes of each bf16 row of x; 4 warps keep the loads of more elements a thread in flight.
#: Registers (ptxas through Triton 3.9, sm_90a, bf16 per-tensor cast): 64x64 over 4 warps 58,
#: 32x128/4 62, 64x128/4 121, 64x128/8 59, 128x64/8 61, 128x128/8 117 (two 8-warp programs an
#: SM); 128x128 over 4 warps took 190 and is left out
FP8_TRANSPOSE_TILES = ((64, 64, 4), (32, 128, 4), (64, 128, 4), (64, 128, 8), (128, 64, 8), (128, 128, 8))
#: float64 GEMM tiles multiply with FMAs (no float64 tl.dot in Triton 3.6 for sm_90): small tiles
FMA_GEMM = GemmConfig(16, 16, 16, 4, 1)


class CudaTables(LaunchTables):
    """Launch configurations for NVIDIA GPUs (32-thread warps)."""

    seed_dir = Path(__file__).parent / "tuned"
    fp8_transpose_tiles = FP8_TRANSPOSE_TILES

    def slug(self, device: torch.device) -> str:
        return slug(device)

    def elementwise(self, x: torch.Tensor) -> dict[str, int]:
        if interpreted(x):
            return INTERPRETER.elementwise
        if x.numel() >= 1 << 20:
            return {"block_elems": 4096, "num_warps": 8}
        return {"block_elems": 1024, "num_warps": 4}

    def rows(self, x: torch.Tensor, n: int) -> dict[str, int]:
        """One row per program up to MAX_ROW with about 8-16 elements a thread; short rows are
        packed several to a program."""
        if interpreted(x):
            return INTERPRETER.rows(n)
        limit = MAX_ROW.get(x.dtype, MAX_ROW_HALF)
        block_n = next_pow2(n)
        if block_n > limit:
            return {"block_m": 1, "block_n": 4096, "num_warps": 8}
        num_warps = max(1, min(16, block_n // 512))
        block_m = max(1, min(64, 2048 // block_n))
        return {"block_m": block_m, "block_n": block_n, "num_warps": num_warps}

    def persistent_programs(self, x: torch.Tensor) -> int:
        return INTERPRETER.persistent_programs if interpreted(x) else 4 * sm_count(x.device)

    def norm_backward_candidates(self, x: torch.Tensor, n: int) -> tuple[NormBwdConfig, ...]:
        if interpreted(x):
            return INTERPRETER.norm_backward(n)
        return norm_backward_candidates(self.rows(x, n), n, self.persistent_programs(x), sm_count(x.device), NORM_BWD_VARIANTS, max_warps=16,
                                        options=NORM_BWD_OPTIONS)

    def columns(self, x: torch.Tensor) -> int:
        return INTERPRETER.columns if interpreted(x) else 128

    def batch_norm(self, x: torch.Tensor) -> BNConfig:
        """Tiles along the contiguous axis: channels for channels_last, positions for NCHW."""
        if interpreted(x):
            return INTERPRETER.batch_norm
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

    def multi_tensor(self, t: torch.Tensor) -> dict[str, int]:
        """A program streams iters blocks of one tensor (its table search is paid once per
        iters * block elements)."""
        return INTERPRETER.multi_tensor if interpreted(t) else {"block": 2048, "iters": 8, "num_warps": 8}

    def gemm_candidates(self, x: torch.Tensor) -> tuple[GemmConfig, ...]:
        return GEMM_CANDIDATES

    def wgrad_candidates(self, x: torch.Tensor) -> tuple[GemmConfig, ...]:
        return GEMM_WGRAD_CANDIDATES

    def int8_candidates(self, x: torch.Tensor) -> tuple[GemmConfig, ...]:
        return INT8_CANDIDATES

    def fma_gemm(self, x: torch.Tensor) -> GemmConfig:
        return FMA_GEMM


TABLES = CudaTables()
