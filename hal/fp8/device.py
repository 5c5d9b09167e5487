"""Whether a device has FP8, asked when an FP8 layer is built or converted, so a model meant for a
GPU without FP8 fails at construction with the reason rather than at its first training step.

The answer for GPUs is :func:`hal.plugin_sdk.fp8_hardware.fp8_device`'s (the same reasons the FP8
kernels and the eager emulation give the dispatcher): NVIDIA from compute capability 8.9 with the
OCP formats, AMD gfx942 with the fnuz formats and gfx950 with the OCP ones. CPU tensors always pass
(the emulation is the CPU's FP8).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from hal.errors import UnsupportedError
from hal.plugin_sdk.fp8_hardware import fp8_device


def device_reasons(device: Optional[torch.device], formats: Sequence[str]) -> list[str]:
    """Why ``device`` cannot run FP8 in ``formats`` (empty when it can, or for CPU/meta/unknown)."""
    if device is None or device.type != "cuda":
        return []
    return fp8_device(device, tuple(formats))


def unsupported(what: str, device: str, reasons: Sequence[str]) -> UnsupportedError:
    """The error for an FP8 layer on a device without FP8, naming the device and each reason."""
    lines = "\n".join(f"  - {r}" for r in reasons)
    return UnsupportedError(f"{what}: {device} cannot run FP8:\n{lines}\n"
                            "Keep these layers in higher precision on this device (no hal.fp8.convert), "
                            "or run on a GPU with FP8 (NVIDIA sm_89+, AMD gfx942/gfx950).")


def require_fp8(what: str, device: Optional[torch.device], formats: Sequence[str]) -> None:
    """Raise :class:`hal.errors.UnsupportedError` when ``device`` lacks FP8 in ``formats``."""
    reasons = device_reasons(device, formats)
    if reasons:
        raise unsupported(what, str(device), reasons)


__all__ = ["device_reasons", "unsupported", "require_fp8"]
