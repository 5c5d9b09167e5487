"""``hal conformance --model``: a model's training steps on a backend, compared call by call with the
reference, the first call past its budget confirmed by forcing kernels to the reference.

Every op of a backend can pass its conformance cases while a model still trains differently on it
(a shape, a layout or a value range no case has). This mode finds the call:

1. the model (built-in or ``module:callable``, :mod:`~hal.conformance.model_zoo`) trains for a few
   steps on the backend under test, in its own dtype, recording every hal call: op, kernel, call
   site, arguments, results and gradients (:mod:`~hal.conformance.model_record`);
2. a copy trains the same steps on the reference (cpu_ref by default) in float64;
3. the runs are compared call by call, each result within a budget derived from the op's declared
   tolerance and reduction length plus the error the call inherited (:mod:`~hal.conformance.model_compare`);
4. the first call past its budget is confirmed by bisection over forced kernels: the model runs
   again with that call forced to the reference (its backward too), and the divergence must go
   away. When it does not, the group of calls up to it is bisected for the earliest call whose
   forcing (with the calls after it) removes it. A call that runs as a decomposition is bisected
   once more over the ops inside it, so the report names one op, one kernel and one call site.

The loss of every step of both runs is reported beside it (the loss curves);
:mod:`~hal.conformance.model_golden` keeps them per device and compares runs with them.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from hal import config
from hal.dispatch import DISPATCHER
from hal.errors import BackendUnavailableError

from . import compare as cmp
from . import model_zoo
from .model_compare import Check, Comparison, compare_runs, summarise
from .model_record import CallRecord, KernelRun, Path, Recorder, Recording, train
from .runner import REFERENCE_BACKEND, default_backend

OPTIMIZERS = ("sgd", "adamw")


@dataclasses.dataclass(frozen=True)
class Settings:
    """What a model check runs: the backend under test (None: the best device backend, not forced),
    the reference, the steps and the optimizer (``sgd``: ``torch.optim.SGD``; ``adamw``:
    ``hal.optim.AdamW``, whose ``fused_adamw_`` calls are then compared too)."""

    backend: Optional[str] = None
    device: int = 0
    reference: str = REFERENCE_BACKEND
    steps: int = 3
    lr: float = 0.05
    optimizer: str = "sgd"
    size: str = "tiny"
    seed: int = 0
    #: HAL_TUNE of the runs under test: "cached" (measured choices on disk are used, nothing is
    #: measured: every run chooses the same kernels) or "off" (priority alone); None: "off" where
    #: the environment says HAL_TUNE=off, else "cached"
    tune: Optional[str] = None
    bisect: bool = True
    #: the dtype the model and its float inputs are cast to for the run under test (None: as built)
    dtype: Optional[str] = None


@dataclasses.dataclass
class Culprit:
    """What the report names: the op and kernel that diverge, where they were called."""

    op: str
    backend: str
    kernel: str
    #: "forward" or "backward" (a backward op's kernel; or the forward kernel's own backward where
    #: torch's autograd records it: ``route`` "recorded")
    phase: str
    route: str
    path: Path

    @property
    def label(self) -> str:
        return f"{self.op} ({self.backend}/{self.kernel})"


@dataclasses.dataclass
class Trial:
    """One re-run with calls forced to the reference (their paths as lists), whether the divergence
    went away, and what came first then."""

    forced: list[list[int]]
    vanished: bool
    first_after: Optional[str]


@dataclasses.dataclass
class Confirmation:
    """The bisection's outcome: whether forcing calls removed the divergence, which, and its runs."""

    confirmed: bool
    #: the calls whose forcing removes the divergence
    forced: list[Path]
    reason: str
    trials: list[Trial] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class ModelResult:
    """The outcome of one model: ``status`` pass, fail (a call past its budget, or the runs' calls
    parted), error (the model or a run raised) or skip (``--model all`` on a machine without a
    package the model needs: ``skip_reason`` says which)."""

    name: str
    description: str
    status: str
    settings: Settings
    backend: str
    device: str
    reference_device: str
    test: Optional[Recording] = None
    reference: Optional[Recording] = None
    comparison: Optional[Comparison] = None
    first: Optional[Check] = None
    call: Optional[CallRecord] = None
    culprit: Optional[Culprit] = None
    confirmation: Optional[Confirmation] = None
    error: Optional[str] = None
    duration_s: float = 0.0
    skip_reason: Optional[str] = None

    @property
    def summary_line(self) -> str:
        if self.status == "error":
            return f"{self.name}: ERROR {self.error}"
        if self.status == "skip":
            return f"{self.name}: skipped: {self.skip_reason}"
        if self.status == "pass":
            n = len(self.test.calls) if self.test else 0
            return f"{self.name}: pass ({n} calls, {len(self.comparison.checks) if self.comparison else 0} checks)"
        if self.first is None:
            return f"{self.name}: FAIL {self.comparison.mismatch if self.comparison else ''}"
        c, call = self.first, self.call
        assert call is not None
        culprit = self.culprit.label if self.culprit else f"{call.op} ({call.backend}/{call.kernel})"
        confirmed = ("confirmed" if self.confirmation.confirmed else "NOT confirmed") if self.confirmation else "not bisected"
        return (f"{self.name}: FAIL at call #{c.index} {culprit}, {c.kind} {c.component} at {call.site} "
                f"(step {call.step}, {c.used:.3g}x its budget; {confirmed})")


