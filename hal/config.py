"""Run-time choices a user makes: the state of `hal.use(...)` scopes (per thread) and HAL_* variables.

Environment variables are read when a dispatch decision is made (the first call with a given input
signature) and cached with it; call :func:`hal.dispatch.reset` after changing them in a running
process. ``hal.use`` scopes (:mod:`hal.overrides`) are part of the decision cache key and take
effect immediately. A value hal cannot read (``HAL_STRICT=maybe``, ``HAL_KERNEL_SOFTMAXX``) is an
error at the first decision, never silently ignored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
from typing import Any, Callable, Iterator, Optional

from hal.errors import InvalidArgumentError
from hal.registry import OPS

log = logging.getLogger("hal")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class Overrides:
    """The forced backend, kernels and strictness in effect (hashable: part of the cache key)."""

    backend: Optional[str] = None
    #: kernels forced per op, as sorted (op, kernel) pairs.
    kernels: tuple[tuple[str, str], ...] = ()
    #: a kernel name forced for every op that has a kernel of that name.
    kernel_any: Optional[str] = None
    strict: Optional[bool] = None
    #: set by ``hal.explain`` while it follows a decomposition: ops record their decision and
    #: return results of the right shape without running (never set by ``hal.use``).
    explaining: bool = False
    #: calls made for a step that will be replayed from a CUDA graph (:func:`hal.graphs.device_bound`):
    #: kernels are ranked by their graph priority.
    device_bound: bool = False
    #: HAL_TUNE's setting for the scope ("off", "cached", "on"; None: the environment's), as
    #: :func:`hal.tuning.tune` sets it.
    tune: Optional[str] = None
    #: calls made while :mod:`hal.dispatch.measure` times routes: nothing counts in ``hal.stats()``.
    measuring: bool = False
    #: calls of a step measured for torch.compile graphs (:func:`hal.tuning.for_compile`).
    for_compile: bool = False
    #: sees every call planned in the scope, ``observer(decl, route, run, args) -> result``: it runs
    #: the call (``run(*args)``, or otherwise) and returns its result. ``hal conformance --model``
    #: records a model's calls with it (:mod:`hal.conformance.model_record`); never set by ``hal.use``.
    observer: Optional[Callable[..., Any]] = None

    @property
    def forces(self) -> bool:
        """Whether the scope forces anything (a scope of ``hal.explain`` or ``device_bound`` alone
        does not)."""
        return bool(self.backend or self.kernels or self.kernel_any or self.strict is not None)


class _Local(threading.local):
    """Per-thread state; the class attribute is the default every new thread sees (reading a missing
    attribute of a plain threading.local raises internally, which costs ~0.5 us on the hot path)."""

    overrides: Optional[Overrides] = None


_local = _Local()

#: how many ``hal.use`` scopes are open in all threads: while none is, the hot path skips reading
#: the thread-local scope (a list so that generated code can read it without a global lookup).
ACTIVE_SCOPES = [0]
#: how many of those change what a call runs at run time (:func:`decides_at_run_time`): while one is
#: open, torch.compile keeps hal's calls as opaque nodes deciding as the compiled code runs, so that
#: the scope of each run is obeyed. A ``device_bound`` or ``tune`` scope alone is not counted: it
#: ranks kernels, which the trace can do once (``hal.graphs.graphed`` warms a compiled step up, and
#: so traces it, inside ``device_bound``; counting it kept every hal call of a compiled step out of
#: the graph, the H200's Llama step 12.7 ms against torch.compile's 10.1).
RUN_TIME_SCOPES = [0]
_scopes_lock = threading.Lock()
_RANKING_ONLY = {"device_bound", "tune"}


@functools.lru_cache(maxsize=256)
def decides_at_run_time(overrides: Optional[Overrides]) -> bool:
    """Whether a scope changes a call's route beyond ranking kernels: a forced backend or kernel,
    strictness, explain's walk, measurement, an observer, a step measured for torch.compile."""
    if overrides is None:
        return False
    return any(getattr(overrides, f.name) != f.default for f in dataclasses.fields(overrides) if f.name not in _RANKING_ONLY)


def current() -> Optional[Overrides]:
    """The innermost ``hal.use`` scope of this thread, or None."""
    return _local.overrides


def enter(overrides: Optional[Overrides]) -> Optional[Overrides]:
    """Make ``overrides`` this thread's scope; returns the one it replaces (give it to :func:`leave`)."""
    saved = _local.overrides
    with _scopes_lock:
        ACTIVE_SCOPES[0] += 1
        RUN_TIME_SCOPES[0] += decides_at_run_time(overrides)
    _local.overrides = overrides
    return saved


