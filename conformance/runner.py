"""Running the conformance cases of one backend: plan, reference, poisoned kernel call, comparison.

For every op of the registry (forward and backward), every kernel the backend registers for it
(each forced in turn with ``hal.use(backend=..., kernel={op: name})``, plus ``composite`` where the
op declares one), every declared dtype and every case:

1. the case's arguments are drawn from its seed on the backend's device (see ``cases``);
2. the reference runs on the same values upcast to float64 on the CPU: the cpu_ref backend, or, when
   cpu_ref itself is under test, PyTorch's CPU kernels (``hal_backend_eager``). Static arguments the op
   canonicalises from the case dtype (rms_norm's default eps) are canonicalised once, from the
   case's own arguments, and given to both sides. The reference is computed once per case and
   shared by all kernels;
3. the allocator is poisoned for the outputs' sizes (``poison``) and the kernel runs;
4. every result component (returned arrays, then the arguments the op writes in place) is checked
   for dtype, shape and values (``compare``), and the arguments the op must not write are checked
   unchanged.

Statuses: ``pass``, ``fail`` (wrong dtype, shape or values, or an input written), ``error`` (the
kernel or the reference raised), ``skip`` (the forced kernel declares it cannot run these inputs, or
the backend has no kernel for the op), and ``xfail`` / ``xpass`` for cases listed in the backend's
xfail file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import math
import time
import traceback
import warnings
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import numpy as np
import torch

import hal
from hal import config
from hal.arrays import dtype_name, is_array, torch_dtype
from hal.dispatch import DISPATCHER, prepare
from hal.errors import BackendUnavailableError, HalError, UnsupportedError
from hal.library import checking_results
from hal.registry import OpDecl, get_op
from hal.types import ARRAY_KINDS

from . import compare as cmp
from . import xfail as xf
from .cases import Call, CaseSpec, all_cases, case_id, cases_for, draw_call, find_case, parse_case_id
from .poison import Poisoner

REFERENCE_BACKEND = "cpu_ref"
#: what cpu_ref itself is checked against: PyTorch's CPU kernels (the eager backend) in float64.
REFERENCE_OF_REFERENCE = "eager"
STATUSES = ("pass", "fail", "xfail", "xpass", "skip", "error")
PLACEHOLDER_KERNEL = "*"


@dataclasses.dataclass
class Result:
    """One case's outcome: the fields of API.md's report schema, then extras."""

    op: str
    kernel: str
    dtype: str
    case: str
    status: str
    max_abs_err: Optional[float] = None
    max_rel_err: Optional[float] = None
    atol: Optional[float] = None
    rtol: Optional[float] = None
    reason: Optional[str] = None
    max_ulp: Optional[int] = None
    k: Optional[int] = None
    duration_s: float = 0.0
    repro: Optional[str] = None

    @property
    def id(self) -> str:
        return case_id(self.op, self.kernel, self.dtype, self.case)

    @property
    def unexpected(self) -> bool:
        """Whether this result fails the run by itself (an ``xpass`` does only under ``--strict-xpass``)."""
        return self.status in ("fail", "error")

    def record(self) -> dict[str, Any]:
        """A JSON-safe dict (non-finite errors become null; the reason says what happened)."""
        out = dataclasses.asdict(self)
        for key in ("max_abs_err", "max_rel_err", "atol", "rtol"):
            v = out[key]
            out[key] = None if v is None or not math.isfinite(v) else float(v)
        out["id"] = self.id
        return out

    def __str__(self) -> str:
        errs = f" max_abs_err={self.max_abs_err:.3g} max_rel_err={self.max_rel_err:.3g}" if self.max_abs_err is not None and self.max_rel_err is not None else ""
        tol = f" (atol={self.atol:.3g}, rtol={self.rtol:.3g})" if self.atol is not None and self.rtol is not None else ""
        ulp = f" max_ulp={self.max_ulp}" if self.max_ulp is not None else ""
        return f"{self.status.upper()} {self.id}{errs}{tol}{ulp}" + (f"\n  {self.reason}" if self.reason else "")


@dataclasses.dataclass(frozen=True)
class Planned:
    """One case to run: an op, a kernel, a dtype and a case (None for a placeholder row that
    records why an (op, dtype) has nothing to run)."""

    op: str
    kernel: str
    dtype: str
    spec: Optional[CaseSpec]
    placeholder: str = ""  # "no_kernel" or "no_cases" for placeholder rows

    @property
    def case(self) -> str:
        return self.spec.name if self.spec is not None else self.placeholder

    @property
    def id(self) -> str:
        return case_id(self.op, self.kernel, self.dtype, self.case)


@dataclasses.dataclass
class _Reference:
    """The reference results of one case (shared by every kernel of the op)."""

    components: list[tuple[str, Optional[torch.Tensor]]]
    k: int
    error: Optional[str] = None
    #: the reference's arguments by name (float arrays in float64).
    args: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: the composite's rounded intermediate (see ``Decomposition.rounds``), computed once when asked.
    rounded: Optional[torch.Tensor] = None


def _flatten(name: str, value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, (list, tuple)):
        return [(f"{name}[{i}]", v) for i, v in enumerate(value)]
    return [(name, value)]


def _to_cpu(value: Any) -> Optional[torch.Tensor]:
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor result, got {type(value).__name__}")
    return value.detach().cpu()


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_floating_point():
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return bool(torch.equal(a, b))


def _snapshot(decl: OpDecl, args: dict[str, Any]) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, array, copy) of every array argument the op must not write."""
    out = []
    for p in decl.params:
        if p.kind not in ARRAY_KINDS or p.name in decl.mutates:
            continue
        for name, v in _flatten(p.name, args.get(p.name)):
            if isinstance(v, torch.Tensor):
                out.append((name, v, v.detach().clone()))
    return out


