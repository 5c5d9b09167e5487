"""The launch-table protocol: what a GPU plugin tells the Triton kit about launching its kernels.

The kernel sources of :mod:`hal_triton` are vendor-neutral; their host functions take launch
configurations (block sizes, warps, pipelining) as arguments. A GPU plugin supplies those numbers
by subclassing :class:`LaunchTables`: NVIDIA's tables speak ``num_warps`` / ``num_stages`` for
32-thread warps, AMD's pick tiles for 64-lane wavefronts and add ``waves_per_eu``,
``matrix_instr_nonkdim`` and ``kpack`` through :attr:`GemmConfig.options`. The plugin also names
its devices for the autotune cache (:meth:`slug`) and may ship measured choices (:attr:`seed_dir`).

Tensors on the CPU run under the Triton interpreter (the CI tests); every table answers them with
the small :data:`INTERPRETER` configurations so that multi-program paths run on tiny inputs.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Optional, Sequence

import torch

from .config import BNConfig, Fp8TransposeConfig, GemmConfig, NormBwdConfig, Plans, fp8_transpose_tile, next_pow2


def norm_backward_candidates(rows: dict[str, int], n: int, programs: int, units: int, variants: Sequence[tuple[int, int]],
                             max_warps: int, options: tuple[tuple[str, int], ...] = ()) -> tuple[NormBwdConfig, ...]:
    """Launches of the norm backward to measure for rows of length ``n``: first exactly the
    default (the ``rows`` table's blocks, ``programs`` programs, no prefetch), which runs wherever
    tuning does not; then, where the row fits one block (the tile kernel), a prefetching launch
    per ``(k, per_unit)`` of ``variants``: k times the rows over k times the warps (the same
    elements a thread, k rows' loads in flight), ``per_unit`` programs per multiprocessor or compute
    unit (``units`` of them), with the vendor launch ``options``; those over ``max_warps`` are left
    out. The loop kernel (longer rows) has the default only."""
    default = NormBwdConfig(rows["block_m"], rows["block_n"], rows["num_warps"], programs)
    if rows["block_n"] < n:
        return (default,)
    prefetching = (NormBwdConfig(k * default.block_m, default.block_n, k * default.num_warps, per_unit * units, True, options)
                   for k, per_unit in variants if k * default.num_warps <= max_warps)
    return tuple(dict.fromkeys((default, *prefetching)))


def fp8_transpose_default(elementwise: dict[str, int], k: int) -> Fp8TransposeConfig:
    """The transposed FP8 casts' launch before they had candidates, for rows of length ``k``: the
    ``elementwise`` table's tile (:func:`~hal_triton.config.fp8_transpose_tile`) and warps."""
    return Fp8TransposeConfig(*fp8_transpose_tile(k, elementwise["block_elems"]), elementwise["num_warps"])


def fp8_transpose_candidates(default: Fp8TransposeConfig, m: int, k: int,
                             tiles: Sequence[tuple[int, int, int]]) -> tuple[Fp8TransposeConfig, ...]:
    """Launches of the transposed FP8 casts to measure for (..., m, k) arrays: first exactly
    ``default`` (what runs wherever tuning does not), then each ``(block_r, block_c, num_warps)`` of
    ``tiles`` that the array fills (no side past the next power of two of m or k: such a tile would
    be mostly masked off), duplicates dropped. Tiles are kept as they are, never cut to the array,
    so that every launch that can run is one compiled ahead of time (hal_triton.aot)."""
    fits = (Fp8TransposeConfig(r, c, w) for r, c, w in tiles if r <= next_pow2(m) and c <= next_pow2(k))
    return tuple(dict.fromkeys((default, *fits)))


class Interpreter:
    """Configurations for CPU tensors (``TRITON_INTERPRET=1``): small blocks, several programs."""

    elementwise = {"block_elems": 64, "num_warps": 4}
    batch_norm = BNConfig(block_c=4, block_s=8, num_warps=4, programs=6, finalize_block=4, finalize_rows=4, reduce_block_s=16)
    multi_tensor = {"block": 32, "iters": 2, "num_warps": 4}
    persistent_programs = 3
    columns = 4
    gemm = GemmConfig(16, 16, 16, 4, 2)
    int8_gemm = GemmConfig(16, 16, 32, 4, 2)
    #: the norm backward's prefetching candidates, (rows multiple, programs): several blocks a
    #: program, blocks of 2 and 4 rows, more programs than blocks at the smallest sizes
    norm_backward_variants = ((1, 3), (2, 2), (1, 5))

    @staticmethod
    def rows(n: int) -> dict[str, int]:
        block_n = min(next_pow2(n), 32)
        return {"block_m": 2 if block_n >= n else 1, "block_n": block_n, "num_warps": 4}

    def norm_backward(self, n: int) -> tuple[NormBwdConfig, ...]:
        """The norm backward's candidates for rows of length n (:func:`norm_backward_candidates`)."""
        return norm_backward_candidates(self.rows(n), n, self.persistent_programs, 1, self.norm_backward_variants, max_warps=16)


INTERPRETER = Interpreter()


def interpreted(t: torch.Tensor) -> bool:
    """Whether a kernel on ``t`` runs under the Triton interpreter (CPU tensors)."""
    return t.device.type == "cpu"


class LaunchTables(abc.ABC):
    """A GPU vendor's launch configurations of the hal_triton kernels, per call.

    Every method receives the call's tensor, so that tables can depend on the device (its
    multiprocessor count) and the problem size. Methods answer CPU tensors with
    :data:`INTERPRETER`'s configurations (see :func:`interpreted`).
    """

    #: where measured autotune choices shipped with the plugin live (``autotune-<slug>.json``).
    seed_dir: Optional[Path] = None

    @abc.abstractmethod
    def slug(self, device: torch.device) -> str:
        """A file-name-safe identity of the device model ("nvidia-h200-sm90", "amd-mi250x-gfx90a")."""

    @abc.abstractmethod
    def elementwise(self, x: torch.Tensor) -> dict[str, int]:
        """``block_elems`` and ``num_warps`` of the elementwise kernels (affine/activation, quantisation)."""

    @abc.abstractmethod
    def rows(self, x: torch.Tensor, n: int) -> dict[str, int]:
        """``block_m``, ``block_n``, ``num_warps`` of the row kernels (norms, softmax) for rows of length n."""

    @abc.abstractmethod
    def persistent_programs(self, x: torch.Tensor) -> int:
        """Programs of the persistent backward kernels (each keeps partial parameter gradients)."""

    @abc.abstractmethod
    def norm_backward_candidates(self, x: torch.Tensor, n: int) -> tuple[NormBwdConfig, ...]:
        """Launches of the layer_norm / rms_norm backward for rows of length n, measured per device
        and problem by the autotuner: the first exactly ``rows`` and ``persistent_programs`` without
        prefetch (what runs where tuning does not); see :func:`norm_backward_candidates`."""

    #: the transposed FP8 casts' tiles ``(block_r, block_c, num_warps)`` a plugin offers the
    #: autotuner beside the ``elementwise`` tile (none: that launch alone)
    fp8_transpose_tiles: tuple[tuple[int, int, int], ...] = ()

    def fp8_transpose_candidates(self, x: torch.Tensor, m: int, k: int) -> tuple[Fp8TransposeConfig, ...]:
        """Launches of the FP8 casts that also write the transpose of x, (..., m, k) (hal_triton.fp8),
        measured per device and problem by the autotuner: the first exactly the ``elementwise``
        table's tile and warps (:func:`fp8_transpose_default`, what runs where tuning does not),
        then the plugin's :attr:`fp8_transpose_tiles` that the array fills
        (:func:`fp8_transpose_candidates`); CPU tensors get the first alone."""
        default = fp8_transpose_default(self.elementwise(x), k)
        return (default,) if interpreted(x) else fp8_transpose_candidates(default, m, k, self.fp8_transpose_tiles)

    @abc.abstractmethod
    def columns(self, x: torch.Tensor) -> int:
        """Neighbouring columns per program of the softmax kernels that reduce a non-last dim."""

    @abc.abstractmethod
    def batch_norm(self, x: torch.Tensor) -> BNConfig:
        """Tiles of the batch-norm kernels for an (N, C, ...) input in its memory layout."""

    @abc.abstractmethod
    def multi_tensor(self, t: torch.Tensor) -> dict[str, int]:
        """``block``, ``iters``, ``num_warps`` of the multi-tensor optimizer kernels."""

    @abc.abstractmethod
    def gemm_candidates(self, x: torch.Tensor) -> tuple[GemmConfig, ...]:
        """Tiles of the floating-point GEMMs (linear epilogue, grouped GEMM), the default first."""

    @abc.abstractmethod
    def wgrad_candidates(self, x: torch.Tensor) -> tuple[GemmConfig, ...]:
        """Tiles of the grouped GEMM's weight gradient (block_m is the K tile, block_k the rows per step)."""

    @abc.abstractmethod
    def int8_candidates(self, x: torch.Tensor) -> tuple[GemmConfig, ...]:
        """Tiles of the int8 GEMM."""

    @abc.abstractmethod
    def fma_gemm(self, x: torch.Tensor) -> GemmConfig:
        """The tile of float64 GEMMs, which multiply with FMAs (no float64 tl.dot)."""


class PerGeometry:
    """A plugin's tables with the per-call answers remembered per tensor geometry.

    The kit asks the tables on every launch, and a model asks about the same few geometries over
    and over; an answer is a function of the tensor's shape, strides, dtype and device (and the
    method's other arguments), which is what the tables are given, so it is computed once. Every
    other attribute (GEMM candidates, the device slug, seed_dir) is the plugin's own.
    """

    _PER_CALL = ("elementwise", "rows", "persistent_programs", "norm_backward_candidates", "fp8_transpose_candidates", "columns",
                 "batch_norm", "multi_tensor")

    def __init__(self, tables: LaunchTables) -> None:
        self.tables = tables
        self._answers = Plans()
        for name in self._PER_CALL:
            setattr(self, name, self._remembered(name, getattr(tables, name)))

    def _remembered(self, name: str, method):
        answers = self._answers

        def answer(t: torch.Tensor, *args):
            return answers.get_or_build((name, t.shape, t.stride(), t.dtype, t.get_device(), *args), lambda: method(t, *args))

        answer.__doc__ = method.__doc__
        return answer

    def __getattr__(self, name: str):
        return getattr(self.tables, name)