def leave(saved: Optional[Overrides]) -> None:
    """Close the scope opened by :func:`enter`, restoring ``saved``."""
    closing = _local.overrides
    _local.overrides = saved
    with _scopes_lock:
        ACTIVE_SCOPES[0] -= 1
        RUN_TIME_SCOPES[0] -= decides_at_run_time(closing)


@contextlib.contextmanager
def scope(**changes: Any) -> Iterator[None]:
    """This thread's current scope with ``changes`` (fields of :class:`Overrides`) for the duration
    of the block: how :func:`hal.graphs.device_bound`, :func:`hal.tuning.tune`,
    :func:`hal.tuning.for_compile` and measurement mark the calls made inside them."""
    saved = enter(dataclasses.replace(current() or Overrides(), **changes))
    try:
        yield
    finally:
        leave(saved)


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
    #: whether torch's autograd may record kernels registered ``differentiable`` (HAL_TORCH_AUTOGRAD,
    #: default on; off: every call needing autograd runs hal's node and the op's backward op).
    torch_autograd: bool = True
    #: consider only kernels made of torch's ops (a torch.compile graph's second decision, see
    #: :meth:`hal.dispatch.Dispatcher.traced_alternative`).
    traceable_only: bool = False
    #: rank kernels by their graph priority (a step replayed from a CUDA graph).
    device_bound: bool = False
    #: HAL_TUNE: "on" (measure where nothing is cached), "cached" or "off" (priority alone).
    tune: str = "on"
    #: the call is made while routes are timed (not counted).
    measuring: bool = False
    #: the decision is for a torch.compile graph (kernel checks see ``Inputs.traced``).
    for_graph: bool = False
    #: also measure, for torch.compile graphs, an opaque kernel against the compiled torch-ops one
    #: (:func:`hal.tuning.for_compile`).
    for_compile: bool = False


def env_flag(name: str, default: bool = False) -> bool:
    """A boolean environment variable: 1/true/yes/on or 0/false/no/off (unset or empty: ``default``)."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise InvalidArgumentError("hal", name, f"one of {', '.join(_TRUE)} or {', '.join(v for v in _FALSE if v)} (or unset)", repr(raw))


def check_environment() -> None:
    """Raise for HAL_KERNEL_<OP> variables that name no declared op (a misspelling would silently
    force nothing)."""
    known = {f"HAL_KERNEL_{name.upper()}" for name in OPS}
    for var in os.environ:
        if var.startswith("HAL_KERNEL_") and var not in known:
            raise InvalidArgumentError(
                "hal", var, "HAL_KERNEL_<OP> for a declared op (see hal.list_ops())",
                f"{var}, which names no op; unset it or correct the name",
            )


def choice_for(op: str, overrides: Optional[Overrides]) -> Choice:
    """Combine a ``hal.use`` scope with HAL_BACKEND, HAL_KERNEL_<OP> and HAL_STRICT for ``op``."""
    o = overrides or Overrides()
    backend, backend_source = o.backend, "hal.use(backend=...)"
    if backend is None and os.environ.get("HAL_BACKEND", "").strip():
        backend, backend_source = os.environ["HAL_BACKEND"].strip(), "HAL_BACKEND"
    kernel, source, required = dict(o.kernels).get(op), "hal.use(kernel=...)", True
    env_name = f"HAL_KERNEL_{op.upper()}"
    if kernel is None and os.environ.get(env_name, "").strip():
        kernel, source = os.environ[env_name].strip(), env_name
    if kernel is None and o.kernel_any is not None:
        kernel, source, required = o.kernel_any, "hal.use(kernel=...)", False
    strict = o.strict if o.strict is not None else env_flag("HAL_STRICT")
    return Choice(backend, backend_source, kernel, source, required, strict, env_flag("HAL_TORCH_AUTOGRAD", True),
                  device_bound=o.device_bound, tune=o.tune or tune_mode(), measuring=o.measuring, for_compile=o.for_compile)


TUNE_MODES = ("on", "cached", "off")


def tune_mode() -> str:
    """HAL_TUNE: "on" (the default), "cached" or "off"; anything else is an error."""
    raw = os.environ.get("HAL_TUNE", "")
    value = raw.strip().lower() or "on"
    if value not in TUNE_MODES:
        raise InvalidArgumentError("hal", "HAL_TUNE", "one of on, cached, off (or unset: on)", repr(raw))
    return value


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
