"""Capability checks shared by the Triton kernels of every GPU plugin (reasons as sentences)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from hal.plugin import Inputs

from . import unavailable_reason

Check = Callable[[Inputs], Optional[list[str]]]


def triton_check(inputs: Inputs) -> list[str]:
    """Triton is importable."""
    reason = unavailable_reason()
    return [reason] if reason else []


def contiguous_lists(*names: str) -> Check:
    """Every tensor of the named list arguments is contiguous (multi-tensor tables address them as
    flat runs)."""

    def check(inputs: Inputs) -> list[str]:
        for name in names:
            items = inputs[name]
            if items is not None and any(not t.is_contiguous() for t in items):
                return [f"{name} holds non-contiguous tensors (the multi-tensor kernel addresses flat runs)"]
        return []

    return check


def contiguous_vectors(*names: str) -> Check:
    """The named 1-D arguments, when given, have unit stride (written or read in place)."""

    def check(inputs: Inputs) -> list[str]:
        bad = [n for n in names if isinstance(inputs[n], torch.Tensor) and inputs[n].stride(-1) != 1]
        return [f"{', '.join(bad)} must have unit stride (the kernel addresses them in place)"] if bad else []

    return check
