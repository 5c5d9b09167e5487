"""What a backend plugin uses to describe itself and register kernels.

A plugin is a distribution with an entry point in the group ``hal.backends`` that names a
:class:`Plugin` object. Importing the plugin's module only registers: it builds the Plugin, states
the API version it was built for, optionally defines a backend (priority, device types, how to
probe availability and list devices) and attaches kernels with :meth:`Plugin.kernel`, a decorator
that returns the function unchanged. No device work and no compilation happen at import; the probe
runs when hal first needs to know.

A plugin may also add kernels to a backend defined by another plugin (``backend="cuda"``).

Where a kernel serves is data of its registration (:class:`Routing`): the contexts of :data:`CONTEXTS`
it serves and its priority in each. The dispatcher decides every call in one context and ranks the
kernels that serve it by their priority there; ``hal.explain`` prints each candidate's table.
"""

from __future__ import annotations

import dataclasses
import pkgutil
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

from hal.errors import PluginError
from hal.registry import OpDecl, check_kernel_signature, get_op
from hal.tracing import traced
from hal.version import API_VERSION


def family_names(path: Iterable[str], exclude: Iterable[str] = ()) -> list[str]:
    """The op family modules of the package whose ``__path__`` is ``path``: its public modules (not
    ``_``-prefixed) but those of ``exclude``, by name. hal.ops, the conformance cases, the kits and
    backends find their families so, and a new family is a new file."""
    skip = set(exclude)
    return sorted({m.name for m in pkgutil.iter_modules(path) if not m.name.startswith("_") and m.name not in skip})

Reasons = Union[None, str, Sequence[str]]


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """One device a backend can run on."""

    index: int
    name: str
    vendor: str
    arch: str
    memory_bytes: Optional[int] = None


@dataclasses.dataclass
class Inputs:
    """What a kernel's capability check sees of a call: canonical arguments and where they live."""

    op: OpDecl
    args: tuple
    device_kind: str  # "cpu", "cuda", "rocm"
    device: Any  # torch.device, or "cpu" for NumPy inputs
    dtype: Optional[str]  # the op's dtype (dtype of its ``dtype_from`` argument)
    array_type: str  # "numpy" or "torch"
    arch: Optional[str] = None  # the device's architecture as its backend names it ("sm_90", "gfx90a")
    #: the decision is made for a torch.compile graph (also where ``hal.explain`` shows what a
    #: graph would run, on real arrays)
    for_graph: bool = False

    def __getitem__(self, name: str) -> Any:
        return self.args[self.op.index(name)]

    @property
    def named(self) -> dict[str, Any]:
        return self.op.bind(self.args)

    @property
    def numpy_caller(self) -> bool:
        """Whether the caller gave NumPy arrays (``device`` is then the string "cpu"). A kernel
        taking NumPy arrays sees views of a torch caller's tensors (``array_type`` is the type the
        kernel takes), so a kernel meant for NumPy callers alone tells them apart by this."""
        return isinstance(self.device, str)

    @property
    def traced(self) -> bool:
        """Whether the call is decided for a torch.compile graph (its arrays are being traced, see
        :func:`traced`, or ``hal.explain`` asks what a graph would run): there Inductor compiles a
        kernel made of torch's ops together with its neighbours, so a check may accept or decline
        differently than for an eager call."""
        return self.for_graph or traced(self.args)


@dataclasses.dataclass(frozen=True)
class Archs:
    """The device architectures a kernel runs on, stated as data: a predicate over the architecture
    names its backend reports ("sm_90", "gfx942") and the phrase that describes it ("sm_80 or
    newer"). Backends build these (``hal_backend_cuda.sm(80)``, ``hal_backend_rocm.gfx("gfx90a")``)."""

    accepts: Callable[[str], bool]
    text: str

    def reason(self, arch: Optional[str]) -> Optional[str]:
        """Why a device of ``arch`` cannot run the kernel (None when it can)."""
        if arch is None:
            return f"device architecture unknown (this kernel needs {self.text})"
        if not self.accepts(arch):
            return f"device architecture {arch} not supported (this kernel needs {self.text})"
        return None


