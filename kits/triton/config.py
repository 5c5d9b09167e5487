"""Launch-configuration types and size arithmetic, importable without Triton (vendor plugins build
their tables from these at import time; the kernels themselves load on first use)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


class Plans:
    """A kernel family's launch plans (or what it keeps with them, or a launch table's answers) by
    call geometry: a dict that forgets everything past ``size`` entries (a conformance run meets
    thousands of geometries, a model a few dozen)."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._entries: dict[tuple, Any] = {}

    def get(self, key: tuple) -> Any:
        return self._entries.get(key)

    def put(self, key: tuple, value: Any) -> Any:
        if len(self._entries) >= self.size:
            self._entries.clear()
        self._entries[key] = value
        return value

    def get_or_build(self, key: tuple, build: Callable[[], Any]) -> Any:
        hit = self._entries.get(key)
        return hit if hit is not None else self.put(key, build())

    def values(self):
        return self._entries.values()

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tile shape and pipelining of a GEMM-like kernel (block_k is the reduction tile).

    ``options`` holds vendor launch options passed to the kernel as they are (AMD:
    ``waves_per_eu``, ``matrix_instr_nonkdim``, ``kpack``), as sorted (name, value) pairs so
    that configurations stay hashable and serialisable.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    options: tuple[tuple[str, int], ...] = ()

    @classmethod
    def from_dict(cls, d: dict) -> "GemmConfig":
        """A configuration from its ``dataclasses.asdict`` form (a JSON cache entry)."""
        return cls(**{**d, "options": tuple(tuple(o) for o in d.get("options", ()))})


@dataclasses.dataclass(frozen=True)
class BNConfig:
    """Launch configuration of the batch-norm kernels (a vendor plugin fills it per shape)."""

    block_c: int  # channels per tile
    block_s: int  # positions per tile
    num_warps: int
    programs: int  # about how many programs the reductions should spread over
    finalize_block: int = 16  # channels per program of the finalize kernels (several programs for C >= 32)
    finalize_rows: int = 64  # chunks' partial sums those programs add per step
    reduce_block_s: int = 0  # positions per tile of the two reductions (0: block_s)
    reduce_warps: int = 0  # warps of the two reductions (0: num_warps)


@dataclasses.dataclass(frozen=True)
class NormBwdConfig:
    """Launch configuration of the persistent layer_norm / rms_norm backward (hal_triton.norm):
    ``programs`` programs, each taking every ``programs``-th block of ``block_m`` rows by
    ``block_n`` columns (``block_n`` below the row length: the loop kernel, one row a step), over
    ``num_warps`` warps; ``prefetch``: each program loads its next block before reducing the
    current one (the tile kernel only); ``options``: vendor launch options as sorted (name, value)
    pairs (NVIDIA's ``maxnreg``), as :class:`GemmConfig` keeps them."""

    block_m: int
    block_n: int
    num_warps: int
    programs: int
    prefetch: bool = False
    options: tuple[tuple[str, int], ...] = ()

    @classmethod
    def from_dict(cls, d: dict) -> "NormBwdConfig":
        """A configuration from its ``dataclasses.asdict`` form (a JSON cache entry)."""
        return cls(**{**d, "options": tuple(tuple(o) for o in d.get("options", ()))})


@dataclasses.dataclass(frozen=True)
class Fp8TransposeConfig:
    """Launch configuration of the FP8 casts that also write the transpose (hal_triton.fp8's
    ``fp8_encode_kernel`` with TRANSPOSE, and the row-wise cast's amax pass before it): one
    ``block_r`` x ``block_c`` tile of x a program (powers of two, at least 16: masks cover ragged
    edges), whose ``block_c`` columns become rows of q_t ``block_r`` codes long, over ``num_warps``
    warps (wavefronts on AMD)."""

    block_r: int
    block_c: int
    num_warps: int


def fp8_transpose_tile(k: int, block_elems: int) -> tuple[int, int]:
    """(block_r, block_c) of the transposed FP8 casts before they had candidates, for rows of length
    ``k`` and tiles of about ``block_elems`` elements: square-ish, at most 64 columns (whose codes
    become rows of q_t), at least 16 rows and columns."""
    block_c = max(16, min(next_pow2(max(k, 1)), 64))
    return max(16, block_elems // block_c), block_c