def canonical_call(decl: OpDecl, args: Sequence[Any]) -> tuple[tuple, list[tuple[int, Any]], Optional[int]]:
    """What the dispatcher hands kernels for ``args`` (validated): canonical arguments (a batched x
    for unbatched inputs), the static substitutions the checker made, and the unbatched slot."""
    prepared = prepare(decl, list(args))
    inputs, subs, unbatched = prepared.inputs, list(prepared.subs), prepared.unbatched
    return inputs.args, subs, unbatched


@contextlib.contextmanager
def untuned() -> Iterator[None]:
    """Kernel choice by priority alone in this thread (as HAL_TUNE=off), whatever the environment."""
    outer = config.current() or config.Overrides()
    saved = config.enter(dataclasses.replace(outer, tune="off"))
    try:
        yield
    finally:
        config.leave(saved)


def default_backend() -> str:
    """The best available device backend: the highest-priority usable non-CPU backend (cuda,
    rocm), else the highest-priority usable CPU backend (cpu, or cpu_ref where cpu is not
    installed)."""
    states = sorted(DISPATCHER.runtime().backends.values(), key=lambda s: -s.info.priority)
    for want_cpu in (False, True):
        for s in states:
            if s.available and ("cpu" in s.info.device_types) == want_cpu:
                return s.name
    raise BackendUnavailableError("no usable backend is installed; install the reference with `pip install hal-backend-cpu-ref`")


def repro_snippet(result: Result, backend: str, device: int, seed: int, torch_device: str) -> str:
    """Python that replays one case, to paste into an interpreter."""
    lines = [
        "import hal",
        "from hal.conformance import case_inputs, reproduce",
        f"print(reproduce({result.id!r}, backend={backend!r}, device={device}, seed={seed}))",
    ]
    if result.kernel != PLACEHOLDER_KERNEL:
        lines += [
            "# the same call by hand:",
            f"args = case_inputs({result.op!r}, {result.dtype!r}, {result.case!r}, seed={seed}, device={torch_device!r})",
            f"with hal.use(backend={backend!r}, kernel={{{result.op!r}: {result.kernel!r}}}):",
            f"    out = hal.ops.{result.op}(**args)",
        ]
    return "\n".join(lines)


