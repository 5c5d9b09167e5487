"""Recording every hal call of a model's training steps, and forcing chosen calls to the reference.

A :class:`Recorder` is the observer of a scope (:attr:`hal.config.Overrides.observer`): the
dispatcher hands it every call it plans inside :meth:`Recorder.recording`, whichever way the call
comes in (``hal.ops``, a ``hal.nn`` module, a held plan of ``hal.optim``). For each *top-level*
call (one made by the model's code, not by a decomposition inside hal) it keeps:

- the op, the backend, kernel and route the dispatcher chose, the call site (the first frame
  outside hal and torch, with the next ones) and the innermost module of the model on the stack;
- a CPU copy of the arguments before the call, of the results after it (returned arrays, then the
  arrays it writes in place), the gradient reaching each result and the gradient it gives each
  differentiable input. Gradients are taken by identity autograd functions around the call's
  inputs and results (:class:`_Tap`), so each is this call's own, not a sum over a tensor's uses;
- the calls made inside it: a decomposition's ops (numbered ``(index, j)``) and the calls its
  backward makes (a hal autograd node's backward op), attributed through the scope the node saved.

Each call runs inside a scope of its own whose observer is the call's :class:`_CallScope`; hal's
autograd nodes save the scope of their forward and decide their backward op under it, which is how
a backward op call is attributed to the call that made the node, on any thread.

A *forced* call (its path in ``forced``) runs on the reference backend instead (``hal.use(backend=
reference)``, its arrays moved to the reference's device and back), its backward too (the node
saved that scope): the bisection of :mod:`hal.conformance.model` re-runs a model with chosen calls
forced to see whether a divergence goes away.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from typing import Any, Callable, Collection, Iterator, Optional, Sequence

import torch
from torch import nn

from hal import config
from hal.dispatch import DISPATCHER
from hal.errors import UnsupportedError
from hal.registry import OpDecl

from . import model_zoo
from .model_zoo import ModelCase, call as call_model

Path = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Site:
    """A frame of the caller: file, line, function and the source line."""

    file: str
    line: int
    function: str
    code: str = ""

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}"

    def record(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class KernelRun:
    """A hal call made inside a recorded call: a decomposition's op (``phase`` "forward", path
    ``(index, j)``) or a call of its backward (``phase`` "backward", the path of the call whose
    autograd node made it)."""

    path: Path
    op: str
    backend: str
    kernel: str
    route: str
    phase: str
    forced: bool = False

    @property
    def label(self) -> str:
        return f"{self.op} {self.backend}/{self.kernel}"

    def record(self) -> dict[str, Any]:
        return {"path": list(self.path), "op": self.op, "backend": self.backend, "kernel": self.kernel, "route": self.route,
                "phase": self.phase, "forced": self.forced}


@dataclasses.dataclass
class CallRecord:
    """One top-level hal call of a run (module docstring)."""

    index: int
    step: int
    #: "forward" (the model and its loss) or "optimizer" (after the backward)
    phase: str
    op: str
    backend: str
    kernel: str
    #: the dispatcher's route: kernel, recorded (torch's autograd), node (hal's), decomposition
    route: str
    site: Optional[Site]
    stack: tuple[Site, ...]
    #: the innermost module of the model on the stack, by its name in the model ("" for the model)
    module: Optional[str]
    #: the arguments by parameter name before the call (arrays as CPU copies)
    args: dict[str, Any]
    #: ("out" / "out[i]" / "@written", CPU copy) after the call
    outputs: list[tuple[str, Optional[torch.Tensor]]] = dataclasses.field(default_factory=list)
    #: gradient reaching returned result i
    out_grads: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    #: gradient this call gives each differentiable input, by parameter name
    in_grads: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    inner: list[KernelRun] = dataclasses.field(default_factory=list)
    forced: bool = False

    @property
    def path(self) -> Path:
        return (self.index,)

    def shapes(self) -> str:
        """The array arguments as ``name dtype[shape]``, for reports."""
        parts = []
        for name, v in self.args.items():
            if isinstance(v, torch.Tensor):
                parts.append(f"{name} {str(v.dtype).removeprefix('torch.')}{list(v.shape)}")
            elif isinstance(v, (list, tuple)) and v and isinstance(v[0], torch.Tensor):
                parts.append(f"{name} {len(v)} x {str(v[0].dtype).removeprefix('torch.')}")
        return ", ".join(parts)

    def backward_runs(self) -> list[KernelRun]:
        return [k for k in self.inner if k.phase == "backward"]

    def nested(self) -> list[KernelRun]:
        return [k for k in self.inner if k.phase == "forward"]


@dataclasses.dataclass
class Recording:
    """A run: its top-level calls and the loss of each step."""

    calls: list[CallRecord]
    losses: list[float]
    backend: str
    device: str
    dtype: str


# --- taps -------------------------------------------------------------------------------------------


def _same_layout_copy(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` with its strides (a layout the dispatcher chose the kernel for), or a view
    where ``x`` overlaps itself (an expanded tensor cannot be copied with its strides)."""
    overlap = getattr(torch._C, "_debug_has_internal_overlap", None)
    if overlap is not None and overlap(x) == 0:
        return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=x.device).copy_(x)
    if overlap is None and x.is_contiguous():
        return x.clone()
    return x.view_as(x)


