"""Type vocabulary of op signatures.

An op is declared as a typed Python function and its signature is the op's schema. The annotations
below carry a :class:`Kind` (through ``typing.Annotated``) so that the registry knows which
parameters are arrays, lists of arrays or array-or-scalar values, and which are static options.
Anything not annotated with one of these is a static option (an int, a string, a tuple ...).
"""

from __future__ import annotations

import enum
from typing import Annotated, Optional, Sequence, Tuple, Union

import numpy as np
import torch

#: An array as hal accepts it: a ``torch.Tensor`` on any device or a NumPy array on the CPU.
ArrayLike = Union[torch.Tensor, np.ndarray]


class Kind(enum.Enum):
    """How the dispatcher treats a parameter."""

    TENSOR = "tensor"  # an array, required
    OPTIONAL_TENSOR = "optional tensor"  # an array or None
    TENSOR_LIST = "tensor list"  # a list or tuple of arrays
    OPTIONAL_TENSOR_LIST = "optional tensor list"  # a list of arrays, or None
    SCALAR_OR_TENSOR = "scalar or tensor"  # a Python number or an array (0-d or 1-d usually)
    OPTIONAL_SCALAR_OR_TENSOR = "optional scalar or tensor"
    STATIC = "static"  # a Python value that shapes the computation (stride, act, dim ...)


Tensor = Annotated[ArrayLike, Kind.TENSOR]
OptionalTensor = Annotated[Optional[ArrayLike], Kind.OPTIONAL_TENSOR]
TensorList = Annotated[Sequence[ArrayLike], Kind.TENSOR_LIST]
OptionalTensorList = Annotated[Optional[Sequence[ArrayLike]], Kind.OPTIONAL_TENSOR_LIST]
ScalarOrTensor = Annotated[Union[float, ArrayLike], Kind.SCALAR_OR_TENSOR]
OptionalScalarOrTensor = Annotated[Optional[Union[float, ArrayLike]], Kind.OPTIONAL_SCALAR_OR_TENSOR]

#: An int or a pair of ints (height, width), as ``F.conv2d``'s stride and dilation.
IntPair = Union[int, Tuple[int, int]]
#: ``F.conv2d`` padding: an int, a pair, or the strings "same" / "valid".
Padding = Union[int, Tuple[int, int], str]
#: Which gradients a backward op computes (its optional last parameter ``output_mask``).
OutputMask = Tuple[bool, ...]
#: A shape: an int or a sequence of ints.
ShapeLike = Union[int, Sequence[int]]

#: Kinds whose values are arrays (or may be).
ARRAY_KINDS = frozenset(
    {
        Kind.TENSOR,
        Kind.OPTIONAL_TENSOR,
        Kind.TENSOR_LIST,
        Kind.OPTIONAL_TENSOR_LIST,
        Kind.SCALAR_OR_TENSOR,
        Kind.OPTIONAL_SCALAR_OR_TENSOR,
    }
)


def kind_of(annotation: object) -> Kind:
    """The :class:`Kind` carried by an annotation, ``Kind.STATIC`` when it carries none."""
    for meta in getattr(annotation, "__metadata__", ()):
        if isinstance(meta, Kind):
            return meta
    return Kind.STATIC