class Suite:
    """The conformance run of one backend on one device.

    ``ops`` and ``dtypes`` filter by name (``ops`` accepts shell patterns such as ``conv2d*``);
    ``xfail_file`` and ``tolerance_file`` add to the backend's own lists; ``strict_xpass`` makes an
    xpass fail the run.
    """

    def __init__(
        self,
        backend: Optional[str] = None,
        device: int = 0,
        seed: int = 0,
        quick: bool = False,
        ops: Optional[Sequence[str]] = None,
        dtypes: Optional[Sequence[str]] = None,
        xfail_file: Optional[str] = None,
        tolerance_file: Optional[str] = None,
        poison: bool = True,
        strict_xpass: bool = False,
    ) -> None:
        rt = DISPATCHER.runtime()
        self.backend = backend or default_backend()
        state = rt.backends.get(self.backend)
        if state is None:
            raise BackendUnavailableError(
                f"backend {self.backend!r} is not installed; installed backends: {', '.join(sorted(rt.backends)) or 'none'}. "
                f"Install it (pip install hal-backend-{self.backend.replace('_', '-')}) or pick another with --backend."
            )
        if not state.available:
            raise BackendUnavailableError(f"backend {self.backend!r} is installed but not usable here: {state.reason}")
        self.state = state
        self.device_index = device
        if device < 0 or device >= max(1, len(state.devices)):
            raise BackendUnavailableError(f"backend {self.backend!r} has {len(state.devices)} device(s); --device {device} does not exist")
        self.device_info = state.devices[device] if state.devices else None
        self.torch_device = torch.device("cpu" if "cpu" in state.info.device_types else f"cuda:{device}")
        self.reference = REFERENCE_OF_REFERENCE if self.backend == REFERENCE_BACKEND else REFERENCE_BACKEND
        ref = rt.backends.get(self.reference)
        if ref is None or not ref.available:
            fix = ("install it with `pip install hal-backend-cpu-ref` (./backends/cpu_ref from a checkout)"
                   if self.reference == REFERENCE_BACKEND else
                   "install it with `pip install hal-backend-eager` (./backends/eager from a checkout)")
            raise BackendUnavailableError(
                f"the reference backend {self.reference} is {'not installed' if ref is None else 'unusable: ' + str(ref.reason)}; {fix}"
            )
        self.seed = seed
        self.quick = quick
        self.ops = list(ops) if ops else None
        self.dtypes = list(dtypes) if dtypes else None
        plugin = next((lp.plugin for lp in rt.plugins if lp.plugin is not None and lp.plugin.name == state.info.plugin), None)
        self.overrides = cmp.load_overrides(self.backend, plugin, tolerance_file)
        self.xfails = xf.load(self.backend, xfail_file)
        self.strict_xpass = strict_xpass
        self.poisoner = Poisoner(self.torch_device, enabled=poison)
        self.poison_ok, self.poison_method = self.poisoner.self_test()
        self._ref_key: Optional[tuple[str, str, str]] = None
        self._ref: Optional[_Reference] = None
        self._check_filters()

    @property
    def reference_label(self) -> str:
        return "PyTorch CPU (the eager backend) in float64" if self.reference == REFERENCE_OF_REFERENCE else "cpu_ref in float64"

    # --- planning -------------------------------------------------------------------------------

    def _check_filters(self) -> None:
        names = [d.name for d in hal.list_ops()]
        for pattern in self.ops or []:
            if not fnmatch.filter(names, pattern):
                raise ValueError(f"--ops: no op matches {pattern!r}; ops: {', '.join(names)}")
        declared = sorted({t for d in hal.list_ops() for t in d.dtypes})
        for t in self.dtypes or []:
            if t not in declared:
                raise ValueError(f"--dtypes: no op declares dtype {t!r}; dtypes: {', '.join(declared)}")

    def kernels(self, decl: OpDecl) -> list[str]:
        """The kernels of ``decl`` on the backend, each forced in turn, then "composite" if declared."""
        names = [k.name for k in DISPATCHER.runtime().kernels(decl.name, self.backend)]
        return names + (["composite"] if decl.fallback_composite is not None else [])

    def plan(self, quick: Optional[bool] = None, filtered: bool = True) -> list[Planned]:
        """Every case to run, grouped by (op, dtype, case) so that kernels share the reference."""
        quick = self.quick if quick is None else quick
        out = []
        for decl in hal.list_ops():
            if filtered and self.ops and not any(fnmatch.fnmatch(decl.name, p) for p in self.ops):
                continue
            kernels = self.kernels(decl)
            for dtype in decl.dtypes:
                if filtered and self.dtypes and dtype not in self.dtypes:
                    continue
                if decl.name not in all_cases():
                    out.append(Planned(decl.name, PLACEHOLDER_KERNEL, dtype, None, "no_cases"))
                    continue
                if not kernels:
                    out.append(Planned(decl.name, PLACEHOLDER_KERNEL, dtype, None, "no_kernel"))
                    continue
                for spec in cases_for(decl.name, dtype, quick):
                    out += [Planned(decl.name, kernel, dtype, spec) for kernel in kernels]
        return out

    def planned(self, case_id_text: str) -> Planned:
        """The planned case of an id (for ``reproduce``)."""
        parsed = parse_case_id(case_id_text)
        if parsed is None:
            raise ValueError(f"{case_id_text!r} is not a case id (op[kernel,dtype,case])")
        op, kernel, dtype, name = parsed
        decl = get_op(op)
        if kernel not in self.kernels(decl):
            raise ValueError(f"backend {self.backend} has no kernel {kernel!r} for {op}; kernels: {', '.join(self.kernels(decl))}")
        return Planned(op, kernel, dtype, find_case(op, name))

    def stale_xfails(self, collective_ids: Optional[Iterable[str]] = None) -> list[str]:
        """xfail ids matching no case of the backend: entries for registry ops are checked against
        every op, dtype and full-mode case; entries for other names (collectives) only against
        ``collective_ids``, the ids of a full collective run, when there was one."""
        registry = {d.name for d in hal.list_ops()}
        known = {p.id for p in self.plan(quick=False, filtered=False)} | set(collective_ids or ())
        judged = [i for i in self.xfails.entries if (parse_case_id(i) or ("",))[0] in registry or collective_ids is not None]
        return sorted(i for i in judged if i not in known)

    # --- running --------------------------------------------------------------------------------

    def run(self, planned: Iterable[Planned], progress: Optional[Callable[[Result], None]] = None) -> list[Result]:
        results = []
        for p in planned:
            r = self.run_case(p)
            results.append(r)
            if progress is not None:
                progress(r)
        return results

    def run_case(self, p: Planned) -> Result:
        """Run one planned case and classify it (xfail list applied, reproduction attached). Nothing
        is measured: the kernel under test is forced, and the ops it calls in turn (a composite's
        steps, the reference) take their priority choice, the same on every run (HAL_TUNE=off)."""
        with untuned():
            return self._classified(p)

    def _classified(self, p: Planned) -> Result:
        start = time.perf_counter()
        if p.spec is None:
            if p.placeholder == "no_cases":
                r = Result(p.op, p.kernel, p.dtype, p.case, "error", reason=f"the conformance suite has no cases for op {p.op}: add them in conformance/cases/")
            else:
                r = Result(p.op, p.kernel, p.dtype, p.case, "skip", reason=f"backend {self.backend} registers no kernel for {p.op}, and the op has no composite")
        else:
            try:
                r = self._run(p)
            except Exception as exc:  # a bug of the suite itself must not end the run
                r = Result(p.op, p.kernel, p.dtype, p.case, "error", reason=f"conformance suite error: {_describe(exc)}")
        r.duration_s = time.perf_counter() - start
        self.apply_xfail(r)
        if r.status not in ("pass", "skip") and p.spec is not None:
            r.repro = repro_snippet(r, self.backend, self.device_index, self.seed, str(self.torch_device))
        return r

    def apply_xfail(self, r: Result) -> None:
        """Turn a listed case's fail or error into xfail, and its pass into xpass."""
        known = self.xfails.reason(r.id)
        if known is None or r.status not in ("pass", "fail", "error"):
            return
        if r.status == "pass":
            r.status, r.reason = "xpass", f"listed as xfail ({known}) but passed: remove it from the xfail file"
        else:
            r.status, r.reason = "xfail", known + (f" ({r.reason})" if r.reason else "")

    def _run(self, p: Planned) -> Result:
        assert p.spec is not None
        decl = get_op(p.op)
        call = draw_call(p.op, p.dtype, p.spec, self.seed, self.torch_device)
        ref = self._reference(decl, p, call)
        res = Result(p.op, p.kernel, p.dtype, p.case, "error", k=ref.k)
        if ref.error is not None:
            res.reason = ref.error
            return res
        expected = self._expected_dtypes(decl, p.dtype, call, ref)
        returned = [c for c in ref.components if not c[0].startswith("@")]
        sizes = [(t.numel() * torch_dtype(dt).itemsize, dt) for (_, t), dt in zip(returned, expected) if t is not None]
        untouched = _snapshot(decl, call.args)
        try:
            with hal.use(backend=self.backend, kernel={p.op: p.kernel}), self.poisoner.around(sizes), _quiet(), checking_results():
                out = decl.entry(**call.args)  # kernels registered in-process: results checked against the op's fake
            got = self._components(decl, out, call.args)
        except UnsupportedError as exc:
            res.status, res.reason = "skip", _unsupported_reason(exc, self.backend, p.kernel)
            return res
        except Exception as exc:
            res.reason = f"kernel raised {_describe(exc)}"
            return res
        return self._judge(decl, p, call, ref, got, expected, untouched, res)

    def _judge(
        self,
        decl: OpDecl,
        p: Planned,
        call: Call,
        ref: _Reference,
        got: list[tuple[str, Optional[torch.Tensor]]],
        expected: list[str],
        untouched: list[tuple[str, torch.Tensor, torch.Tensor]],
        res: Result,
    ) -> Result:
        problems = []
        if len(got) != len(ref.components):
            problems.append(f"{len(got)} results, the reference has {len(ref.components)}")
        exact_op = cmp.is_exact_op(decl)
        slack = self._rounding_slack(decl, p, ref)
        first = True
        for (name, g), (_, want), dt in zip(got, ref.components, expected):
            label = name.lstrip("@")
            if g is None or want is None:
                if (g is None) != (want is None):
                    problems.append(f"{label}: {'None' if g is None else 'an array'}, the reference gives {'None' if want is None else 'an array'}")
                continue
            if dtype_name(g) != dt:
                problems.append(f"{label}: dtype {dtype_name(g)}, expected {dt}")
                continue
            atol, rtol = cmp.resolve(decl, p.dtype, dt, ref.k, max(call.scale, cmp.magnitude(want)), call.exact, self.overrides)
            c = cmp.compare(label, g, want, atol, rtol, ulps=exact_op, slack=rtol * slack if first and slack is not None else None)
            if first:
                res.atol, res.rtol, first = atol, rtol, False
            res.max_abs_err = max(res.max_abs_err or 0.0, c.max_abs_err)
            res.max_rel_err = max(res.max_rel_err or 0.0, c.max_rel_err)
            if c.max_ulp is not None:
                res.max_ulp = max(res.max_ulp or 0, c.max_ulp)
            if not c.ok:
                problems.append(c.message)
        for name, arr, before in untouched:
            if not _same_values(arr.detach(), before):
                problems.append(f"{name}: the kernel wrote into this input, which {p.op} must leave unchanged")
        res.status = "fail" if problems else "pass"
        res.reason = "; ".join(problems) or None
        return res

    # --- the reference --------------------------------------------------------------------------

    def _reference(self, decl: OpDecl, p: Planned, call: Call) -> _Reference:
        key = (p.op, p.dtype, p.case)
        if self._ref_key != key or self._ref is None:
            self._ref_key, self._ref = key, self._compute_reference(decl, call)
        return self._ref

    def _compute_reference(self, decl: OpDecl, call: Call) -> _Reference:
        args = [call.args.get(q.name, q.default) for q in decl.params]
        try:
            canon, subs, _ = canonical_call(decl, args)
        except HalError as exc:
            return _Reference([], 1, f"the case's arguments are invalid ({_describe(exc)}): a bug in conformance/cases/")
        k = int(decl.reduction(decl.bind(canon))) if decl.reduction is not None else 1
        ref_args = [_upcast(a, q.name in call.keep_dtype) if q.kind in ARRAY_KINDS else a for q, a in zip(decl.params, args)]
        for i, v in subs:
            ref_args[i] = v
        for name, v in call.reference_args.items():
            ref_args[decl.index(name)] = v
        try:
            with _quiet():
                with hal.use(backend=self.reference):
                    out = decl.entry(**dict(zip(decl.param_names, ref_args)))
            named = dict(zip(decl.param_names, ref_args))
            comps = self._components(decl, out, named)
        except Exception as exc:
            return _Reference([], k, f"the reference ({self.reference_label}) raised {_describe(exc)}")
        return _Reference(comps, k, args=named)

    def _rounding_slack(self, decl: OpDecl, p: Planned, ref: _Reference) -> Optional[torch.Tensor]:
        """For the composite, ``|intermediate|`` of the value its steps round between them (the
        first result may be off by one more rounding of it, see ``Decomposition.rounds``); else None."""
        fallback = decl.fallback_decomposition
        if p.kernel != "composite" or fallback is None or fallback.rounds is None:
            return None
        if ref.rounded is None:
            with _quiet(), hal.use(backend=self.reference):
                ref.rounded = _to_cpu(fallback.rounds(ref.args)).to(torch.float64).abs()
        return ref.rounded

    @staticmethod
    def _components(decl: OpDecl, out: Any, args: dict[str, Any]) -> list[tuple[str, Optional[torch.Tensor]]]:
        """Returned arrays ("out", "out[i]"), then the arrays written in place ("@name", "@name[i]")."""
        comps: list[tuple[str, Any]] = []
        if out is not None:
            comps += _flatten("out", out) if isinstance(out, (list, tuple)) else [("out", out)]
        for name in decl.mutates:
            comps += [(f"@{n}", v) for n, v in _flatten(name, args.get(name)) if v is not None]
        return [(n, _to_cpu(v)) for n, v in comps]

    @staticmethod
    def _expected_dtypes(decl: OpDecl, case_dtype: str, call: Call, ref: _Reference) -> list[str]:
        """dtype each result component must have: the case's result_dtypes (default: the case
        dtype) for returned arrays, the argument's own dtype for arrays written in place."""
        returned = [n for n, _ in ref.components if not n.startswith("@")]
        declared = list(call.result_dtypes or ())
        out = [declared[i] if i < len(declared) else case_dtype for i in range(len(returned))]
        for name, _ in ref.components[len(returned):]:
            base, _, index = name[1:].partition("[")
            value = call.args[base]
            if index:
                value = value[int(index.rstrip("]"))]
            out.append(dtype_name(value))
        return out


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No NumPy floating-point warnings: cases feed NaN, infinities and overflowing values on purpose."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _upcast(value: Any, keep: bool) -> Any:
    """A CPU copy of an argument for the reference: float arrays in float64 (unless ``keep``),
    others as they are; lists element by element; numbers unchanged."""
    if isinstance(value, (list, tuple)):
        return [_upcast(v, keep) for v in value]
    if not is_array(value):
        return value
    t = value.detach()
    dtype = torch.float64 if t.is_floating_point() and not keep else t.dtype
    return t.to("cpu", dtype, copy=True).contiguous()