class _Tap(torch.autograd.Function):
    """Identity whose backward hands the gradient passing through it to ``sink``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sink: Callable[[torch.Tensor], None]) -> torch.Tensor:  # type: ignore[override]
        ctx.sink = sink
        return _same_layout_copy(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        ctx.sink(grad.detach().to("cpu", copy=True))
        return grad, None


def _sink(store: dict[Any, torch.Tensor], key: Any) -> Callable[[torch.Tensor], None]:
    def put(grad: torch.Tensor) -> None:
        store[key] = grad

    return put


# --- copies and moves -----------------------------------------------------------------------------


def snapshot(value: Any) -> Any:
    """A CPU copy of an argument (arrays copied, lists item by item, other values as they are)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, (list, tuple)):
        return [snapshot(v) for v in value]
    return value


def _flatten(name: str, value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, (list, tuple)):
        return [(f"{name}[{i}]", v) for i, v in enumerate(value)]
    return [(name, value)]


def components(decl: OpDecl, out: Any, named: dict[str, Any]) -> list[tuple[str, Optional[torch.Tensor]]]:
    """A call's results as CPU copies: the returned arrays ("out", "out[i]"), then the arrays it
    writes in place ("@name", "@name[i]"), as the op suite names them."""
    comps: list[tuple[str, Any]] = []
    if out is not None:
        comps += _flatten("out", out) if isinstance(out, (list, tuple)) else [("out", out)]
    for name in decl.mutates:
        comps += [(f"@{n}", v) for n, v in _flatten(name, named.get(name)) if v is not None]
    return [(n, v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else None) for n, v in comps]


def invoke(decl: OpDecl, values: Sequence[Any]) -> Any:
    """``hal.ops.<op>`` called with every parameter's value in declaration order (keyword-only
    parameters by name)."""
    assert decl.entry is not None
    positional = [v for p, v in zip(decl.params, values) if not p.keyword_only]
    named = {p.name: v for p, v in zip(decl.params, values) if p.keyword_only}
    return decl.entry(*positional, **named)


def _moved(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_moved(v, device) for v in value)
    return value


# --- call sites -------------------------------------------------------------------------------------


def _internal_prefixes() -> tuple[str, ...]:
    """Source directories whose frames are not a call site: hal, its ops, this suite (but for the
    built-in models, :data:`_ZOO_FILE`), the loaded backends and kits, torch, and the standard
    library's wrappers (contextlib, functools). The walk stops at the training loop
    (:data:`_TRAIN_CODE`): what called it is the harness, not the model."""
    import contextlib as _contextlib
    import functools as _functools

    dirs = []
    for name, module in list(sys.modules.items()):
        top = name.split(".")[0]
        if top in ("hal", "torch") or top.startswith("hal_backend_") or top in ("hal_triton", "hal_cpp"):
            if "." not in name and getattr(module, "__file__", None):
                dirs.append(os.path.dirname(os.path.abspath(module.__file__)) + os.sep)
    for module_name in ("hal.ops", "hal.conformance"):
        module = sys.modules.get(module_name)
        if module is not None and getattr(module, "__file__", None):
            dirs.append(os.path.dirname(os.path.abspath(module.__file__)) + os.sep)
    files = [os.path.abspath(_contextlib.__file__), os.path.abspath(_functools.__file__)]
    return tuple(dict.fromkeys(dirs + files))


def _relative(path: str) -> str:
    """A path relative to the working directory when it lies under it (shorter in reports)."""
    if path.startswith("<"):
        return path
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


# --- the recorder --------------------------------------------------------------------------------


