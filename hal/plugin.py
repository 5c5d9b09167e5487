"""What a backend plugin uses to describe itself and register kernels.

A plugin is a distribution with an entry point in the group ``hal.backends`` that names a
:class:`Plugin` object. Importing the plugin's module only registers: it builds the Plugin, states
the API version it was built for, optionally defines a backend (priority, device types, how to
probe availability and list devices) and attaches kernels with :meth:`Plugin.kernel`, a decorator
that returns the function unchanged. No device work and no compilation happen at import; the probe
runs when hal first needs to know.

A plugin may also add kernels to a backend defined by another plugin (``backend="cuda"``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from hal.errors import PluginError
from hal.registry import OpDecl, check_kernel_signature, get_op
from hal.tracing import traced
from hal.version import API_VERSION

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


@dataclasses.dataclass(eq=False)
class KernelSpec:
    """A kernel of an op on a backend, with what it supports stated as data."""

    op: str
    backend: str
    name: str
    fn: Callable[..., Any]
    plugin: str
    priority: int = 0
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
    #: the kernel's priority in steps replayed from a CUDA graph (:func:`hal.graphs.device_bound`),
    #: where host time is not paid per call and only device time counts; None: ``priority``.
    graph_priority: Optional[int] = None

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
        priority: int = 0,
        dtypes: Optional[Iterable[str]] = None,
        archs: Optional[Archs] = None,
        check: Optional[Callable[[Inputs], Reasons]] = None,
        array_api: Optional[str] = None,
        fused: bool = True,
        differentiable: Union[bool, Callable[[Inputs], Reasons]] = False,
        graph_priority: Optional[int] = None,
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

        ``graph_priority`` replaces ``priority`` in steps replayed from a CUDA graph
        (:func:`hal.graphs.device_bound`): a kernel that costs more host time per launch but less
        device time than the kernel ranked above it can rank first there.
        """

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
                    priority=int(priority),
                    dtypes=frozenset(dtypes) if dtypes is not None else None,
                    archs=archs,
                    check=check,
                    array_api=array_api,
                    fused=fused,
                    differentiable=differentiable,
                    graph_priority=None if graph_priority is None else int(graph_priority),
                )
            )
            return fn

        return register

    def __repr__(self) -> str:
        return f"<hal plugin {self.name} {self.version} (API {self.api_version})>"