def _device_of(backend: str, index: int) -> torch.device:
    state = DISPATCHER.runtime().backends.get(backend)
    if state is None:
        raise BackendUnavailableError(
            f"backend {backend!r} is not installed; installed backends: {', '.join(sorted(DISPATCHER.runtime().backends)) or 'none'}")
    if not state.available:
        raise BackendUnavailableError(f"backend {backend!r} is installed but not usable here: {state.reason}")
    if "cpu" in state.info.device_types:
        return torch.device("cpu")
    return torch.device(f"cuda:{index}")


def _reference_device(reference: str, test_device: torch.device) -> torch.device:
    """The test's device where the reference backend serves its kind, else the CPU."""
    state = DISPATCHER.runtime().backends.get(reference)
    if state is None or not state.available:
        why = "is not installed" if state is None else f"is not usable here: {state.reason}"
        fix = " (pip install hal-backend-cpu-ref)" if reference == REFERENCE_BACKEND else ""
        raise BackendUnavailableError(f"the reference backend {reference!r} {why}{fix}")
    kinds = state.info.device_types
    if test_device.type == "cuda" and ("cuda" in kinds or "rocm" in kinds):
        return test_device
    return torch.device("cpu")


def _optimizer(settings: Settings) -> Callable[[Any], torch.optim.Optimizer]:
    if settings.optimizer == "sgd":
        return lambda params: torch.optim.SGD(params, lr=settings.lr)
    if settings.optimizer == "adamw":
        import hal

        return lambda params: hal.optim.AdamW(params, lr=settings.lr)
    raise ValueError(f"optimizer {settings.optimizer!r}: one of {', '.join(OPTIMIZERS)}")


