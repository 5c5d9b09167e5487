"""Is a usable NVIDIA GPU here, and what is it: the backend's probe, device list and capability."""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import torch

from hal.plugin import DeviceInfo

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


def capability(device: Any) -> Optional[tuple[int, int]]:
    if not isinstance(device, torch.device) or device.type != "cuda":
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))  # type: ignore[return-value]


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
