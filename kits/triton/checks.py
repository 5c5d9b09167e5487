"""Capability checks shared by the Triton kernels of every GPU plugin (reasons as sentences)."""

from __future__ import annotations

from typing import Callable, Optional

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


# --- FP8 (which formats a device has: hal.plugin_sdk.fp8_hardware) ---------------------------

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