def _describe(exc: BaseException) -> str:
    """``Type: message`` and the innermost frame, on one line."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:600]}{where}"


def _unsupported_reason(exc: UnsupportedError, backend: str, kernel: str) -> str:
    """Why a forced kernel cannot run a case: its candidate line in the dispatcher's message
    ("cuda/triton [forced]: dtype float64 not supported ..."), else the message's first line."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    mine = [ln for ln in lines if ln.startswith(f"{backend}/{kernel}")]
    return f"the kernel declines these inputs: {(mine or lines or ['(no message)'])[0]}"


def reproduce(case_id_text: str, backend: Optional[str] = None, device: int = 0, seed: int = 0, poison: bool = True) -> Result:
    """Run one case again, exactly as the suite ran it (same seed, same poisoning), and return its
    result; ``print()`` it to see the status, errors and worst element."""
    suite = Suite(backend, device, seed, poison=poison)
    return suite.run_case(suite.planned(case_id_text))


#: The keys of a result record (API.md's report schema), as ``collectives.run`` must return them.
RECORD_KEYS = ("op", "kernel", "dtype", "case", "status", "max_abs_err", "max_rel_err", "atol", "rtol", "reason")


def run_collectives(suite: Suite, world_size: int) -> tuple[list[Result], list[str]]:
    """The collective cases on ``world_size`` processes, and notes for the report.

    They live in ``hal.conformance.collectives`` (written with hal.dist), which must provide::

        run(world_size: int, device: str, seed: int, quick: bool) -> list[dict]

    ``device`` is the torch device type of the backend under test ("cuda" or "cpu"); the module
    spawns the ranks itself. Each dict is a result record with the keys of :data:`RECORD_KEYS`
    (``op`` = collective name, ``kernel`` = algorithm); the suite applies the backend's xfail list.
    """
    try:
        from . import collectives
    except ModuleNotFoundError as exc:
        if exc.name != f"{__package__}.collectives":
            raise
        note = (
            f"--world-size {world_size}: hal.conformance.collectives is not part of this installation "
            "(the collective cases come with hal.dist), so no collective case ran"
        )
        return [Result("collectives", PLACEHOLDER_KERNEL, "-", f"world_size_{world_size}", "error", reason=note)], [note]
    out = []
    for rec in collectives.run(world_size=world_size, device=suite.torch_device.type, seed=suite.seed, quick=suite.quick):
        missing = [k for k in RECORD_KEYS if k not in rec]
        if missing or rec.get("status") not in STATUSES:
            why = f"missing keys {missing}" if missing else f"status {rec.get('status')!r} is not one of {', '.join(STATUSES)}"
            out.append(Result(str(rec.get("op", "collectives")), str(rec.get("kernel", PLACEHOLDER_KERNEL)), str(rec.get("dtype", "-")), str(rec.get("case", "invalid_record")), "error", reason=f"collectives.run returned a malformed record ({why}): {rec}"))
            continue
        r = Result(**{k: rec[k] for k in RECORD_KEYS})
        for extra in ("max_ulp", "duration_s", "repro"):
            if extra in rec:
                setattr(r, extra, rec[extra])
        suite.apply_xfail(r)
        out.append(r)
    return out, []
