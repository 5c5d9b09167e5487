"""Which 8-bit float formats a GPU's hardware has, and the capability check of kernels that refuse
FP8 where the hardware has none.

NVIDIA GPUs have the OCP formats (e4m3fn, e5m2) from compute capability 8.9; AMD's gfx942 (CDNA 3)
has the fnuz formats, gfx950 (CDNA 4) the OCP ones. The answer is a device fact, not a kernel's:
``hal.fp8`` asks it when an FP8 layer is built, the eager emulation, the Triton kit and the vendor
plugins' FP8 kernels ask it when they are chosen, so every one of them gives the same reasons.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from hal.plugin import Inputs

#: the OCP formats (NVIDIA from sm_89, AMD from gfx950) and AMD's fnuz formats (gfx942)
OCP_FP8 = ("e4m3fn", "e5m2")
FNUZ_FP8 = ("e4m3fnuz", "e5m2fnuz")
#: the FP8 formats of each AMD architecture that has them (CDNA 3: fnuz; CDNA 4: OCP)
AMD_FP8: dict[str, tuple[str, ...]] = {"gfx942": FNUZ_FP8, "gfx950": OCP_FP8}


def _device_arch(device: torch.device) -> str:
    """"sm_90" for an NVIDIA GPU, the gcnArchName without target features ("gfx942") for an AMD one
    (torch names both "cuda")."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if getattr(torch.version, "hip", None):
        name = getattr(torch.cuda.get_device_properties(index), "gcnArchName", "") or ""
        return name.split(":", 1)[0].strip() or "an unknown AMD GPU"
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}"


def fp8_arch_reasons(arch: str, formats: Sequence[str]) -> list[str]:
    """Why a GPU of architecture ``arch`` ("sm_90", "gfx942") lacks hardware FP8 for ``formats``
    (empty when it has them all). Pure data, so it is testable without the GPU."""
    wanted = list(dict.fromkeys(formats))
    unknown = [f for f in wanted if f not in OCP_FP8 + FNUZ_FP8]
    if unknown:
        return [f"unknown FP8 format {', '.join(unknown)} (formats: {', '.join(OCP_FP8 + FNUZ_FP8)})"]
    if arch.startswith("gfx"):
        have = AMD_FP8.get(arch)
        if have is None:
            return [f"FP8 needs gfx942 or later (MI300); this is {arch}"]
        missing = [f for f in wanted if f not in have]
        if missing:
            other = "the fnuz formats are gfx942's" if arch != "gfx942" else "the OCP formats e4m3fn and e5m2 are gfx950's"
            return [f"{arch} has {' and '.join(have)}, not {', '.join(missing)} ({other})"]
        return []
    reasons = []
    digits = arch[3:] if arch.startswith("sm_") else ""
    if not digits.isdigit() or int(digits) < 89:
        reasons.append(f"FP8 needs an NVIDIA GPU of compute capability 8.9 or later (Ada, Hopper); this is {arch}")
    fnuz = [f for f in wanted if f in FNUZ_FP8]
    if fnuz:
        reasons.append(f"the fnuz formats are AMD's (gfx942); NVIDIA GPUs have e4m3fn and e5m2, not {', '.join(fnuz)}")
    return reasons


def fp8_device(device: torch.device, formats: Sequence[str]) -> list[str]:
    """Why ``device`` cannot run FP8 kernels in ``formats`` (empty when it can).

    CPU tensors answer empty: there FP8 is emulated in every format (the eager emulation, the
    Triton kernels under the interpreter). A GPU's architecture is read once per device.
    """
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type != "cuda":
        return []
    return fp8_arch_reasons(_cached_arch(device.index if device.index is not None else torch.cuda.current_device()), formats)


@functools.lru_cache(maxsize=None)
def _cached_arch(index: int) -> str:
    return _device_arch(torch.device("cuda", index))


def _formats(inputs: Inputs) -> tuple[str, ...]:
    """The FP8 formats a call reads or writes."""
    if inputs.op.name == "fp8_scaled_mm":
        return (inputs["a_format"], inputs["b_format"])
    return (inputs["format"],)


def gpu_has_fp8(inputs: Inputs) -> list[str]:
    """GPU tensors only on a GPU with FP8 in the call's formats (:func:`fp8_device`'s reasons): hal
    refuses FP8 where the hardware has none rather than emulate it slowly. CPU tensors are always
    taken (the emulation is the CPU's FP8)."""
    if inputs.device_kind not in ("cuda", "rocm") or not isinstance(inputs.device, torch.device):
        return []
    return fp8_device(inputs.device, _formats(inputs))


#: the capability check of each FP8 op's kernels that emulate FP8 with torch's ops (the eager
#: backend's, and their twins registered by the GPU plugins)
FP8_CHECKS = {op: gpu_has_fp8 for op in ("fp8_quantize", "fp8_quantize_transpose", "fp8_quantize_amax", "fp8_quantize_transpose_amax",
                                         "fp8_quantize_from_amax", "fp8_quantize_transpose_from_amax", "fp8_dequantize", "fp8_scaled_mm")}
