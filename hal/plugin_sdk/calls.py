"""What a kernel, or its capability check, may ask about the call it serves, answered as the
dispatcher answers it (the dispatcher's and the torch integration's modules are the core's; a
backend asks here):

- :func:`traced`: whether torch.compile is tracing the arguments (fake tensors hold no values to
  read), the one place hal decides it (:mod:`hal.tracing`);
- :func:`needs_autograd`: whether grad mode is on and an array argument requires grad;
- :func:`canonical_args`: the canonical arguments a kernel of an op receives for a call, validated
  by the op (a backend that compiles its kernels ahead of time builds representative calls so).
"""

from __future__ import annotations

from typing import Any, Sequence

from hal.dispatch import needs_autograd, prepare
from hal.registry import OpDecl
from hal.tracing import traced

__all__ = ["traced", "needs_autograd", "canonical_args"]


def canonical_args(decl: OpDecl, args: Sequence[Any]) -> tuple:
    """The arguments a kernel of ``decl`` is called with for the call ``args`` (every parameter,
    positionally): validated, static options canonicalised by the op's checker (stride as a pair,
    dim non-negative ...). Raises :class:`hal.InvalidArgumentError` as the op's call would."""
    return prepare(decl, args).inputs.args