class Recorder:
    """The observer of one run (module docstring).

    ``backend``: forced for the whole run (None: the dispatcher's choice per device);
    ``reference_backend`` / ``reference_device``: where forced calls run; ``forced``: the paths of
    the calls to force (``(index,)`` a top-level call, ``(index, j)`` a call inside one); ``tune``:
    HAL_TUNE for the run ("cached": measured choices on disk are used, nothing is measured, so that
    every run of a model chooses the same kernels); ``model``: to name the module of each call.
    """

    STACK_DEPTH = 4

    def __init__(self, *, backend: Optional[str], reference_backend: str, reference_device: torch.device,
                 forced: Collection[Path] = (), tune: str = "cached", model: Optional[nn.Module] = None) -> None:
        self.backend = backend
        self.reference_backend = reference_backend
        self.reference_device = torch.device(reference_device)
        self.forced = frozenset(tuple(p) for p in forced)
        self.tune = tune
        self.calls: list[CallRecord] = []
        self.step = 0
        self.phase = "forward"
        self._modules = {id(m): name for name, m in model.named_modules()} if model is not None else {}
        self._internal = _internal_prefixes()

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """The scope whose calls are recorded."""
        changes: dict[str, Any] = {"observer": self._observe, "tune": self.tune}
        if self.backend is not None:
            changes["backend"] = self.backend
        with config.scope(**changes):
            yield

    # the observer of top-level calls
    def _observe(self, decl: OpDecl, route: Any, run: Callable[..., Any], args: tuple) -> Any:
        if self.phase == "backward":  # a hal call in the backward of code hal did not run (a custom autograd.Function)
            return run(*args)
        named = dict(zip(decl.param_names, args))
        site, stack, module = self._where()
        rec = CallRecord(len(self.calls), self.step, self.phase, decl.name, route.backend, route.kernel, route.kind,
                         site, stack, module, {k: snapshot(v) for k, v in named.items()})
        self.calls.append(rec)
        tapped = list(args)
        if torch.is_grad_enabled():
            for name in decl.gradients:
                i = decl.index(name)
                v = tapped[i]
                if isinstance(v, torch.Tensor) and v.requires_grad and name not in decl.mutates:
                    tapped[i] = _Tap.apply(v, _sink(rec.in_grads, name))
        scope = _CallScope(self, rec, rec.path)
        rec.forced = rec.path in self.forced
        if rec.forced:
            out = scope.forced_run(decl, tapped, lambda r: _retarget(rec, r))
        else:
            out = scope.run(run, tapped)
        rec.outputs = components(decl, out, named)
        return _tap_results(out, rec.out_grads)

    def _where(self) -> tuple[Optional[Site], tuple[Site, ...], Optional[str]]:
        """The call site (first frame outside hal and torch), the next user frames, and the
        innermost module of the model on the stack."""
        import linecache

        frame = sys._getframe(1)
        sites: list[Site] = []
        module = None
        while frame is not None and len(sites) < self.STACK_DEPTH and frame.f_code is not _TRAIN_CODE:
            filename = frame.f_code.co_filename
            if module is None and self._modules and "self" in frame.f_code.co_varnames:
                owner = frame.f_locals.get("self")
                if isinstance(owner, nn.Module) and id(owner) in self._modules:
                    module = self._modules[id(owner)]
            if not (filename.startswith("<hal") or (filename.startswith(self._internal) and filename != _ZOO_FILE)):
                code = linecache.getline(filename, frame.f_lineno).strip()
                sites.append(Site(_relative(filename), frame.f_lineno, frame.f_code.co_name, code))
            frame = frame.f_back
        if module is None and self._modules:  # the model's own modules may sit below the call site
            while frame is not None and module is None and frame.f_code is not _TRAIN_CODE:
                if "self" in frame.f_code.co_varnames:
                    owner = frame.f_locals.get("self")
                    if isinstance(owner, nn.Module) and id(owner) in self._modules:
                        module = self._modules[id(owner)]
                frame = frame.f_back
        return (sites[0] if sites else None), tuple(sites[1:]), module

    def finish(self) -> None:
        """Drop the dispatcher's plans made for this run (their keys hold this recorder's scopes)."""
        from hal.dispatch import DISPATCHER

        DISPATCHER.forget_plans()


def _retarget(rec: Any, route: Any) -> None:
    """Record the route a forced call took on the reference."""
    rec.backend, rec.kernel, rec.route = route.backend, route.kernel, route.kind