#: The contexts a call is decided in, in the order the dispatcher tests them (the first that applies
#: is the call's: :func:`hal.dispatch.context.context_of`):
#:
#: - ``graph``: inside :func:`hal.graphs.device_bound`, a step to be replayed from a CUDA graph, where
#:   host time is not paid per call and only device time counts;
#: - ``compiled``: the call is decided for a torch.compile graph, where Inductor compiles a kernel made
#:   of torch's ops with its neighbours and any other kernel is one opaque node;
#: - ``training``: the call needs autograd (grad mode on, an input requires grad, the op trainable);
#: - ``eager``: any other call.
CONTEXTS = ("graph", "compiled", "training", "eager")


@dataclasses.dataclass(frozen=True)
class Routing:
    """Where a kernel serves, as data: its priority in each context it serves (higher is tried
    first). A kernel is no candidate for a call made in a context it does not list."""

    #: (context, priority) pairs in the order of :data:`CONTEXTS`.
    priorities: tuple[tuple[str, int], ...]

    @classmethod
    def of(cls, contexts: Mapping[str, int]) -> "Routing":
        """The routing of ``{context: priority}``; a context hal does not know, a priority that is no
        int, or no context at all is a ValueError naming what is wrong."""
        unknown = sorted(set(contexts) - set(CONTEXTS))
        if unknown or not contexts:
            raise ValueError(f"contexts must map some of {', '.join(CONTEXTS)} to priorities, not {dict(contexts)!r}")
        odd = {c: p for c, p in contexts.items() if isinstance(p, bool) or not isinstance(p, int)}
        if odd:
            raise ValueError(f"a context's priority is an int, not {odd!r}")
        return cls(tuple((c, int(contexts[c])) for c in CONTEXTS if c in contexts))

    @classmethod
    def everywhere(cls, priority: int, graph_priority: Optional[int] = None) -> "Routing":
        """Every context at ``priority``, but ``graph`` at ``graph_priority`` where one is given
        (what a registration with ``priority`` and ``graph_priority`` alone means)."""
        graph = int(priority if graph_priority is None else graph_priority)
        return cls.of({c: graph if c == "graph" else int(priority) for c in CONTEXTS})

    def priority(self, context: str) -> Optional[int]:
        """The kernel's priority in ``context`` (None: it does not serve calls made there)."""
        return next((p for c, p in self.priorities if c == context), None)

    @property
    def contexts(self) -> tuple[str, ...]:
        return tuple(c for c, _ in self.priorities)

    def __str__(self) -> str:
        """``"20 in every context"``, or each context it serves with its priority (``"eager 35, graph 1"``)."""
        values = {p for _, p in self.priorities}
        if len(self.priorities) == len(CONTEXTS) and len(values) == 1:
            return f"{values.pop()} in every context"
        return ", ".join(f"{c} {p}" for c, p in self.priorities)


