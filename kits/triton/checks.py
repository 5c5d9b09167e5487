"""Capability checks shared by the Triton kernels of every GPU plugin (reasons as sentences)."""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import torch

from hal.arrays import flat_runs
from hal.plugin import Inputs

from . import unavailable_reason

Check = Callable[[Inputs], Optional[list[str]]]


def triton_check(inputs: Inputs) -> list[str]:
    """Triton is importable."""
    reason = unavailable_reason()
    return [reason] if reason else []


def flat_lists(*names: str) -> Check:
    """The named list arguments can be walked as flat runs of memory (see hal.arrays.flat_runs):
    dense tensors, alike across the lists at each index, contiguous or in another memory format
    (channels_last convolution weights with their gradients and moments)."""

    def check(inputs: Inputs) -> list[str]:
        lists = [inputs[n] for n in names if inputs[n] is not None]
        if flat_runs(*lists):
            return []
        return [f"{', '.join(names)} hold tensors with gaps or overlaps, or differing in memory layout at one index "
                "(the multi-tensor kernel walks each as one run of memory)"]

    return check


def contiguous_vectors(*names: str) -> Check:
    """The named 1-D arguments, when given, have unit stride (written or read in place)."""

    def check(inputs: Inputs) -> list[str]:
        bad = [n for n in names if isinstance(inputs[n], torch.Tensor) and inputs[n].stride(-1) != 1]
        return [f"{', '.join(bad)} must have unit stride (the kernel addresses them in place)"] if bad else []

    return check


# --- FP8: which 8-bit float formats a device's hardware has ------------------------------------

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

    NVIDIA GPUs have the OCP formats (e4m3fn, e5m2) from compute capability 8.9; AMD's gfx942 has
    the fnuz formats, gfx950 the OCP ones. CPU tensors answer empty: there the Triton kernels run
    under the interpreter, which emulates every format. The architecture is read once per device.
    """
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type != "cuda":
        return []
    return fp8_arch_reasons(_cached_arch(device.index if device.index is not None else torch.cuda.current_device()), formats)


@functools.lru_cache(maxsize=None)
def _cached_arch(index: int) -> str:
    return _device_arch(torch.device("cuda", index))


#: the largest block the FP8 block-wise quantisation tiles (one program spans a block's columns)
FP8_MAX_BLOCK = 1024


def fp8_block_reason(block_size: int) -> Optional[str]:
    """Why the Triton block-wise FP8 quantisation cannot tile ``block_size`` (None when it can)."""
    if block_size > FP8_MAX_BLOCK:
        return f"block_size {block_size} is above {FP8_MAX_BLOCK} (one program of the Triton kernel spans a block's columns)"
    return None


def fp8_gemm_block_reason(block_size: int) -> Optional[str]:
    """Why the Triton FP8 GEMM cannot apply block scales of ``block_size`` (None when it can): its
    K steps must lie within one scale block and be at least 32 deep (the FP8 tensor-core shape)."""
    if block_size < 32 or block_size & (block_size - 1):
        return f"block scales of block_size {block_size}: the Triton FP8 GEMM needs a power of two of at least 32 (its K steps lie within one scale block)"
    return None
