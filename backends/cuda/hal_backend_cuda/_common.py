"""What the CUDA plugin's own (vendor-library) kernel modules share: registration defaults, the
IEEE float32 guard around cuDNN and cuBLAS calls."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch

from hal.plugin import Archs, Inputs

from . import plugin
from ._device import SM80

HALF = ("float16", "bfloat16")
FLOATS = ("float16", "bfloat16", "float32", "float64")
NOT_F64 = ("float16", "bfloat16", "float32")

Check = Callable[[Inputs], Optional[list[str]]]


def kernel(op: str, *, name: str, priority: Optional[int] = None, dtypes: Optional[Iterable[str]] = None, checks: Iterable[Check] = (),
           archs: Archs = SM80, differentiable: Union[bool, Check] = False,
           contexts: Optional[Mapping[str, int]] = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a kernel of the cuda backend (sm_80 and newer unless ``archs`` says otherwise);
    ``differentiable``: made of torch's differentiable ops; ``priority`` in every context, or
    ``contexts``: the contexts it serves with its priority in each (see :meth:`hal.plugin.Plugin.kernel`)."""
    all_checks = list(checks)

    def check(inputs: Inputs) -> list[str]:
        return [r for c in all_checks for r in (c(inputs) or [])]

    return plugin.kernel(op, name=name, priority=priority, dtypes=dtypes, archs=archs, check=check if all_checks else None,
                         differentiable=differentiable, contexts=contexts)


def not_float32(inputs: Inputs) -> list[str]:
    """A ``differentiable`` check for kernels around cuDNN/cuBLAS calls held to IEEE float32 by
    :class:`ieee_fp32`: torch's recorded backward would run later, outside that guard, where
    PyTorch's defaults let cuDNN round float32 to TF32."""
    return ["float32: torch's recorded backward would run without the IEEE float32 guard"] if inputs.dtype == "float32" else []


class ieee_fp32:
    """Around a cuDNN or cuBLAS call on float32 data: TensorFloat-32 off for the call.

    hal's float32 is IEEE float32 on every backend (the conformance suite holds float32 kernels to
    float32 accuracy); PyTorch lets cuDNN convolutions round float32 operands to TF32 by default.
    Users who want TF32 speed use bfloat16 or float16 data. Other dtypes pass through untouched.
    The flags are process-wide, as PyTorch's own ``torch.backends.cudnn.flags`` are.
    """

    __slots__ = ("_on", "_saved")

    def __init__(self, dtype: torch.dtype) -> None:
        self._on = dtype == torch.float32

    def __enter__(self) -> None:
        if self._on:
            self._saved = (torch._C._get_cudnn_allow_tf32(), torch._C._get_cublas_allow_tf32())
            torch._C._set_cudnn_allow_tf32(False)
            torch._C._set_cublas_allow_tf32(False)

    def __exit__(self, *exc: object) -> None:
        if self._on:
            torch._C._set_cudnn_allow_tf32(self._saved[0])
            torch._C._set_cublas_allow_tf32(self._saved[1])

