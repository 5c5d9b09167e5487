"""``hal.use(...)``: force a backend, kernels or strict mode for the calls of one thread, in a scope.

The arguments are checked when the scope opens: a backend is a name (installed or not: forcing a
missing one raises at the first call with its install hint), ``kernel`` a name or a mapping of
declared op names to kernel names some installed backend has for that op (or ``"composite"`` where
the op has one), ``strict`` a bool. Anything else is a :class:`hal.InvalidArgumentError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Mapping, Optional, Union

from hal import config
from hal.config import Overrides
from hal.dispatch import kernel_names
from hal.errors import InvalidArgumentError


def _check_kernels(kernel: Mapping[str, str]) -> dict[str, str]:
    out = {}
    for op, name in dict(kernel).items():
        if not isinstance(op, str) or not kernel_names(op):
            raise InvalidArgumentError(
                "hal.use", "kernel", "a mapping whose keys are declared op names (hal.list_ops()) or collectives of hal.dist",
                f"the key {op!r}",
            )
        if not isinstance(name, str):
            raise InvalidArgumentError("hal.use", f"kernel[{op!r}]", "a kernel name (a string)", repr(name))
        known = kernel_names(op)
        if name not in known:
            raise InvalidArgumentError(
                "hal.use", f"kernel[{op!r}]", f"one of the kernels of {op}: {', '.join(sorted(known)) or 'none installed'}", repr(name)
            )
        out[op] = name
    return out


@contextlib.contextmanager
def use(
    backend: Optional[str] = None,
    kernel: Union[None, str, Mapping[str, str]] = None,
    strict: Optional[bool] = None,
) -> Iterator[Overrides]:
    """Force a backend and/or kernel, or strict mode, for calls made in this thread inside the scope.

    ``kernel`` is either a mapping ``{op: kernel}`` (the op must then run that kernel or raise) or a
    kernel name, forced for every op that has a kernel of that name ("composite" forces the
    decomposition of the ops that have one and leaves the others alone). Scopes nest; an inner
    scope keeps what it does not set.
    """
    if backend is not None and not isinstance(backend, str):
        raise InvalidArgumentError("hal.use", "backend", "a backend name (a string) or None", repr(backend))
    if kernel is not None and not isinstance(kernel, (str, Mapping)):
        raise InvalidArgumentError("hal.use", "kernel", "a kernel name, a mapping {op: kernel name}, or None", repr(kernel))
    if strict is not None and not isinstance(strict, bool):
        raise InvalidArgumentError("hal.use", "strict", "True, False or None", repr(strict))
    outer = config.current() or Overrides()
    kernels = dict(outer.kernels)
    kernel_any = outer.kernel_any
    if isinstance(kernel, str):
        kernel_any = kernel
    elif kernel is not None:
        kernels.update(_check_kernels(kernel))
    inner = dataclasses.replace(
        outer,
        backend=backend if backend is not None else outer.backend,
        kernels=tuple(sorted(kernels.items())),
        kernel_any=kernel_any,
        strict=strict if strict is not None else outer.strict,
        explaining=False,
    )
    saved = config.enter(inner)
    try:
        yield inner
    finally:
        config.leave(saved)
