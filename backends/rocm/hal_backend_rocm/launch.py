"""AMD launch tables of the hal_triton kernels: the plugin's :class:`~hal_triton.tables.LaunchTables`
for CDNA GPUs (gfx90a: MI200; gfx942: MI300).

On AMD ``num_warps`` counts wavefronts of 64 lanes, so a program of 4 waves is 256 lanes, twice
an NVIDIA program of 4 warps. Memory-bound kernels are sized by elements per lane (8 to 16: two
16-byte accesses of half-precision data) and fill every compute unit (4 SIMDs each) several times.

GEMM-like kernels pick among candidates by timing them on the device (:mod:`hal_triton.autotune`);
the first candidate is the default where tuning is off. The candidates follow AMD's guidance for
Triton on CDNA: ``num_stages=2`` (one LDS buffer and a register prefetch: the stream pipeliner),
``matrix_instr_nonkdim`` choosing 16x16 or 32x32 MFMA tiles (16 is AMD's default advice on MI300),
``kpack=2`` (wider LDS reads for the MFMA operands) on gfx942, ``waves_per_eu`` bounding the
registers so that 2 or 3 waves share a SIMD. Every tile fits the 64 KiB of LDS a workgroup gets
(checked by compiling them in CI). None of these numbers was measured on an AMD GPU: none was
reachable; the autotuner measures them on the user's device.
"""

from __future__ import annotations

from typing import Optional

import torch

from hal_triton.config import BNConfig, GemmConfig, NormBwdConfig, next_pow2
from hal_triton.tables import INTERPRETER, LaunchTables, interpreted, norm_backward_candidates

from ._device import ARCHS, ArchFacts, arch, compute_units, slug

#: lanes of a wavefront on CDNA
LANES = 64
#: longest row kept in registers by the tile kernels (longer rows use the loop kernels)
MAX_ROW = {torch.float64: 4096, torch.float32: 8192}
MAX_ROW_HALF = 16384


def _gemm(bm: int, bn: int, bk: int, waves: int, *, nonk: int, kpack: int = 1, per_eu: int = 0, stages: int = 2) -> GemmConfig:
    """A tile with AMD's options (sorted names, as GemmConfig keeps them)."""
    options = {"kpack": kpack, "matrix_instr_nonkdim": nonk, "waves_per_eu": per_eu}
    return GemmConfig(bm, bn, bk, waves, stages, tuple(sorted(options.items())))


#: candidate tiles of the floating-point GEMMs (linear with fused epilogue, grouped GEMM) per architecture
GEMM_CANDIDATES: dict[str, tuple[GemmConfig, ...]] = {
    "gfx90a": (
        _gemm(128, 128, 64, 4, nonk=16, per_eu=2),
        _gemm(128, 128, 32, 4, nonk=32),
        _gemm(256, 128, 32, 8, nonk=16, per_eu=2),
        _gemm(64, 128, 64, 4, nonk=16, per_eu=3),
    ),
    "gfx942": (
        _gemm(128, 128, 64, 4, nonk=16, kpack=2, per_eu=2),
        _gemm(256, 128, 64, 8, nonk=16, kpack=2, per_eu=2),
        _gemm(128, 256, 64, 8, nonk=16, kpack=2, per_eu=2),
        _gemm(64, 128, 64, 4, nonk=16, kpack=2, per_eu=3),
    ),
}
#: candidates of the grouped GEMM's weight gradient (block_m is the K tile, block_k the rows per step)
WGRAD_CANDIDATES: dict[str, tuple[GemmConfig, ...]] = {
    "gfx90a": (_gemm(128, 128, 64, 4, nonk=16, per_eu=2), _gemm(128, 128, 32, 8, nonk=32)),
    "gfx942": (_gemm(128, 128, 64, 4, nonk=16, kpack=2, per_eu=2), _gemm(128, 128, 32, 8, nonk=16, kpack=2)),
}
#: candidates of the int8 GEMM (one-byte operands: deeper K tiles for the same LDS)
INT8_CANDIDATES: dict[str, tuple[GemmConfig, ...]] = {
    "gfx90a": (_gemm(128, 128, 128, 4, nonk=16, per_eu=2), _gemm(128, 128, 64, 4, nonk=32), _gemm(256, 128, 64, 8, nonk=16, per_eu=2)),
    "gfx942": (_gemm(128, 128, 128, 4, nonk=16, kpack=2, per_eu=2), _gemm(256, 128, 128, 8, nonk=16, kpack=2, per_eu=2),
               _gemm(128, 256, 128, 8, nonk=16, kpack=2, per_eu=2)),
}
#: the norm backward's prefetching candidates (rows multiple, programs per compute unit) beside the
#: default of ``rows`` with 2 programs per CU: ``rows`` gives a 4096-element row 4 waves (one per
#: SIMD, 16 elements a lane); 2 to 4 programs per CU put 2 to 4 waves on each SIMD, registers
#: permitting; 2 rows over 8 waves (at most 16, a 1024-lane workgroup) double the loads in flight
NORM_BWD_VARIANTS = ((1, 2), (1, 4), (2, 2), (2, 4))
#: the transposed FP8 casts' larger tiles (block_r, block_c, waves) beside the default of
#: ``elementwise`` (64 x 64 over 4 waves from a million elements, 16 elements a lane): 128 columns
#: (q_t written in rows of 128 bytes), 128 rows, and 128 x 128 over 8 waves (32 a lane); not
#: measured on an AMD GPU (none reachable), so few
FP8_TRANSPOSE_TILES = ((64, 128, 4), (128, 64, 4), (128, 128, 8))
#: float64 GEMMs multiply with FMAs (the kit has no float64 tl.dot): 4 outputs a lane
FMA_GEMM = GemmConfig(32, 32, 8, 4, 1)


