"""The PyTorch function of each activation name that ``hal.ops.linear`` and ``scale_shift_act``
take (``hal.ops.ACTIVATIONS``): the eager backend's kernels apply them, and ``hal.nn``'s fused
modules apply them where they run a model's own modules unfused."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

TORCH_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "none": lambda z: z,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
}