@dataclasses.dataclass(eq=False)
class KernelSpec:
    """A kernel of an op on a backend, with what it supports stated as data."""

    op: str
    backend: str
    name: str
    fn: Callable[..., Any]
    plugin: str
    #: the contexts the kernel serves and its priority in each.
    routing: Routing = Routing.everywhere(0)
    dtypes: Optional[frozenset[str]] = None  # None: every dtype the op declares
    archs: Optional[Archs] = None  # None: every architecture of its backend
    check: Optional[Callable[[Inputs], Reasons]] = None
    array_api: Optional[str] = None  # "numpy" or "torch"; None: the backend's
    #: a vendor-fused or hand-written kernel (True) or a simple one (False); shown by `hal info`.
    fused: bool = True
    #: whether the kernel is made of torch's differentiable ops, so that on the autograd route torch's
    #: autograd may record them (its own C++ nodes, its own saved state) instead of hal's node
    #: running the backward op: False, True, or a check of the inputs giving the reasons it may not
    #: (e.g. float32, where torch's backward would round to TF32). See :mod:`hal.dispatch.route`.
    differentiable: Union[bool, Callable[[Inputs], Reasons]] = False

    @property
    def priority(self) -> int:
        """Its priority in eager calls, or where it serves none its highest (the order ``hal info``
        and listings show kernels in)."""
        eager = self.routing.priority("eager")
        return eager if eager is not None else max(p for _, p in self.routing.priorities)

    @property
    def graph_priority(self) -> Optional[int]:
        """Its priority in steps replayed from a CUDA graph where that differs from :attr:`priority`."""
        graph = self.routing.priority("graph")
        return None if graph == self.priority else graph

    def rank(self, device_bound: bool) -> int:
        """The priority that orders this kernel among its op's kernels on its backend."""
        return self.graph_priority if device_bound and self.graph_priority is not None else self.priority

    @property
    def qualname(self) -> str:
        return f"{self.backend}/{self.name}"

    def torch_autograd_reasons(self, inputs: Inputs) -> list[str]:
        """Why torch's autograd may not record this kernel for ``inputs`` (empty: it may)."""
        if self.differentiable is True:
            return []
        if self.differentiable is False:
            return ["the kernel is not made of torch's differentiable ops"]
        return _as_list(self.differentiable(inputs))

    def not_supported_reasons(self, inputs: Inputs) -> list[str]:
        """Why this kernel cannot run ``inputs`` (an empty list when it can)."""
        reasons: list[str] = []
        if self.dtypes is not None and inputs.dtype not in self.dtypes:
            reasons.append(f"dtype {inputs.dtype} not supported (supports {', '.join(sorted(self.dtypes))})")
        if self.archs is not None:
            why = self.archs.reason(inputs.arch)
            if why:
                reasons.append(why)
        if self.check is not None and not reasons:
            reasons.extend(_as_list(self.check(inputs)))
        return reasons


def _as_list(reasons: Reasons) -> list[str]:
    if isinstance(reasons, str):
        return [reasons]
    return list(reasons) if reasons else []


@dataclasses.dataclass(eq=False)
class BackendInfo:
    """A backend: a family of kernels serving some device kinds, chosen by priority."""

    name: str
    plugin: str
    priority: int
    device_types: tuple[str, ...]
    #: returns None when usable, else a sentence saying why not ("no CUDA device").
    probe: Callable[[], Optional[str]]
    #: lists the devices (called only when available).
    list_devices: Callable[[], list[DeviceInfo]]
    #: the architecture name of a device ("sm_90", "gfx90a"), where the backend has the notion.
    arch: Optional[Callable[[Any], Optional[str]]] = None
    #: the array type its kernels take by default: "numpy" or "torch".
    array_api: str = "torch"
    #: sentences about a usable backend working in part (an optional library missing, say), shown
    #: by ``hal info``; asked only when someone looks (it may import that library).
    notes: Callable[[], list[str]] = list
    #: a directory of measured kernel choices shipped with the plugin, one ``<device slug>.json``
    #: per device model (:mod:`hal.tuning.cache`'s format): they seed that device's tune cache.
    tuning_seeds: Optional[Path] = None