def _tap_results(out: Any, store: dict[int, torch.Tensor]) -> Any:
    """The call's results with a tap on each that autograd differentiates (``store[i]`` gets the
    gradient reaching result i)."""
    if isinstance(out, torch.Tensor):
        return _Tap.apply(out, _sink(store, 0)) if out.requires_grad else out
    if isinstance(out, (list, tuple)):
        tapped = [(_Tap.apply(v, _sink(store, i)) if isinstance(v, torch.Tensor) and v.requires_grad else v) for i, v in enumerate(out)]
        return type(out)(tapped) if isinstance(out, list) else tuple(tapped)
    return out


class _CallScope:
    """The observer of the calls made inside one recorded call (or inside one call nested in it),
    and of the calls its autograd nodes' backward makes: the scope each node saves."""

    def __init__(self, recorder: Recorder, rec: CallRecord, path: Path) -> None:
        self.recorder, self.rec, self.path = recorder, rec, path
        #: the next call observed is the forced call itself, entering again on the reference
        self._entering: Optional[Callable[[Any], None]] = None

    def __call__(self, decl: OpDecl, route: Any, run: Callable[..., Any], args: tuple) -> Any:
        if self._entering is not None:
            note, self._entering = self._entering, None
            note(route)
            return run(*args)
        r = self.recorder
        if r.phase == "backward":
            self.rec.inner.append(KernelRun(self.path, decl.name, route.backend, route.kernel, route.kind, "backward"))
            return run(*args)
        path = (self.rec.index, len(self.rec.nested()) + 1)
        kr = KernelRun(path, decl.name, route.backend, route.kernel, route.kind, "forward", path in r.forced)
        self.rec.inner.append(kr)
        child = _CallScope(r, self.rec, path)
        if kr.forced:
            return child.forced_run(decl, list(args), lambda rt: _retarget(kr, rt))
        return child.run(run, args)

    def run(self, run: Callable[..., Any], args: Sequence[Any]) -> Any:
        with config.scope(observer=self):
            return run(*args)

    def forced_run(self, decl: OpDecl, args: list[Any], note: Callable[[Any], None]) -> Any:
        """The call on the reference backend's own kernel, on the reference's device (arrays moved
        there and the results back; arrays written in place are written back). The kernel is
        forced, not only the backend: a call needing autograd would otherwise run the op's
        training decomposition there, whose steps round to the run's dtype between them."""
        r = self.recorder
        device = r.reference_device
        here = next((a.device for a in args if isinstance(a, torch.Tensor)), device)
        moved = [_moved(a, device) for a in args]
        kernels = dict((config.current() or config.Overrides()).kernels)
        own = DISPATCHER.runtime().kernels(decl.name, r.reference_backend)
        attempts = [dict(kernels, **{decl.name: own[0].name}), kernels] if own else [kernels]
        for i, forced_kernels in enumerate(attempts):
            self._entering = note
            try:
                with config.scope(observer=self, backend=r.reference_backend, kernels=tuple(sorted(forced_kernels.items()))):
                    out = invoke(decl, moved)
                break
            except UnsupportedError:
                if i == len(attempts) - 1:  # its kernel declines these inputs: the backend's own choice
                    raise
            finally:
                self._entering = None
        if here != device:
            with torch.no_grad():
                for name in decl.mutates:
                    i = decl.index(name)
                    for dst, src in zip(_flatten(name, args[i]), _flatten(name, moved[i])):
                        if isinstance(dst[1], torch.Tensor):
                            dst[1].copy_(src[1])
            out = _moved(out, here)
        return out


def train(case: ModelCase, model: nn.Module, batch: Any, recorder: Recorder, steps: int,
          optimizer: Callable[[Any], torch.optim.Optimizer]) -> list[float]:
    """``steps`` training steps of ``model`` on ``batch``, recorded: forward and loss, backward,
    optimizer step (gradients set to None). The backward runs outside the recording scope, so that
    hal's autograd nodes decide their backward ops under the scope each saved. Returns the losses."""
    opt = optimizer(model.parameters())
    losses = []
    try:
        for s in range(steps):
            recorder.step, recorder.phase = s, "forward"
            with recorder.recording():
                loss = call_model(case, model, batch)
            recorder.phase = "backward"
            loss.backward()
            recorder.phase = "optimizer"
            with recorder.recording():
                opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
    finally:
        recorder.phase = "forward"
        recorder.finish()
    return losses


#: the frame where a call site search stops, and the one file of this package whose frames are the
#: model's own code (the built-in models)
_TRAIN_CODE = train.__code__
_ZOO_FILE = os.path.abspath(model_zoo.__file__)
