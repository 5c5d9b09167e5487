"""Ops and kernels from your own code, in the running process: hal's ``torch.library.custom_op``.

Entry-point plugins (``pip install`` a distribution with a ``hal.backends`` entry point) are how a
vendor ships a backend; this module is how a user adds an op, a kernel or a whole backend from a
script or a notebook, without packaging anything::

    import hal, hal.library
    from hal.types import Tensor

    @hal.library.declare(dtypes=("float32", "float64"), tolerances=hal.library.ELEMENTWISE,
                         backward="cube_backward", gradients="x")
    def cube(x: Tensor) -> Tensor:
        '''x ** 3'''

    @cube.fake
    def _(a):
        return a["x"].new_empty(a["x"].shape)

    @hal.library.register_kernel("cube", backend="cpu", name="mine", priority=100)
    def cube_cpu(x):
        return x * x * x

    y = hal.ops.cube(t)                 # also torch.ops.hal.cube, autograd, torch.compile, hal.explain

What each step gives:

- :func:`declare` (``hal.registry.declare``, the decorator of hal's own ``ops/``): the op's
  declaration from a typed function, ``hal.ops.<name>``, ``torch.ops.hal.<name>`` with its fake
  kernel (``@op.fake``) and, when it names a ``backward`` op declared the same way, autograd and
  torch.compile (``fullgraph=True``) through it. ``@op.checker``, ``@op.composite``, ``@op.empty``
  and ``@op.values`` complete a declaration as in ``ops/``.
- :func:`register_kernel`: a kernel of any op (yours or hal's) on a backend that exists here, an
  installed one (``cpu``, ``cuda`` ...) or one defined with :func:`define_backend`; its signature
  and dtypes are checked against the declaration at once. Decisions made before are dropped, so
  the next call decides again with the new kernel among the candidates; ``hal.explain`` lists it.
- :func:`define_backend`: a backend of this process (a device type, a priority, an availability
  probe), whose kernels are registered with :func:`register_kernel`.
- Conformance: register the op's cases with ``hal.conformance.cases.register_cases`` and run
  ``hal.conformance.runner.Suite(backend=..., ops=[...])`` in the same process; the reference is a
  ``cpu_ref`` kernel registered the same way (``register_kernel(op, backend="cpu_ref", ...)``, a
  NumPy function computing in float64).

Registrations last for the process (like ``torch.library``); a name used twice is refused. A
runtime installed by hand (``hal.dispatch.install``) gets this process's registrations only when
they are made after it. See docs/library.md.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, Mapping, Optional, Union

from hal.errors import InvalidArgumentError, PluginError
from hal.ops import _tolerances as _presets
from hal.plugin import Archs, DeviceInfo, Inputs, Plugin, Reasons
from hal.registry import Autocast, Tolerance, declare
from hal.runtime import IN_PROCESS
from hal.version import __version__

#: the plugin holding kernels added to backends this process did not define
KERNELS_PLUGIN = "in_process"

_LOCK = threading.RLock()

#: tolerance presets of hal's own ops, for declarations made here: ELEMENTWISE (no accumulation),
#: REDUCTION (atol widened by the square root of the op's reduction length)
ELEMENTWISE: Mapping[str, Tolerance] = _presets.ELEMENTWISE
REDUCTION: Mapping[str, Tolerance] = _presets.REDUCTION


def define_backend(
    name: str,
    *,
    priority: int,
    device_types: Iterable[str],
    probe: Callable[[], Optional[str]] = lambda: None,
    devices: Optional[Callable[[], list[DeviceInfo]]] = None,
    arch: Optional[Callable[[Any], Optional[str]]] = None,
    array_api: str = "torch",
) -> None:
    """Define backend ``name`` in this process: it serves ``device_types`` (``"cpu"``, ``"cuda"``)
    at ``priority`` (higher is tried first; hal's ``cpu`` backend has 50, ``cpu_ref`` 0), is usable
    when ``probe()`` returns None (else the sentence it returns says why not), and its kernels take
    ``array_api`` arrays by default ("torch" or "numpy"). Refused (InvalidArgumentError) when a
    backend of that name exists already."""
    from hal.dispatch import DISPATCHER

    with _LOCK:
        taken = set(DISPATCHER.runtime().backends) | {p.backend.name for p in IN_PROCESS.values() if p.backend is not None}
        if name in taken or name == KERNELS_PLUGIN:
            raise InvalidArgumentError("hal.library.define_backend", "name", "the name of no backend installed or defined yet",
                                       f"{name!r}, which exists (backends: {', '.join(sorted(taken))})")
        plugin = Plugin(name, __version__, summary="defined in this process (hal.library)")
        listed = devices or (lambda: [DeviceInfo(0, name, "in-process", "")])
        plugin.define_backend(priority=priority, device_types=tuple(device_types), probe=probe, devices=listed, arch=arch, array_api=array_api)
        IN_PROCESS[name] = plugin
        _refresh()


def register_kernel(
    op: str,
    *,
    backend: str,
    name: str,
    priority: int = 0,
    dtypes: Optional[Iterable[str]] = None,
    archs: Optional[Archs] = None,
    check: Optional[Callable[[Inputs], Reasons]] = None,
    array_api: Optional[str] = None,
    fused: bool = True,
    differentiable: Union[bool, Callable[[Inputs], Reasons]] = False,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated function as kernel ``name`` of ``op`` on ``backend`` and return it
    unchanged (the arguments of :meth:`hal.plugin.Plugin.kernel`, which checks the function's
    parameters and dtypes against the op's declaration now). ``backend`` must exist here: an
    installed backend or one made with :func:`define_backend`; ``name`` must be new for the op on
    that backend. The dispatcher forgets its decisions, so the kernel is a candidate from the next
    call on."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        from hal.dispatch import DISPATCHER

        with _LOCK:
            rt = DISPATCHER.runtime()
            own = IN_PROCESS.get(backend)
            if backend not in rt.backends and own is None:
                raise InvalidArgumentError(
                    "hal.library.register_kernel", "backend", f"an installed backend ({', '.join(sorted(rt.backends)) or 'none'}) "
                    "or one defined with hal.library.define_backend", repr(backend))
            if any(k.name == name for k in rt.kernels(op, backend)):
                raise InvalidArgumentError("hal.library.register_kernel", "name", f"a kernel name {op} does not have on {backend} yet",
                                           repr(name))
            plugin = own if own is not None else IN_PROCESS.setdefault(KERNELS_PLUGIN, Plugin(KERNELS_PLUGIN, __version__))
            try:
                plugin.kernel(op, name=name, backend=backend, priority=priority, dtypes=dtypes, archs=archs, check=check,
                              array_api=array_api, fused=fused, differentiable=differentiable)(fn)
            except PluginError as exc:
                raise InvalidArgumentError("hal.library.register_kernel", "fn", "a kernel matching the op's declaration",
                                           str(exc)) from None
            _refresh()
        return fn

    return register


def _refresh() -> None:
    """Put this process's plugins into the dispatcher's runtime (one is built on first use
    otherwise, with them in it); cached decisions are dropped."""
    from hal.dispatch import DISPATCHER

    with DISPATCHER._lock:
        if DISPATCHER._runtime is not None:
            DISPATCHER.install(DISPATCHER._runtime.with_in_process())


__all__ = ["declare", "register_kernel", "define_backend", "Autocast", "Tolerance", "ELEMENTWISE", "REDUCTION", "KERNELS_PLUGIN"]