class Plugin:
    """A plugin: its identity, the API version it was built for, its backend and its kernels."""

    def __init__(self, name: str, version: str, api_version: str = API_VERSION, summary: str = "") -> None:
        self.name = name
        self.version = version
        self.api_version = api_version
        self.summary = summary
        self.backend: Optional[BackendInfo] = None
        self.kernels: list[KernelSpec] = []

    def define_backend(
        self,
        *,
        priority: int,
        device_types: Iterable[str],
        probe: Callable[[], Optional[str]] = lambda: None,
        devices: Callable[[], list[DeviceInfo]] = list,
        arch: Optional[Callable[[Any], Optional[str]]] = None,
        array_api: str = "torch",
        notes: Callable[[], list[str]] = list,
        tuning_seeds: Optional[Union[str, Path]] = None,
    ) -> BackendInfo:
        """Define the backend named after this plugin. ``notes`` returns what works only in part
        (``hal info`` prints it under the backend): e.g. an optional library missing.
        ``tuning_seeds`` is a directory of kernel choices measured on known devices (``hal tune
        --export``), which seed the dispatcher's measured choice on those devices."""
        if array_api not in ("numpy", "torch"):
            raise PluginError(f"plugin {self.name}: array_api must be 'numpy' or 'torch', not {array_api!r}")
        self.backend = BackendInfo(
            name=self.name,
            plugin=self.name,
            priority=int(priority),
            device_types=tuple(device_types),
            probe=probe,
            list_devices=devices,
            arch=arch,
            array_api=array_api,
            notes=notes,
            tuning_seeds=Path(tuning_seeds) if tuning_seeds is not None else None,
        )
        return self.backend

    def kernel(
        self,
        op: str,
        *,
        name: str,
        backend: Optional[str] = None,
        priority: Optional[int] = None,
        dtypes: Optional[Iterable[str]] = None,
        archs: Optional[Archs] = None,
        check: Optional[Callable[[Inputs], Reasons]] = None,
        array_api: Optional[str] = None,
        fused: bool = True,
        differentiable: Union[bool, Callable[[Inputs], Reasons]] = False,
        graph_priority: Optional[int] = None,
        contexts: Optional[Mapping[str, int]] = None,
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Register the decorated function as kernel ``name`` of ``op`` and return it unchanged.

        The function must take exactly the op's parameters, in order (checked now). It is called
        positionally with canonical arguments: static options already normalised by the op's
        checker (``stride`` as a pair, ``dim`` non-negative ...).

        ``differentiable`` says the function is made of torch's differentiable ops (True, or a
        check giving the reasons it is not for some inputs): a call needing autograd then runs it
        with grad recording on and torch's autograd does the backward, instead of hal's node with
        the op's backward op. Meant for kernels that are torch's own op, where hal's node adds
        host time and nothing else.

        ``contexts`` says where the kernel serves: ``{context: priority}`` over :data:`CONTEXTS`
        (``{"compiled": 2}``: inside torch.compile graphs only; ``{"eager": 35, "training": 35,
        "compiled": 35, "graph": 1}``: everywhere, ranked last in CUDA-graph replays). Without it
        the kernel serves every context at ``priority`` (default 0), and at ``graph_priority`` in
        steps replayed from a CUDA graph (:func:`hal.graphs.device_bound`) where that is given: a
        kernel that costs more host time per launch but less device time than the kernel ranked
        above it can rank first there.
        """
        try:
            if contexts is None:
                routing = Routing.everywhere(0 if priority is None else priority, graph_priority)
            elif priority is not None or graph_priority is not None:
                raise ValueError("give either contexts or priority (and graph_priority), not both")
            else:
                routing = Routing.of(contexts)
        except (ValueError, TypeError) as exc:
            raise PluginError(f"plugin {self.name}: kernel {name!r} of op {op}: {exc}") from None

        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            try:
                decl = get_op(op)
            except KeyError as exc:
                raise PluginError(f"plugin {self.name}: kernel {name!r} is for an unknown op: {exc.args[0]}") from None
            problem = check_kernel_signature(decl, fn)
            if problem:
                raise PluginError(f"plugin {self.name}: kernel {name!r} of op {op}: {problem}")
            declared = set(decl.dtypes)
            if dtypes is not None and not set(dtypes) <= declared:
                raise PluginError(
                    f"plugin {self.name}: kernel {name!r} of op {op} claims dtypes "
                    f"{sorted(set(dtypes) - declared)} that the op does not declare ({sorted(declared)})"
                )
            self.kernels.append(
                KernelSpec(
                    op=op,
                    backend=backend or self.name,
                    name=name,
                    fn=fn,
                    plugin=self.name,
                    routing=routing,
                    dtypes=frozenset(dtypes) if dtypes is not None else None,
                    archs=archs,
                    check=check,
                    array_api=array_api,
                    fused=fused,
                    differentiable=differentiable,
                )
            )
            return fn

        return register

    def __repr__(self) -> str:
        return f"<hal plugin {self.name} {self.version} (API {self.api_version})>"

