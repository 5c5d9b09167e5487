"""The loaded world: plugins found through entry points, their backends and their kernels.

Plugins are discovered with stevedore over the entry-point group ``hal.backends`` on first use,
never at ``import hal``. A plugin that fails to import, raises while registering, or was built for
another major plugin-API version is kept as a :class:`LoadedPlugin` with its error: ``hal info``
shows it and every dispatch error concerning its device repeats it. Tests build a Runtime from
plugin objects directly (:meth:`Runtime.from_plugins`) and install it with :func:`hal.dispatch.install`.

Plugins made in the running process (:mod:`hal.library`: ops declared and kernels registered from
user code) are kept in :data:`IN_PROCESS` and join every discovered runtime; adding one to a runtime
already built makes a new runtime (:meth:`Runtime.with_in_process`), since a runtime does not change.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import logging
import os
import threading
import traceback
from typing import Any, Iterable, Optional

from hal.errors import PluginError
from hal.plugin import BackendInfo, DeviceInfo, KernelSpec, Plugin
from hal.version import API_VERSION, __version__

ENTRY_POINT_GROUP = "hal.backends"
log = logging.getLogger("hal")

#: plugins made in this process by :mod:`hal.library`, by name: part of every discovered runtime
IN_PROCESS: dict[str, Plugin] = {}


@dataclasses.dataclass
class LoadedPlugin:
    """A plugin as discovered: loaded, failed or disabled."""

    name: str  # entry-point name
    distribution: Optional[str]
    version: Optional[str]
    plugin: Optional[Plugin] = None
    error: Optional[PluginError] = None
    disabled: bool = False
    #: made in this process (:mod:`hal.library`), not found through an entry point
    in_process: bool = False


class BackendState:
    """A backend with its availability probed lazily, once."""

    def __init__(self, info: BackendInfo, version: str) -> None:
        self.info = info
        self.version = version
        self._lock = threading.Lock()
        self._probed = False
        self._reason: Optional[str] = None
        self._devices: list[DeviceInfo] = []

    @property
    def name(self) -> str:
        return self.info.name

    def _probe(self) -> None:
        with self._lock:
            if self._probed:
                return
            try:
                self._reason = self.info.probe()
                if self._reason is None:
                    self._devices = list(self.info.list_devices())
            except Exception as exc:  # a probe that raises makes the backend unavailable, not hal
                self._reason = f"availability probe raised {type(exc).__name__}: {exc}"
            self._probed = True

    @property
    def available(self) -> bool:
        self._probe()
        return self._reason is None

    @property
    def reason(self) -> Optional[str]:
        self._probe()
        return self._reason

    @property
    def devices(self) -> list[DeviceInfo]:
        self._probe()
        return self._devices

    def arch(self, device: Any) -> Optional[str]:
        """The architecture name of a device of this backend ("sm_90"), where it has the notion."""
        if self.info.arch is None:
            return None
        return self.info.arch(device)


def _api_problem(plugin: Plugin, distribution: Optional[str]) -> Optional[PluginError]:
    """A PluginError when ``plugin`` was built for another major API version than this core."""
    theirs = str(plugin.api_version).split(".")[0]
    ours = API_VERSION.split(".")[0]
    if theirs == ours:
        return None
    dist = distribution or f"hal-backend-{plugin.name.replace('_', '-')}"
    if theirs.isdigit() and int(theirs) > int(ours):
        fix = "pip install --upgrade hal"
    else:
        fix = f"pip install --upgrade {dist}"
    return PluginError(
        f"plugin {plugin.name!r} ({dist} {plugin.version}) was built for hal plugin API "
        f"{plugin.api_version}, but this hal ({__version__}) speaks plugin API {API_VERSION}; "
        f"install matching versions: {fix}"
    )


def _dist_name(ep: Any) -> Optional[str]:
    dist = getattr(ep, "dist", None)
    return dist.name if dist is not None else None


def _load(ep: Any) -> tuple[Any, Optional[BaseException]]:
    """The object an entry point names, or the exception importing it raised (any BaseException but
    a KeyboardInterrupt: a plugin calling sys.exit() at import must not end the user's program)."""
    from stevedore import NamedExtensionManager

    failures: list[BaseException] = []
    try:
        manager = NamedExtensionManager(
            ENTRY_POINT_GROUP, names=[ep.name], invoke_on_load=False,
            on_load_failure_callback=lambda _m, _ep, exc: failures.append(exc),
        )
        for ext in manager.extensions:
            if ext.entry_point.value == ep.value:
                return ext.plugin, None
        if failures:
            return None, failures[0]
        return ep.load(), None  # several entry points share the name: load this one directly
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - see the docstring
        return None, exc


def _resolve_name_clashes(loaded: list[LoadedPlugin]) -> list[LoadedPlugin]:
    """Keep one plugin per backend name; the others fail with a PluginError saying who has it."""
    owners: dict[str, LoadedPlugin] = {}
    for lp in loaded:
        if lp.plugin is None or lp.plugin.backend is None:
            continue
        name = lp.plugin.backend.name
        rival = owners.get(name)
        if rival is None:
            owners[name] = lp
            continue
        canonical = f"hal-backend-{name.replace('_', '-')}"
        keep, drop = (lp, rival) if lp.distribution == canonical else (rival, lp)
        owners[name] = keep
        drop.error = PluginError(
            f"plugin {drop.name!r} ({drop.distribution or 'unknown distribution'}) defines backend {name!r}, which "
            f"{keep.distribution or keep.name} already provides; it was not loaded. Rename its backend or uninstall one of them."
        )
        drop.plugin = None
    return loaded


def _in_process_plugins() -> list[LoadedPlugin]:
    return [LoadedPlugin(p.name, None, p.version, p, in_process=True) for p in IN_PROCESS.values()]


def disabled_names() -> set[str]:
    """Plugin names listed in HAL_DISABLE_PLUGINS (comma separated)."""
    return {n.strip() for n in os.environ.get("HAL_DISABLE_PLUGINS", "").split(",") if n.strip()}


class Runtime:
    """Plugins, backends and kernels as loaded; immutable once built."""

    def __init__(self, loaded: Iterable[LoadedPlugin], states: Optional[dict[str, BackendState]] = None) -> None:
        self.plugins: list[LoadedPlugin] = list(loaded)
        self.backends: dict[str, BackendState] = {}
        self._kernels: dict[tuple[str, str], list[KernelSpec]] = {}
        self._signature: Optional[str] = None
        for lp in self.plugins:
            if lp.plugin is not None and lp.plugin.backend is not None:
                known = (states or {}).get(lp.plugin.backend.name)  # probed already: not again
                keep = known is not None and known.info is lp.plugin.backend
                self.backends[lp.plugin.backend.name] = known if keep else BackendState(lp.plugin.backend, lp.plugin.version)
        for lp in self.plugins:
            if lp.plugin is None:
                continue
            for k in lp.plugin.kernels:
                bucket = self._kernels.setdefault((k.op, k.backend), [])
                if any(other.name == k.name for other in bucket):
                    log.warning("hal: plugin %s registers kernel %s of %s twice; keeping the first", lp.name, k.qualname, k.op)
                    continue
                bucket.append(k)
        self._graph_order: dict[tuple[str, str], list[KernelSpec]] = {}
        for key, bucket in self._kernels.items():
            bucket.sort(key=lambda k: -k.priority)
            if any(k.graph_priority is not None for k in bucket):
                self._graph_order[key] = sorted(bucket, key=lambda k: -k.rank(True))

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def from_plugins(cls, plugins: Iterable[Plugin]) -> "Runtime":
        """A runtime of the given plugin objects (for tests and embedding), API versions checked."""
        loaded = []
        for p in plugins:
            err = _api_problem(p, None)
            loaded.append(LoadedPlugin(p.name, None, p.version, None if err else p, err))
        return cls(loaded)

    @classmethod
    def discover(cls) -> "Runtime":
        """Load every plugin of the ``hal.backends`` entry-point group, keeping failures.

        Each entry point is loaded on its own (through stevedore), so a plugin that raises anything
        at import, ``SystemExit`` and ``AssertionError`` included, fails alone. Two entry points that
        define the same backend name do not hide each other: the project's own distribution
        (``hal-backend-<name>``) keeps the name and the other fails with a PluginError naming both.
        """
        disabled = disabled_names()
        out = []
        for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: (e.name, _dist_name(e) or "")):
            dist = getattr(ep, "dist", None)
            lp = LoadedPlugin(ep.name, dist.name if dist else None, dist.version if dist else None)
            if ep.name in disabled:
                lp.disabled = True
            else:
                obj, exc = _load(ep)
                if exc is not None:
                    where = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                    lp.error = exc if isinstance(exc, PluginError) else PluginError(f"plugin {ep.name!r} failed to load: {where}")
                elif not isinstance(obj, Plugin):
                    lp.error = PluginError(
                        f"plugin {ep.name!r}: entry point {ep.value} is a {type(obj).__name__}, not a hal.plugin.Plugin"
                    )
                else:
                    lp.error = _api_problem(obj, lp.distribution)
                    if lp.error is None:
                        lp.plugin = obj
                        lp.version = obj.version
            out.append(lp)
        return cls(_resolve_name_clashes(out) + _in_process_plugins())

    def with_in_process(self) -> "Runtime":
        """This runtime with the plugins of :data:`IN_PROCESS` as they are now (in place of those it
        had), its other plugins and their probed backends unchanged."""
        kept = [lp for lp in self.plugins if not lp.in_process]
        return Runtime(kept + _in_process_plugins(), states=self.backends)

    # --- queries ------------------------------------------------------------------------------

    def kernels(self, op: str, backend: str, device_bound: bool = False) -> list[KernelSpec]:
        """Kernels of ``op`` on ``backend``, highest priority first (``device_bound``: ordered by
        their graph priority, for steps replayed from a CUDA graph)."""
        if device_bound:
            order = self._graph_order.get((op, backend))
            if order is not None:
                return order
        return self._kernels.get((op, backend), [])

    def backends_for(self, device_kind: str) -> list[BackendState]:
        """Backends that serve a device kind, highest priority first (available or not)."""
        found = [b for b in self.backends.values() if device_kind in b.info.device_types]
        return sorted(found, key=lambda b: -b.info.priority)

    def signature(self) -> str:
        """A digest of what decides calls: each plugin's name and version, each backend's priority
        and each kernel (op, backend, name, priority, function). Stable across processes (no object
        identities), so caches keyed on it survive restarts and notice a changed plugin. Computed
        once: a runtime does not change."""
        if self._signature is not None:
            return self._signature
        parts = [f"{lp.name}={lp.version}:{'ok' if lp.plugin is not None else 'failed'}" for lp in self.plugins]
        parts += [f"{name}@{b.info.priority}" for name, b in sorted(self.backends.items())]
        for (op, backend), bucket in sorted(self._kernels.items()):
            for k in bucket:
                fn = getattr(k.fn, "__qualname__", type(k.fn).__name__)
                graph = "" if k.graph_priority is None else f"/graph@{k.graph_priority}"
                parts.append(f"{op}/{backend}/{k.name}@{k.priority}{graph}:{getattr(k.fn, '__module__', '')}.{fn}")
        self._signature = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
        return self._signature

    def failed_plugins(self) -> list[LoadedPlugin]:
        return [lp for lp in self.plugins if lp.error is not None]
