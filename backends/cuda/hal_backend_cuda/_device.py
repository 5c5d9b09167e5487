"""Is a usable NVIDIA GPU here, and what is it: the backend's probe, device list, architecture
names ("sm_90") and the architecture predicates kernels state their support with."""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import torch

from hal.plugin import Archs, DeviceInfo

#: The oldest architecture the kernels are built and tested for (Ampere): bf16 tensor cores,
#: cp.async, and the cuDNN/cuBLASLt paths torch uses.
MIN_CAPABILITY = (8, 0)


def probe_reason(
    cuda_version: Optional[str],
    hip_version: Optional[str],
    device_count: int,
    capabilities: Sequence[tuple[int, int]],
    names: Sequence[str] = (),
) -> Optional[str]:
    """Why the backend cannot run here, from what torch reports (None when it can)."""
    if hip_version:
        return f"torch is a ROCm build (HIP {hip_version}); NVIDIA GPUs need a CUDA build of torch (the rocm backend serves this one)"
    if cuda_version is None:
        return "torch is a CPU build (torch.version.cuda is None); install a CUDA build of torch to use NVIDIA GPUs"
    if device_count == 0:
        return f"no CUDA device (torch {torch.__version__} built for CUDA {cuda_version} sees none; check the driver and CUDA_VISIBLE_DEVICES)"
    need = MIN_CAPABILITY
    if all(tuple(c) < need for c in capabilities):
        major, minor = capabilities[0]
        name = f" ({names[0]})" if names else ""
        return f"compute capability {major}.{minor} < {need[0]}.{need[1]} needed by hal-backend-cuda{name}"
    return None


def probe() -> Optional[str]:
    """The backend's availability probe (runs once, when hal first needs it)."""
    cuda, hip = torch.version.cuda, getattr(torch.version, "hip", None)
    if hip or cuda is None:
        return probe_reason(cuda, hip, 0, [])
    count = torch.cuda.device_count()
    caps = [torch.cuda.get_device_capability(i) for i in range(count)]
    names = [torch.cuda.get_device_name(i) for i in range(count)]
    return probe_reason(cuda, hip, count, caps, names)


def devices() -> list[DeviceInfo]:
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(DeviceInfo(index=i, name=p.name, vendor="NVIDIA", arch=f"sm_{p.major}{p.minor}", memory_bytes=int(p.total_memory)))
    return out


def arch(device: Any) -> Optional[str]:
    """The architecture name of a CUDA device, "sm_<major><minor>" (None for other devices)."""
    if not isinstance(device, torch.device) or device.type != "cuda":
        return None
    return _arch(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}"


def sm_number(name: str) -> int:
    """90 for "sm_90", 100 for "sm_100"; -1 for a name that is not an NVIDIA architecture."""
    digits = name[3:] if name.startswith("sm_") else ""
    return int(digits) if digits.isdigit() else -1


def sm(minimum: int) -> Archs:
    """Kernels for compute capability ``minimum`` (80: sm_80, Ampere) and newer."""
    return Archs(lambda name: sm_number(name) >= minimum, f"sm_{minimum} or newer")


#: what every kernel of this backend needs (MIN_CAPABILITY as an architecture predicate)
SM80 = sm(MIN_CAPABILITY[0] * 10 + MIN_CAPABILITY[1])


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; a small stand-in for CPU tensors (interpreter runs)."""
    if device.type != "cuda":
        return 4
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def slug(device: torch.device) -> str:
    """A file-name-safe identity of a device model: "nvidia-h200-sm90"."""
    p = torch.cuda.get_device_properties(device)
    name = "".join(ch if ch.isalnum() else "-" for ch in p.name.lower()).strip("-")
    return f"{name}-sm{p.major}{p.minor}"
