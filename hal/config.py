"""Run-time choices a user makes: `hal.use(...)` scopes (per thread) and HAL_* environment variables.

Environment variables are read when a dispatch decision is made (the first call with a given input
signature) and cached with it; call :func:`hal.dispatch.reset` after changing them in a running
process. ``hal.use`` scopes are part of the decision cache key and take effect immediately.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from typing import Iterator, Mapping, Optional, Union

log = logging.getLogger("hal")


@dataclasses.dataclass(frozen=True)
class Overrides:
    """The forced backend, kernels and strictness in effect (hashable: part of the cache key)."""

    backend: Optional[str] = None
    #: kernels forced per op, as sorted (op, kernel) pairs.
    kernels: tuple[tuple[str, str], ...] = ()
    #: a kernel name forced for every op that has a kernel of that name.
    kernel_any: Optional[str] = None
    strict: Optional[bool] = None


class _Local(threading.local):
    """Per-thread state; the class attribute is the default every new thread sees (reading a missing
    attribute of a plain threading.local raises internally, which costs ~0.5 us on the hot path)."""

    overrides: Optional[Overrides] = None


_local = _Local()

#: how many ``hal.use`` scopes are open in all threads: while none is, the hot path skips reading
#: the thread-local scope (a list so that generated code can read it without a global lookup).
ACTIVE_SCOPES = [0]
_scopes_lock = threading.Lock()


def current() -> Optional[Overrides]:
    """The innermost ``hal.use`` scope of this thread, or None."""
    return _local.overrides


@contextlib.contextmanager
def use(
    backend: Optional[str] = None,
    kernel: Union[None, str, Mapping[str, str]] = None,
    strict: Optional[bool] = None,
) -> Iterator[Overrides]:
    """Force a backend and/or kernel, or strict mode, for calls made in this thread inside the scope.

    ``kernel`` is either a mapping ``{op: kernel}`` (the op must then run that kernel or raise) or a
    kernel name, forced for every op that has a kernel of that name ("composite" forces the op's
    decomposition). Scopes nest; an inner scope keeps what it does not set.
    """
    saved = current()
    outer = saved or Overrides()
    kernels = dict(outer.kernels)
    kernel_any = outer.kernel_any
    if isinstance(kernel, str):
        kernel_any = kernel
    elif kernel is not None:
        kernels.update({str(op): str(k) for op, k in dict(kernel).items()})
    inner = Overrides(
        backend=backend if backend is not None else outer.backend,
        kernels=tuple(sorted(kernels.items())),
        kernel_any=kernel_any,
        strict=strict if strict is not None else outer.strict,
    )
    with _scopes_lock:
        ACTIVE_SCOPES[0] += 1
    _local.overrides = inner
    try:
        yield inner
    finally:
        _local.overrides = saved
        with _scopes_lock:
            ACTIVE_SCOPES[0] -= 1


@dataclasses.dataclass(frozen=True)
class Choice:
    """What is forced for one op call, after combining ``hal.use`` with the environment."""

    backend: Optional[str]
    backend_source: str  # "hal.use" or "HAL_BACKEND"
    kernel: Optional[str]
    kernel_source: str
    #: True when the kernel must run (per-op force); False when it is a preference (kernel_any).
    kernel_required: bool
    strict: bool


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def choice_for(op: str, overrides: Optional[Overrides]) -> Choice:
    """Combine a ``hal.use`` scope with HAL_BACKEND, HAL_KERNEL_<OP> and HAL_STRICT for ``op``."""
    o = overrides or Overrides()
    backend, backend_source = o.backend, "hal.use(backend=...)"
    if backend is None and os.environ.get("HAL_BACKEND"):
        backend, backend_source = os.environ["HAL_BACKEND"].strip(), "HAL_BACKEND"
    kernel, source, required = dict(o.kernels).get(op), "hal.use(kernel=...)", True
    env_name = f"HAL_KERNEL_{op.upper()}"
    if kernel is None and os.environ.get(env_name):
        kernel, source = os.environ[env_name].strip(), env_name
    if kernel is None and o.kernel_any is not None:
        kernel, source, required = o.kernel_any, "hal.use(kernel=...)", False
    strict = o.strict if o.strict is not None else _env_flag("HAL_STRICT")
    return Choice(backend, backend_source, kernel, source, required, strict)


def configure_logging() -> None:
    """Apply HAL_LOG (debug, info, warning) to the "hal" logger."""
    level = os.environ.get("HAL_LOG", "").strip().upper()
    if not level:
        return
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        log.warning("hal: HAL_LOG=%s is not one of debug, info, warning, error; ignored", level.lower())
        return
    log.setLevel(level)
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
