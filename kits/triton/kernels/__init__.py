"""Registering the hal_triton kernels into a GPU plugin: one call per vendor plugin.

    from hal_triton.kernels import VendorLibs, register
    register(plugin, CudaTables(), archs=sm(80), vendor=VendorLibs("cudnn", conv, conv_grads, "cublas", linear, gemm_f32))

Every op family with Triton kernels has its registration file here, beside
:mod:`~hal_triton.kernels.kit`, which holds what they share, and its kernels in ``hal_triton.<family>``.
The registration files are found, not listed: every public module of this package but ``kit``,
searched along its ``__path__`` (:data:`FAMILIES`: a new family is its two new files, and nothing
else). They register in the order of their names; each op's kernels come from one family file, so
the order changes no op's list of kernels (tests/core/test_routing.py holds the routing as
recorded). Kernels take the same names on
every vendor: ``triton`` for the kernels that are Triton alone, ``<conv_name>_triton`` for the
convolution of the vendor's library followed by the Triton batch norm (+ ReLU), and
``<blas_name>_triton`` for the vendor's GEMM followed by a Triton pass. Each registration states,
as data, the contexts the kernel serves and its priority in each (:data:`~hal_triton.kernels.kit.FIRST`:
every context at 20), and each family file names the launch table its kernels read from the
plugin's :class:`~hal_triton.tables.LaunchTables`; autotuned GEMM tiles are cached per device
model (:mod:`hal_triton.autotune`). Importing this package, or calling :func:`register`, imports no
Triton: a kernel family is imported on the first call of one of its kernels.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Callable, Optional

from hal.plugin import Archs, Plugin, family_names

from ..tables import LaunchTables
from .kit import Kit, VendorLibs, family
from .loss import LCE_BLOCK_ELEMENTS
from .quant import int32_dequant

#: the kernel families: the names of the registration files on this package's ``__path__``, sorted
FAMILIES: tuple[str, ...] = tuple(family_names(__path__, {"kit"}))

#: the registration file of each kernel family, in the order of :data:`FAMILIES`
REGISTRATIONS: tuple[ModuleType, ...] = tuple(importlib.import_module(f"{__name__}.{name}") for name in FAMILIES)


def register(plugin: Plugin, tables: LaunchTables, *, archs: Optional[Archs], vendor: VendorLibs,
             backend: Optional[str] = None) -> dict[tuple[str, str], Callable[..., Any]]:
    """Register every hal_triton kernel on ``plugin`` (its own backend unless ``backend`` names
    another), launched with ``tables``. Returns the kernel functions by (op, name), for vendor
    kernels that build on them (a choice between a library GEMM and the Triton one, say)."""
    kit = Kit(plugin, tables, archs, vendor, backend)
    for registration in REGISTRATIONS:
        registration.register(kit)
    return kit.registered


__all__ = ["register", "VendorLibs", "LCE_BLOCK_ELEMENTS", "int32_dequant", "family", "FAMILIES", "REGISTRATIONS"]
