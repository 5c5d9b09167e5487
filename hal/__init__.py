"""hal: one registry of deep-learning ops, kernels from vendor plugins, a dispatcher that can say why.

    import hal
    y = hal.ops.fused_conv_bn_relu(x, w, None, gamma, beta, mean, var, padding=1)
    print(hal.explain("fused_conv_bn_relu", x, w, None, gamma, beta, mean, var, padding=1))

Plugins (``hal-backend-cpu-ref``, ``hal-backend-cuda``, ``hal-backend-rocm``) are found through the
entry-point group ``hal.backends`` on first use; importing hal loads none of them. Importing hal
puts the core together (:func:`hal.wiring.wire`): the op declarations, the dispatcher and the torch
integration.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, Callable, Optional

from hal.config import configure_logging
from hal.errors import BackendUnavailableError, HalError, InvalidArgumentError, PluginError, UnsupportedError
from hal.plugin import DeviceInfo
from hal.version import API_VERSION, __version__

from hal.wiring import wire

wire()

from hal import ops  # noqa: E402  (declared by wire())
from hal.dispatch import DISPATCHER, explain_call, list_ops, reset_stats, stats  # noqa: E402
from hal.overrides import use  # noqa: E402

configure_logging()


def explain(op_name: str, *args: Any, **kwargs: Any) -> Any:
    """The decision for ``op_name`` called with these arguments, nothing run: the route, the backend
    and kernel, every candidate with the reasons it was passed over, the measured times where
    several could run the call, and the decisions of a decomposition's steps or of the backward.
    Works for the collectives of :mod:`hal.dist` too."""
    return explain_call(DISPATCHER, op_name, *args, **kwargs)


@dataclasses.dataclass(frozen=True)
class BackendRecord:
    """One backend as ``hal.backends()`` reports it (a plugin that failed to load is one too)."""

    name: str
    version: Optional[str]
    priority: Optional[int]
    device_types: tuple[str, ...]
    available: bool
    reason: Optional[str]
    devices: tuple[DeviceInfo, ...]
    load_error: Optional[str]
    _read_notes: Callable[[], tuple[str, ...]] = dataclasses.field(default=tuple, repr=False, compare=False)

    @functools.cached_property
    def notes(self) -> tuple[str, ...]:
        """What works only in part on a usable backend (an optional library missing ...).

        Read on first access, not by ``hal.backends()``: a plugin finds out by importing its
        optional libraries, which listing the backends must not do."""
        return self._read_notes()

    def as_dict(self) -> dict[str, Any]:
        """The record as JSON-ready data, notes included (``hal info --json``)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}
        out["devices"] = [dataclasses.asdict(d) for d in self.devices]
        out["notes"] = list(self.notes)
        return out


def backends() -> list[BackendRecord]:
    """Every installed backend with its availability, devices, and any plugin load error."""
    rt = DISPATCHER.runtime()
    out = []
    for lp in rt.plugins:
        if lp.plugin is not None and lp.plugin.backend is None:
            continue  # a plugin that only adds kernels to other backends
        if lp.plugin is None:
            reason = "disabled by HAL_DISABLE_PLUGINS" if lp.disabled else "plugin failed to load"
            out.append(BackendRecord(lp.name, lp.version, None, (), False, reason, (), str(lp.error) if lp.error else None))
            continue
        state = rt.backends[lp.plugin.backend.name]
        out.append(
            BackendRecord(
                name=state.name,
                version=state.version,
                priority=state.info.priority,
                device_types=state.info.device_types,
                available=state.available,
                reason=state.reason,
                devices=tuple(state.devices),
                load_error=None,
                _read_notes=functools.partial(_notes, state) if state.available else tuple,
            )
        )
    return sorted(out, key=lambda r: (-(r.priority if r.priority is not None else -1), r.name))


def _notes(state: Any) -> tuple[str, ...]:
    """A backend's notes; a notes function that fails is itself a note (hal info must not fail)."""
    try:
        return tuple(str(n) for n in state.info.notes())
    except Exception as exc:  # noqa: BLE001 - a plugin's bug, reported where the user looks
        return (f"its notes could not be read ({type(exc).__name__}: {exc})",)


_LAZY = {"nn", "amp", "optim", "quant", "conformance", "graphs", "tuning", "library", "parallel", "fp8"}


def __getattr__(name: str) -> Any:
    if name == "tune":  # hal.tune(step, *args): hal.tuning.tune
        return importlib.import_module("hal.tuning.runner").tune
    if name in ("optimize", "OptimizedStep"):  # hal.optimize(model, optimizer): hal.fast
        return getattr(importlib.import_module("hal.fast"), name)
    if name in _LAZY:
        return importlib.import_module(f"hal.{name}")
    raise AttributeError(f"module 'hal' has no attribute {name!r}")


__all__ = [
    "__version__",
    "API_VERSION",
    "ops",
    "explain",
    "backends",
    "list_ops",
    "use",
    "tune",
    "optimize",
    "OptimizedStep",
    "stats",
    "reset_stats",
    "HalError",
    "InvalidArgumentError",
    "UnsupportedError",
    "BackendUnavailableError",
    "PluginError",
    "BackendRecord",
]