class RocmTables(LaunchTables):
    """Launch configurations for AMD CDNA GPUs (64-lane wavefronts).

    ``RocmTables()`` reads each call's device; ``RocmTables("gfx942")`` is pinned to an
    architecture and its table defaults (compute units of its largest product), for compiling
    ahead of time without a device.
    """

    fp8_transpose_tiles = FP8_TRANSPOSE_TILES

    def __init__(self, arch: Optional[str] = None) -> None:
        if arch is not None and arch not in ARCHS:
            raise ValueError(f"no ROCm launch tables for {arch}; tables exist for {', '.join(ARCHS)}")
        self.pinned = arch

    def facts(self, x: torch.Tensor) -> ArchFacts:
        name = self.pinned or arch(x.device)
        if name not in ARCHS:
            raise ValueError(f"no ROCm launch tables for {name} (the Triton kernels run on {', '.join(ARCHS)})")
        return ARCHS[name]

    def compute_units(self, x: torch.Tensor) -> int:
        return self.facts(x).compute_units if self.pinned else compute_units(x.device)

    def slug(self, device: torch.device) -> str:
        return slug(device)

    def elementwise(self, x: torch.Tensor) -> dict[str, int]:
        """4 waves a program; 8 elements a lane, 16 for tensors of a million elements and more."""
        if interpreted(x):
            return INTERPRETER.elementwise
        per_lane = 16 if x.numel() >= 1 << 20 else 8
        return {"block_elems": per_lane * 4 * LANES, "num_warps": 4}

    def rows(self, x: torch.Tensor, n: int) -> dict[str, int]:
        """One row a program up to MAX_ROW with 16 elements a lane (a wave per 1024 elements);
        short rows are packed several to a one-wave program."""
        if interpreted(x):
            return INTERPRETER.rows(n)
        limit = MAX_ROW.get(x.dtype, MAX_ROW_HALF)
        block_n = next_pow2(n)
        if block_n > limit:
            return {"block_m": 1, "block_n": 4096, "num_warps": 4}
        num_warps = max(1, min(16, block_n // (16 * LANES)))
        block_m = max(1, min(64, (16 * LANES) // block_n))
        return {"block_m": block_m, "block_n": block_n, "num_warps": num_warps}

    def persistent_programs(self, x: torch.Tensor) -> int:
        """Two programs a compute unit (each keeps a partial row of the parameter gradients)."""
        return INTERPRETER.persistent_programs if interpreted(x) else 2 * self.compute_units(x)

    def norm_backward_candidates(self, x: torch.Tensor, n: int) -> tuple[NormBwdConfig, ...]:
        if interpreted(x):
            return INTERPRETER.norm_backward(n)
        return norm_backward_candidates(self.rows(x, n), n, self.persistent_programs(x), self.compute_units(x), NORM_BWD_VARIANTS,
                                        max_warps=16)

    def columns(self, x: torch.Tensor) -> int:
        return INTERPRETER.columns if interpreted(x) else 2 * LANES

    def batch_norm(self, x: torch.Tensor) -> BNConfig:
        """Tiles along the contiguous axis (channels for channels_last, positions for NCHW) of
        4096 elements for 4 waves (16 a lane); the two reductions take up to 32 a lane over 8 waves."""
        if interpreted(x):
            return INTERPRETER.batch_norm
        programs = 4 * self.compute_units(x)
        channels = int(x.shape[1])
        spatial = x.numel() // max(1, int(x.shape[0]) * channels)
        tile = 16 * 4 * LANES
        if x.ndim == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
            block_c = min(next_pow2(channels), 64)
            block_s = max(16, tile // block_c)
            return BNConfig(block_c, block_s, num_warps=4, programs=programs, reduce_block_s=4 * block_s, reduce_warps=8)
        block_s = min(next_pow2(spatial), 2048)
        return BNConfig(max(1, tile // block_s), block_s, num_warps=4, programs=programs,
                        reduce_block_s=min(next_pow2(spatial), 2 * tile), reduce_warps=8)

    def multi_tensor(self, t: torch.Tensor) -> dict[str, int]:
        """A program streams ``iters`` blocks of 8 elements a lane over 8 waves (an AdamW element
        keeps five values live)."""
        return INTERPRETER.multi_tensor if interpreted(t) else {"block": 8 * 8 * LANES, "iters": 8, "num_warps": 8}

    def gemm_candidates(self, x: torch.Tensor) -> tuple[GemmConfig, ...]:
        return GEMM_CANDIDATES[self.facts(x).name]

    def wgrad_candidates(self, x: torch.Tensor) -> tuple[GemmConfig, ...]:
        return WGRAD_CANDIDATES[self.facts(x).name]

    def int8_candidates(self, x: torch.Tensor) -> tuple[GemmConfig, ...]:
        return INT8_CANDIDATES[self.facts(x).name]

    def fma_gemm(self, x: torch.Tensor) -> GemmConfig:
        return FMA_GEMM


TABLES = RocmTables()
