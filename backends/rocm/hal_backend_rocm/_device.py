"""Is a usable AMD GPU here, and what is it: the backend's probe, device list, architecture names
("gfx90a", "gfx942"), what each architecture's hardware has, and the predicates kernels state their
support with.

Device facts come from the HIP runtime (``hipGetDeviceProperties`` through hip-python: gcnArchName,
compute units, memory, wavefront size), never from the product name. The table :data:`ARCHS` holds
what the properties do not say (the matrix-core number formats) and the defaults of tables pinned to
an architecture without a device (ahead-of-time compilation).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import torch

from hal.plugin import Archs, DeviceInfo

from . import _hip


@dataclasses.dataclass(frozen=True)
class ArchFacts:
    """What one AMD GPU architecture has, from AMD's CDNA instruction-set references."""

    name: str
    products: str
    wavefront: int
    lds_bytes: int  # local data share a workgroup may allocate
    compute_units: int  # of the largest product (one GCD of an MI250X), for tables without a device
    xf32: bool  # float32 matrix instructions with reduced-precision inputs (v_mfma_*_xf32)
    fp8: Optional[str]  # the 8-bit float formats of the matrix cores ("e4m3fnuz/e5m2fnuz"), None without


#: the architectures this plugin's Triton kernels are tuned and compiled for
ARCHS: dict[str, ArchFacts] = {
    "gfx90a": ArchFacts("gfx90a", "Instinct MI210, MI250, MI250X (CDNA 2)", 64, 65536, 110, xf32=False, fp8=None),
    "gfx942": ArchFacts("gfx942", "Instinct MI300A, MI300X, MI325X (CDNA 3)", 64, 65536, 304, xf32=True, fp8="e4m3fnuz/e5m2fnuz"),
}


def base_arch(gcn_arch_name: str) -> str:
    """The architecture of a gcnArchName without its target features: "gfx90a:sramecc+:xnack-" -> "gfx90a"."""
    return gcn_arch_name.split(":", 1)[0].strip()


def gfx(*names: str) -> Archs:
    """Kernels for exactly the named architectures."""
    allowed = frozenset(names)
    return Archs(lambda arch: arch in allowed, " or ".join(names))


def with_feature(feature: str) -> Archs:
    """Kernels for the architectures of :data:`ARCHS` whose matrix cores have ``feature`` ("xf32", "fp8")."""
    names = [a.name for a in ARCHS.values() if getattr(a, feature)]
    allowed = frozenset(names)
    return Archs(lambda arch: arch in allowed, f"{' or '.join(names)} ({feature} matrix instructions)")


#: the hal_triton kernels: wavefront-64 CDNA tables with matrix cores
TRITON_ARCHS = gfx(*ARCHS)
#: vendor libraries and torch's own kernels: whatever AMD GPU torch's ROCm build runs on
ANY_GFX = Archs(lambda arch: arch.startswith("gfx"), "an AMD GPU (gfx...) that torch's ROCm build supports")
#: matrix cores that round float32 inputs (hal's float32 is IEEE float32: such paths are turned off)
XF32 = with_feature("xf32")
#: matrix cores with 8-bit floats
FP8 = with_feature("fp8")


def torch_problem(hip_version: Optional[str], cuda_version: Optional[str]) -> Optional[str]:
    """Why this torch cannot drive AMD GPUs (None for a ROCm build)."""
    if hip_version:
        return None
    build = f"a CUDA {cuda_version} build" if cuda_version else "a CPU build"
    return f"torch is not a ROCm build: install torch from the ROCm wheel index (torch {torch.__version__} here is {build})"


def probe_reason(torch_reason: Optional[str], runtime_reason: Optional[str]) -> Optional[str]:
    """Every reason the backend cannot run here, in the order a user fixes them (None when it can)."""
    reasons = [r for r in (torch_reason, runtime_reason) if r]
    return "; ".join(reasons) or None


def probe() -> Optional[str]:
    """The backend's availability probe (runs once, when hal first needs it)."""
    return probe_reason(torch_problem(getattr(torch.version, "hip", None), torch.version.cuda), _hip.runtime_problem())


@functools.lru_cache(maxsize=None)
def properties(index: int) -> _hip.DeviceProperties:
    """hipGetDeviceProperties of device ``index``, read once."""
    return _hip.device_properties(index)


def devices() -> list[DeviceInfo]:
    out = []
    for i in range(_hip.device_count().count):
        p = properties(i)
        out.append(DeviceInfo(index=i, name=p.name, vendor="AMD", arch=base_arch(p.gcn_arch_name), memory_bytes=p.total_memory))
    return out


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def arch(device: Any) -> Optional[str]:
    """The architecture of a ROCm device ("gfx90a"; None for other devices). torch names ROCm
    devices "cuda"."""
    if not isinstance(device, torch.device) or device.type != "cuda" or not getattr(torch.version, "hip", None):
        return None
    return base_arch(properties(_index(device)).gcn_arch_name)


def compute_units(device: torch.device) -> int:
    """Compute units of a ROCm device."""
    return properties(_index(device)).compute_units


def model_slug(name: str, gcn_arch_name: str) -> str:
    """A file-name-safe identity of a device model from its properties: "amd-instinct-mi250x-gfx90a"."""
    words = "".join(ch if ch.isalnum() else " " for ch in name.lower()).split()
    return "-".join([*words, base_arch(gcn_arch_name)])


def slug(device: torch.device) -> str:
    """The :func:`model_slug` of a ROCm device (the autotune cache's file name)."""
    p = properties(_index(device))
    return model_slug(p.name, p.gcn_arch_name)
