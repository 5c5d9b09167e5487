"""What every op family's registration shares: the plugin, its launch tables, its vendor libraries
and the kit's routing, held by one :class:`Kit` per :func:`hal_triton.kernels.register` call.

Triton-free: registering imports no Triton; a kernel family (``hal_triton.<family>``) is imported on
the first call of one of its kernels (:func:`family`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from types import ModuleType
from typing import Any, Callable, Mapping, Optional

import torch

from hal.plugin import CONTEXTS, Archs, Plugin

from .. import autotune
from ..checks import Check, triton_check
from ..config import GemmConfig
from ..tables import INTERPRETER, LaunchTables, PerGeometry, interpreted

FLOATS = ("float16", "bfloat16", "float32", "float64")
NOT_F64 = ("float16", "bfloat16", "float32")
OUT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

#: The kit's routing, the same on every vendor: its kernels serve every context (eager, CUDA-graph
#: replays, torch.compile graphs as opaque nodes, training as the forward and backward of hal's node)
#: at priority 20, where each GPU plugin ranks its own kernels around them; ``SECOND`` (10) is the
#: Triton GEMM linear, below the vendor library's GEMM + Triton activation.
FIRST: Mapping[str, int] = {context: 20 for context in CONTEXTS}
SECOND: Mapping[str, int] = {context: 10 for context in CONTEXTS}


@functools.lru_cache(maxsize=None)
def family(name: str) -> ModuleType:
    """The hal_triton kernel family ``name``, imported on first use (importing it imports Triton)."""
    return importlib.import_module(f"hal_triton.{name}")


@dataclasses.dataclass(frozen=True)
class VendorLibs:
    """The vendor-library calls the kit's mixed kernels build on, and the names they give them.

    ``conv(x, weight, bias, stride, padding, dilation, groups)`` takes canonical arguments (padding
    as (top, bottom, left, right)); ``conv_grads(grad_out, x, weight, stride, padding, dilation,
    groups)`` returns (grad_x, grad_weight, grad_bias); ``linear(x2, weight, bias)`` is a 2-D GEMM
    with the bias; ``gemm_f32(a, b, acc=None)`` is ``a @ b`` of 2-D operands accumulated and
    returned in float32 (float64 for float64; half-precision operands read as they are), or, given
    ``acc`` (float32), added into ``acc`` and ``acc`` returned. Each keeps the vendor's float32
    semantics (hal's float32 is IEEE float32).
    """

    conv_name: str  # "cudnn", "miopen"
    conv: Callable[..., torch.Tensor]
    conv_grads: Callable[..., tuple]
    blas_name: str  # "cublas", "hipblas"
    linear: Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]
    gemm_f32: Callable[..., torch.Tensor]


class Kit:
    """One registration of the kit into a plugin: what the families' kernels launch with (the
    plugin's tables, answered once per tensor geometry, and its vendor libraries) and the kernels
    registered so far, by (op, name)."""

    def __init__(self, plugin: Plugin, tables: LaunchTables, archs: Optional[Archs], vendor: VendorLibs,
                 backend: Optional[str]) -> None:
        self.plugin, self.archs, self.vendor, self.backend = plugin, archs, vendor, backend
        self.tables: LaunchTables = PerGeometry(tables)  # type: ignore[assignment]  (the same answers, each computed once)
        self.registered: dict[tuple[str, str], Callable[..., Any]] = {}

    def kernel(self, op: str, name: str, contexts: Mapping[str, int] = FIRST, dtypes: Optional[tuple[str, ...]] = FLOATS,
               checks: tuple[Check, ...] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Register the decorated function as kernel ``name`` of ``op`` on the plugin, serving
        ``contexts`` (context -> priority), for ``dtypes``, where Triton is importable and each of
        ``checks`` finds nothing to refuse; returns the function unchanged."""
        all_checks = (triton_check, *checks)

        def check(inputs: Any) -> list[str]:
            return [r for c in all_checks for r in (c(inputs) or [])]

        def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
            self.plugin.kernel(op, name=name, backend=self.backend, contexts=contexts, dtypes=dtypes, archs=self.archs, check=check)(fn)
            self.registered[(op, name)] = fn
            return fn

        return wrap

    def gemm_config(self, x: torch.Tensor, key: str, candidates: tuple[GemmConfig, ...], run: Callable[[GemmConfig], Any],
                    flops: float) -> GemmConfig:
        """The tile of a floating-point GEMM: FMA tiles for float64, interpreter tiles on the CPU,
        else the fastest candidate measured on this device for this problem (cached)."""
        if x.dtype == torch.float64:
            return self.tables.fma_gemm(x)
        if interpreted(x):
            return INTERPRETER.gemm
        return autotune.choose(self.tables, x.device, key, candidates, run, flops)

    def int8_config(self, x: torch.Tensor, key: str, run: Callable[[GemmConfig], Any], flops: float) -> GemmConfig:
        """The tile of an int8 (or FP8) GEMM: interpreter tiles on the CPU, else the fastest of the
        plugin's int8 candidates measured on this device for this problem (cached)."""
        if interpreted(x):
            return INTERPRETER.int8_gemm
        return autotune.choose(self.tables, x.device, key, lambda: self.tables.int8_candidates(x), run, flops)