class ModelCheck:
    """The runs of one model (module docstring). ``case`` is built once; every run trains a fresh
    copy of its model from the same initial weights."""

    def __init__(self, case: model_zoo.ModelCase, settings: Settings) -> None:
        self.case = case
        self.settings = settings
        self.backend = settings.backend or default_backend()
        self.device = _device_of(self.backend, settings.device)
        self.reference_device = _reference_device(settings.reference, self.device)
        self.pristine = copy.deepcopy(case.model)
        self.tune = settings.tune or ("off" if config.tune_mode() == "off" else "cached")
        plugin = next((lp.plugin for lp in DISPATCHER.runtime().plugins
                       if lp.plugin is not None and lp.plugin.backend is not None and lp.plugin.backend.name == self.backend), None)
        self.overrides = cmp.load_overrides(self.backend, plugin)
        self.runs = 0

    def run_test(self, forced: Iterable[Path] = (), steps: Optional[int] = None) -> Recording:
        """The model trained on the backend under test, ``forced`` calls on the reference."""
        dtype = getattr(torch, self.settings.dtype) if self.settings.dtype else None
        model = copy.deepcopy(self.pristine).to(device=self.device, dtype=dtype)
        batch = model_zoo.converted(self.case.batch, self.device, dtype)
        recorder = Recorder(backend=self.settings.backend, reference_backend=self.settings.reference,
                            reference_device=self.reference_device, forced=forced, tune=self.tune, model=model)
        torch.manual_seed(self.settings.seed)
        losses = train(self.case, model, batch, recorder, steps or self.settings.steps, _optimizer(self.settings))
        self.runs += 1
        return Recording(recorder.calls, losses, self.backend, str(self.device), _dtype_of(model))

    def run_reference(self) -> Recording:
        """The model trained on the reference backend, in float64."""
        model = copy.deepcopy(self.pristine).to(device=self.reference_device, dtype=torch.float64)
        batch = model_zoo.converted(self.case.batch, self.reference_device, torch.float64)
        recorder = Recorder(backend=self.settings.reference, reference_backend=self.settings.reference,
                            reference_device=self.reference_device, tune="off", model=model)
        torch.manual_seed(self.settings.seed)
        losses = train(self.case, model, batch, recorder, self.settings.steps, _optimizer(self.settings))
        return Recording(recorder.calls, losses, self.settings.reference, str(self.reference_device), "float64")

    def compare(self, test: Recording, ref: Recording) -> Comparison:
        return compare_runs(test, ref, self.settings.reference, self.reference_device, self.overrides)

    # --- bisection ---------------------------------------------------------------------------------

    def _trial(self, forced: Sequence[Path], first: Check, ref: Recording, trials: list[Trial]) -> bool:
        """Re-run with ``forced`` on the reference (the steps up to the divergence's): whether no
        check at or before ``first`` fails now."""
        try:
            test = self.run_test(forced, steps=first.order[0] + 1)
            now = self.compare(test, ref)
        except Exception as exc:  # noqa: BLE001 - a re-run that fails is a trial that removed nothing
            trials.append(Trial([list(p) for p in forced], False, f"the re-run raised {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"))
            return False
        after = now.first
        vanished = (after is None or after.order > first.order) and (now.mismatch is None or now.aligned > first.index)
        described = None
        if after is not None:
            call = test.calls[after.index]
            described = f"call #{after.index} {call.op} ({call.backend}/{call.kernel}) {after.kind} {after.component}"
        elif now.mismatch:
            described = now.mismatch
        trials.append(Trial([list(p) for p in forced], vanished, described))
        return vanished

    def confirm(self, first: Check, test: Recording, ref: Recording) -> tuple[Confirmation, Culprit]:
        """Bisection over forced kernels (module docstring, step 4)."""
        trials: list[Trial] = []
        i = first.index
        call = test.calls[i]
        if self._trial([(i,)], first, ref, trials):
            culprit = self._refine(first, call, ref, trials)
            return Confirmation(True, [culprit.path], f"forcing call #{i} to {self.settings.reference} removes the divergence", trials), culprit
        group = [(j,) for j in range(i + 1)]
        if not self._trial(group, first, ref, trials):
            return (Confirmation(False, [], f"the divergence persists with every hal call up to #{i} forced to {self.settings.reference}'s "
                                 "kernels: it comes from torch's own ops between the calls or from nondeterminism, or the reference's "
                                 "kernel itself misses the op's tolerance at this dtype", trials),
                    _culprit_of(call, first.kind))
        lo, hi = 0, i  # forcing calls lo..i removes it; forcing hi..i does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._trial([(j,) for j in range(mid, i + 1)], first, ref, trials):
                lo = mid
            else:
                hi = mid
        source = test.calls[lo]
        if self._trial([(lo,)], first, ref, trials):
            return (Confirmation(True, [(lo,)], f"forcing call #{lo} to {self.settings.reference} removes the divergence first seen at call #{i}", trials),
                    _culprit_of(source, "output"))
        return (Confirmation(False, [(j,) for j in range(lo, i + 1)],
                             f"only forcing calls #{lo} to #{i} together removes the divergence; no single call does", trials),
                _culprit_of(source, "output"))

    def _refine(self, first: Check, call: CallRecord, ref: Recording, trials: list[Trial]) -> Culprit:
        """For a call that ran as a decomposition: the op inside it whose forcing alone removes the
        divergence (halving the candidates each run), else the call itself."""
        nested = call.nested()
        if call.route != "decomposition" or not nested:
            return _culprit_of(call, first.kind)
        candidates = [k.path for k in nested]
        verified = False
        while len(candidates) > 1:
            half, rest = candidates[: len(candidates) // 2], candidates[len(candidates) // 2:]
            if self._trial(half, first, ref, trials):
                candidates = half
            elif self._trial(rest, first, ref, trials):
                candidates = rest
            else:
                return _culprit_of(call, first.kind)
            verified = True
        if verified or self._trial(candidates, first, ref, trials):
            run = next(k for k in nested if k.path == candidates[0])
            return _inner_culprit(call, run, first.kind)
        return _culprit_of(call, first.kind)


def _dtype_of(model: torch.nn.Module) -> str:
    p = next((t for t in model.parameters() if t.is_floating_point()), None)
    return str(p.dtype).removeprefix("torch.") if p is not None else "-"


def _culprit_of(call: CallRecord, kind: str) -> Culprit:
    """The kernel a divergence of ``kind`` names: for a gradient, the backward op's kernel that the
    call's hal node ran, else the call's own kernel."""
    if kind == "gradient":
        mine = [k for k in call.backward_runs() if k.path == call.path]
        if mine:
            return Culprit(mine[0].op, mine[0].backend, mine[0].kernel, "backward", mine[0].route, call.path)
        return Culprit(call.op, call.backend, call.kernel, "backward", call.route, call.path)
    return Culprit(call.op, call.backend, call.kernel, "forward", call.route, call.path)


def _inner_culprit(call: CallRecord, run: KernelRun, kind: str) -> Culprit:
    if kind == "gradient":
        mine = [k for k in call.backward_runs() if k.path == run.path]
        if mine:
            return Culprit(mine[0].op, mine[0].backend, mine[0].kernel, "backward", mine[0].route, run.path)
    return Culprit(run.op, run.backend, run.kernel, "backward" if kind == "gradient" else "forward", run.route, run.path)


def check_model(name: str, settings: Settings, case: Optional[model_zoo.ModelCase] = None,
                log: Callable[[str], None] = lambda _: None) -> ModelResult:
    """Run, compare and bisect one model (module docstring); errors become an ``error`` result."""
    start = time.perf_counter()
    result = ModelResult(name, "", "error", settings, settings.backend or "?", "?", "?")
    try:
        case = case or model_zoo.build(name, settings.size, settings.seed)
        result.description = case.description
        check = ModelCheck(case, settings)
        result.backend, result.device, result.reference_device = check.backend, str(check.device), str(check.reference_device)
        log(f"{name}: {settings.steps} steps on {check.backend} ({check.device}) and on {settings.reference} in float64")
        result.test = check.run_test()
        if not result.test.calls:
            raise ValueError(f"model {name} made no hal call in {settings.steps} steps: nothing to compare (a model compiled with "
                             "torch.compile is not observed; run it eagerly, with hal.ops, hal.nn.fuse or hal.nn.patch)")
        result.reference = check.run_reference()
        result.comparison = check.compare(result.test, result.reference)
        result.first = result.comparison.first
        result.status = "pass" if result.first is None and result.comparison.mismatch is None else "fail"
        if result.first is not None:
            result.call = result.test.calls[result.first.index]
            if settings.bisect:
                log(f"{name}: call #{result.first.index} ({result.call.op}) is past its budget; bisecting over forced kernels")
                result.confirmation, result.culprit = check.confirm(result.first, result.test, result.reference)
            else:
                result.culprit = _culprit_of(result.call, result.first.kind)
    except Exception as exc:  # noqa: BLE001 - one model failing to run is reported, the others go on
        import traceback

        frames = traceback.extract_tb(exc.__traceback__)
        where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
        result.status, result.error = "error", f"{type(exc).__name__}: {' '.join(str(exc).split())[:800]}{where}"
    result.duration_s = time.perf_counter() - start
    return result


def calls_table(result: ModelResult) -> list[dict[str, Any]]:
    """The per-call rows of a result (empty where the runs did not finish)."""
    if result.test is None or result.comparison is None:
        return []
    return summarise(result.test.calls, result.comparison)


def loss_gap(result: ModelResult) -> Optional[float]:
    """The largest relative difference of the two loss curves (None without both)."""
    if not result.test or not result.reference or not result.test.losses:
        return None
    gaps = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(result.test.losses, result.reference.losses)]
    return max(gaps) if gaps and all(math.isfinite(g) for g in gaps) else math.inf
