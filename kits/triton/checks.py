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
