"""``hal.optimize(model, optimizer)``: the fastest training step hal can build, chosen by measurement.

The step (:class:`OptimizedStep`) runs forward, loss, backward, optimizer step and ``zero_grad``
in one call. It has two *variants*: ``torch``, your model and optimizer untouched (``None``: a
``torch.optim.AdamW`` with torch's defaults), and ``hal``, the model rewritten (``hal.nn.fuse``,
else ``hal.nn.patch``) with the optimizer replaced by ``hal.optim.AdamW`` where that is the same
update (:mod:`.plan`). Each runs in the modes eager, ``torch.compile`` of forward and loss together,
and on CUDA the whole step as a CUDA graph, eager or compiled. On the first call every candidate
runs a few steps on that batch and the fastest is kept, the simpler one (untouched before
rewritten, eager before compiled) where they are within ``margin``: the step is never slower, as
measured on that batch, than your own model and optimizer run eagerly, compiled or graphed.

Measuring must not train: the parameters, buffers, gradients, optimizer and scaler state and random
generators are saved before and written back after (:mod:`.state`), so that after N calls the model
is what N steps of a plain loop make of it: to float rounding for the candidates that run your
model's own ops eagerly (the rewritten ones round differently, as do compiled and captured ones);
random ops such as dropout draw the same numbers as a plain loop in the eager candidates, and other
numbers of the same distribution under ``torch.compile`` (Inductor generates its own random
numbers), so a compiled step with dropout is a different, equally valid, training run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import statistics
import time
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from hal.errors import InvalidArgumentError
from hal.fast import plan
from hal.fast.plan import Decision
from hal.fast.state import Snapshot
from hal.nn.weight_copies import WeightCopies

log = logging.getLogger("hal")

#: how a variant's step can run, simplest first
MODES = ("eager", "compile", "graph", "compile+graph")
#: whose model and optimizer run: yours untouched, or hal's rewrite (a tie goes to yours)
VARIANTS = ("torch", "hal")
#: every candidate, simplest first (a tie goes to the simpler one)
CANDIDATES = tuple(f"{v} {m}" for v in VARIANTS for m in MODES)
#: torch.compile modes that capture CUDA graphs of their own (hal's whole-step graph is then left out)
_CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


def _make_capturable(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Set ``capturable=True`` on the param groups of a torch optimizer that has the option and has
    it off (a captured step's optimizer must keep its step counts on the device), moving step counts
    already made on the host to their parameter's device; returns the groups it changed."""
    changed = []
    for group in optimizer.param_groups:
        if "capturable" not in group or group["capturable"]:
            continue
        group["capturable"] = True
        changed.append(group)
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            step = state.get("step")
            if isinstance(step, torch.Tensor) and step.device != p.device:
                state["step"] = step.to(device=p.device, dtype=torch.float32)
    return changed


@dataclasses.dataclass
class Trial:
    """One candidate measured on the first batch: per-step wall times (ms, after its warm-up calls),
    what the warm-up cost (compilation, capture), why it could not run, or why it was skipped."""

    name: str
    times_ms: list[float] = dataclasses.field(default_factory=list)
    warmup_s: float = 0.0
    error: Optional[str] = None
    skipped: Optional[str] = None
    #: on CUDA, how far device memory grew above what was allocated before the candidate ran, at its
    #: peak over its warm-up (a graph's capture included) and timed steps: the step's activations and
    #: workspaces, and its optimizer state where it made it (GiB; None elsewhere)
    grew_gib: Optional[float] = None
    #: the exception of a failed candidate, kept only while the choice is made
    exception: Optional[BaseException] = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def median_ms(self) -> Optional[float]:
        return statistics.median(self.times_ms) if self.times_ms and self.error is None and self.skipped is None else None

    def __str__(self) -> str:
        if self.skipped is not None:
            return f"{self.name}: skipped ({self.skipped})"
        if self.error is not None:
            return f"{self.name}: failed ({self.error})"
        times = ", ".join(f"{t:.2f}" for t in self.times_ms)
        grew = "" if self.grew_gib is None else f"; device memory +{self.grew_gib:.2f} GiB at its peak"
        return f"{self.name}: {self.median_ms:.2f} ms/step (median of [{times}]; warm-up {self.warmup_s:.2f} s{grew})"


@dataclasses.dataclass
class OptimizeReport:
    """What :func:`optimize` did and why, as data (``explain()`` prints it). ``rewrite`` and
    ``optimizer`` describe the ``hal`` variant; ``untouched`` the ``torch`` one."""

    model: str
    device: str
    rewrite: Decision
    optimizer: Decision
    precision: str
    weights: str
    compile: Decision
    graph: Decision
    untouched: str = ""
    recompute: Decision = Decision("none", "activations held from forward to backward (recompute=None)")
    fp8: Decision = Decision("none", "linear layers in the autocast dtype (fp8=None)")
    chosen: Optional[str] = None  # None until the first call
    why: str = ""  # why the chosen candidate
    trials: list[Trial] = dataclasses.field(default_factory=list)
    measuring_s: float = 0.0
    extra_steps: int = 0  # steps run while measuring (undone)
    snapshot: str = ""
    kernel_measurements: int = 0  # hal's own measured kernel choices made meanwhile (HAL_TUNE)
    notes: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Variant:
    """A model and the optimizer that steps it: ``torch`` (yours, untouched) or ``hal`` (rewritten)."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    copies: Optional[WeightCopies] = None  # half-precision copies of its linear weights (hal's variant under autocast)


class OptimizedStep:
    """A training step: ``loss = step(*batch)`` runs forward, loss, backward, optimizer step and
    ``optimizer.zero_grad(set_to_none=True)``, and returns the loss (detached). Build it with
    :func:`hal.optimize`; ``explain()`` says what it does and why.

    ``model`` and ``optimizer``: those of the chosen candidate (before the first call, the rewritten
    ones): your model and optimizer when an untouched candidate won; else the fused GraphModule (your
    modules and parameters) or your model patched in place, and hal's AdamW where it replaced yours
    (checkpoint ``step.optimizer``, the one that steps). ``scaler``: the loss scaler (float16) or
    None. ``report``: the decisions as data. ``train()`` / ``eval()`` set the mode of every model."""

    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
                 loss_fn: Optional[Callable[..., torch.Tensor]] = None, inputs: int = 1,
                 amp: Optional[torch.dtype] = None, scaler: Any = None, rewrite: str = "auto",
                 replace_optimizer: bool = True, compile: Optional[bool] = None, compile_mode: Optional[str] = None,
                 graph: Optional[bool] = None, measure_steps: int = 5, margin: float = 0.03,
                 candidates: Optional[Sequence[str]] = None, recompute: Optional[str] = None, fp8: Any = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"hal.optimize: model must be a torch.nn.Module, not {type(model).__name__}")
        if amp not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"hal.optimize: amp must be None, torch.bfloat16 or torch.float16 (the autocast dtype), not {amp!r}")
        _check_int("inputs", inputs, "how many leading arguments the model takes")
        if inputs < 0:
            raise ValueError(f"hal.optimize: inputs (how many leading arguments the model takes) must be >= 0, not {inputs}")
        _check_int("measure_steps", measure_steps, "timed steps per candidate")
        if measure_steps < 1:
            raise ValueError(f"hal.optimize: measure_steps must be at least 1, not {measure_steps}; pass compile= and graph= to skip measuring")
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0.0 <= margin < 1.0:
            raise InvalidArgumentError("hal.optimize", "margin", "a number in [0, 1) (how much faster than a simpler candidate "
                                       "another must be to be chosen; 0.03 is 3%)", repr(margin))
        if compile_mode is not None:
            try:  # torch checks the mode when torch.compile is called (nothing is compiled before a call)
                torch.compile(_check_int, mode=compile_mode)
            except RuntimeError as exc:
                raise InvalidArgumentError("hal.optimize", "compile_mode", f"a torch.compile mode ({exc})", repr(compile_mode)) from exc
        param = next(iter(model.parameters()), None)
        if param is not None and param.is_meta:
            raise InvalidArgumentError("hal.optimize", "model", "a model whose parameters hold values (on the meta device they "
                                       "have none: materialise them first, e.g. model.to_empty(device=...) and initialise)",
                                       f"{type(model).__name__} with parameters on the meta device")
        self.device = param.device if param is not None else torch.device("cpu")
        self._user_model, self._user_optimizer = model, optimizer
        self.loss_fn, self.inputs, self.amp = loss_fn, inputs, amp
        self.measure_steps, self.margin, self.compile_mode = measure_steps, margin, compile_mode
        rewritten, rewrite_decision = plan.rewrite(model, rewrite)
        rewritten, fp8_decision = plan.fp8(model, rewritten, fp8)
        self._fp8 = fp8
        rewritten, recompute_decision = plan.recompute(model, rewritten, recompute)
        hal_optimizer, opt_decision = plan.choose_optimizer(model, optimizer, replace_optimizer)
        if optimizer is None:
            yours = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
            untouched = "your model with torch.optim.AdamW (torch's defaults; no optimizer given)"
        else:
            yours, untouched = optimizer, f"your model and your {type(optimizer).__name__}, as given"
        self._variants = {"torch": Variant("torch", model, yours)}
        if rewritten is not model or hal_optimizer is not yours:
            copies = self._weight_copies(model, rewritten, rewrite_decision, amp)
            if copies is not None:
                copies.hand_to(hal_optimizer)  # hal.optim.AdamW writes them in its update's kernel
            self._variants["hal"] = Variant("hal", rewritten, hal_optimizer, copies)
        else:
            untouched += " (the rewrite changed nothing: no 'hal' variant)"
        chosen_first = self._variants.get("hal", self._variants["torch"])
        self.model, self.optimizer = chosen_first.model, chosen_first.optimizer
        self._copy_hyper = False
        self._hyper: tuple = ()
        precision = "float32 (no autocast)" if amp is None else f"torch.autocast({self.device.type}, {str(amp).removeprefix('torch.')})"
        if amp is torch.float16 and scaler is None:
            import hal.amp

            scaler = hal.amp.DynamicLossScaler()
            precision += " with hal.amp.DynamicLossScaler (float16 needs loss scaling)"
        elif scaler is not None:
            precision += f" with {type(scaler).__name__}"
        self.scaler = scaler
        self._names, self._skipped, compile_d, graph_d = self._candidates(compile, graph, candidates)
        copies = self._variants["hal"].copies if "hal" in self._variants else None
        weights = ("as they are (float32 under autocast: cast by each linear, forward and backward)" if amp is not None and copies is None
                   else "as they are" if copies is None else
                   f"{len(copies)} weights ({', '.join(f'{n} {kind}' for kind, n in copies.readers.items())}) read as "
                   f"{str(copies.dtype).removeprefix('torch.')} copies ({copies.nbytes / 2**20:.0f} MiB; "
                   f"no cast per linear, forward or backward; weight gradients leave the GEMM in float32), {_written_when(copies)}, "
                   "in the 'hal' variant: autocast's numbers (hal.nn.weight_copies)")
        self.report = OptimizeReport(type(model).__name__, str(self.device), rewrite_decision, opt_decision, precision, weights, compile_d, graph_d,
                                     untouched, recompute_decision, fp8_decision)
        self._compiled: dict[str, Callable[..., torch.Tensor]] = {}
        self._runs: dict[str, Callable[..., torch.Tensor]] = {}
        self._made_capturable: list[dict] = []  # param groups a graph candidate set capturable (undone unless a graph wins)
        self._run: Optional[Callable[..., torch.Tensor]] = None
        self._graph: Any = None  # the GraphedStep in use, if any
        self._chosen_copies: Optional[WeightCopies] = None  # the chosen variant's weight copies, if any

    # --- the candidates ------------------------------------------------------------------------

    def _candidates(self, compile: Optional[bool], graph: Optional[bool],
                    only: Optional[Sequence[str]]) -> tuple[list[str], dict[str, str], Decision, Decision]:
        """The candidates to measure, those skipped (with the reason), and the compile and graph
        decisions as far as they are known now. ``only``: the ``candidates`` argument."""
        compiles = [False, True] if compile is None else [bool(compile)]
        compile_d = Decision("measure" if compile is None else ("yes" if compile else "no"),
                             "to be measured on the first call" if compile is None else f"compile={compile}")
        cuda_reason = None if self.device.type == "cuda" and torch.cuda.is_available() else f"the model is on {self.device}, not a CUDA device"
        skip_graphs = None
        if graph is False:
            graphs, graph_d = [False], Decision("no", "graph=False")
        elif cuda_reason is not None:
            graphs, graph_d = [False], Decision("no", cuda_reason)
            skip_graphs = f"CUDA graphs need a CUDA device; {cuda_reason}"
            if graph:
                log.warning("hal.optimize: graph=True ignored: %s", cuda_reason)
        else:
            graphs = [False, True] if graph is None else [True]
            graph_d = Decision("measure" if graph is None else "yes", "to be measured on the first call" if graph is None else "graph=True")
        modes = []
        for g in graphs:
            for c in compiles:
                if g and c and self.compile_mode in _CUDAGRAPH_MODES:
                    continue  # torch.compile captures its own graphs in these modes
                modes.append({(False, False): "eager", (True, False): "compile", (False, True): "graph", (True, True): "compile+graph"}[(c, g)])
        if not modes:  # compile=True, graph=True with a cudagraph compile mode
            modes = ["compile"]
        names = [f"{v} {m}" for v in self._variants for m in modes]
        skipped = {}
        if skip_graphs is not None:  # listed, so that explain() shows what this device leaves out
            for v in self._variants:
                for c in compiles:
                    if not (c and self.compile_mode in _CUDAGRAPH_MODES):
                        skipped[f"{v} {'compile+graph' if c else 'graph'}"] = skip_graphs
        if only is not None:
            unknown = [n for n in only if n not in CANDIDATES]
            if unknown or isinstance(only, str):
                raise ValueError(f"hal.optimize: candidates must be a list of names among {', '.join(CANDIDATES)}, not {only!r}")
            possible = sorted(names, key=CANDIDATES.index)
            names, skipped = [n for n in names if n in only], {n: why for n, why in skipped.items() if n in only}
            if not names:
                raise ValueError(f"hal.optimize: none of candidates={list(only)} can run with these options here (possible: "
                                 f"{', '.join(possible)}); leave candidates=None to measure them all")
        return sorted(names, key=CANDIDATES.index), skipped, compile_d, graph_d

    @staticmethod
    def _weight_copies(model: nn.Module, rewritten: nn.Module, rewrite: Decision, amp: Optional[torch.dtype]) -> Optional[WeightCopies]:
        """Half-precision copies of the rewritten model's linear weights, where autocast casts them
        each step and the rewrite is a patched twin (its modules are hal's to change, yours are not
        touched before hal's variant wins); None elsewhere."""
        if amp is None or rewrite.choice != "patch" or rewritten is model:
            return None
        copies = WeightCopies(rewritten, amp)
        return copies if len(copies) else None

    def _forward_loss(self, model: nn.Module) -> Callable[..., torch.Tensor]:
        """The forward and the loss of ``model``, under autocast when ``amp`` is set."""
        def forward_loss(*args: Any, **kwargs: Any) -> torch.Tensor:
            with torch.autocast(self.device.type, dtype=self.amp or torch.float32, enabled=self.amp is not None):
                if self.loss_fn is None:
                    return _loss_of(model(*args, **kwargs))
                out = model(*args[: self.inputs], **kwargs)
                return _check_loss(self.loss_fn(out, *args[self.inputs:]))

        return forward_loss

    def _make(self, name: str) -> Callable[..., torch.Tensor]:
        """The step callable of candidate ``name`` (built once)."""
        if name in self._runs:
            return self._runs[name]
        which, mode = name.split(" ", 1)
        variant = self._variants[which]
        if "compile" in mode:
            if which not in self._compiled:
                self._compiled[which] = torch.compile(self._forward_loss(variant.model), mode=self.compile_mode)
            forward = self._compiled[which]
        else:
            forward = self._forward_loss(variant.model)
        opt, scaler, copies = variant.optimizer, self.scaler, variant.copies

        def step(*args: Any, **kwargs: Any) -> torch.Tensor:
            with copies.active() if copies is not None else contextlib.nullcontext():
                loss = forward(*args, **kwargs)
                if scaler is not None:
                    scaler.scale(loss).backward()
                    scaler.step(opt)
                    scaler.update()
                else:
                    loss.backward()
                    opt.step()
                if copies is not None:
                    copies.write()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        step.__qualname__ = f"hal.optimize step ({name})"
        run: Callable[..., torch.Tensor] = step
        if "graph" in mode:
            import hal.graphs

            made = _make_capturable(opt)
            if made:
                self._made_capturable += made
                self.report.notes.append(f"{type(opt).__name__}'s param groups set to capturable=True for the '{name}' "
                                         "candidate (torch's optimizers refuse a CUDA graph capture otherwise; same update)")
            run = hal.graphs.graphed(step)
        self._runs[name] = run
        return run

    # --- the call ------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """One training step on this batch; returns the loss (detached, not read to the host)."""
        if self.loss_fn is not None and len(args) < self.inputs:
            raise InvalidArgumentError("hal.optimize", "inputs", f"at most the number of positional arguments the step is called "
                                       f"with ({len(args)}): the model takes the first `inputs`, loss_fn the rest",
                                       f"inputs={self.inputs}")
        if self._run is None:
            hal_variant = self._variants.get("hal")
            if self._user_optimizer is not None and hal_variant is not None and hal_variant.optimizer is not self._user_optimizer:
                plan.sync_optimizer(self._user_optimizer, hal_variant.optimizer)  # a schedule set before the first step
            self._choose(args, kwargs)
        elif self._copy_hyper or self._graph is not None:
            self._watch_optimizer()
        assert self._run is not None
        if self._graph is not None and self._chosen_copies is not None:
            self._chosen_copies.refresh()  # a replay runs none of the step's Python: weights changed since are copied here
        loss = self._run(*args, **kwargs)
        if self._copy_hyper:
            # your optimizer no longer steps: tell a learning-rate scheduler on it that a step was
            # taken (torch's LRScheduler reads this flag to warn about scheduler.step() before optimizer.step())
            self._user_optimizer._opt_called = True  # type: ignore[union-attr]
        return loss

    def _watch_optimizer(self) -> None:
        """Follow changes of your optimizer: learning rates (a scheduler's) and param groups added
        since are copied into hal's optimizer where it replaced yours; a CUDA graph is left when
        either changes (a graph replays the values and parameters it captured)."""
        source = self._user_optimizer if self._copy_hyper else self.optimizer
        assert source is not None
        now = plan.hyperparameters(source)
        if now == self._hyper:
            return
        groups_changed = [n for n, *_ in now] != [n for n, *_ in self._hyper]
        self._hyper = now
        if self._copy_hyper:
            for what in plan.sync_optimizer(source, self.optimizer):
                self.report.notes.append(f"{what} added to your optimizer after hal.optimize: added to hal.optim.AdamW, trained from then on")
        if self._graph is not None and self.report.chosen is not None:
            without = self.report.chosen.replace("compile+graph", "compile").replace("graph", "eager")
            what = "param groups" if groups_changed else "hyperparameters (a learning-rate schedule?)"
            note = (f"the optimizer's {what} changed after the graph was chosen: a CUDA graph replays the values and parameters "
                    f"it captured, so the step runs as '{without}' from now on")
            log.warning("hal.optimize: %s", note)
            self.report.notes.append(note)
            self.report.graph = Decision("no", note)
            self.report.chosen, self._graph = without, None
            self._run = self._make(without)

    def _choose(self, args: tuple, kwargs: dict) -> None:
        """Measure the candidates on this batch (state restored after each), keep the fastest."""
        names, r = self._names, self.report
        skipped = [Trial(n, skipped=why) for n, why in self._skipped.items()]
        if len(names) == 1:
            r.trials = skipped
            self._settle(names[0], "the only candidate left by the options: nothing measured")
            return
        from hal.dispatch.measure import LOG

        first_log, started = len(LOG), time.perf_counter()
        modules = _unique([v.model for v in self._variants.values()] + ([self.loss_fn] if isinstance(self.loss_fn, nn.Module) else []))
        snap = Snapshot(modules, _unique([v.optimizer for v in self._variants.values()]), [self.scaler] if self.scaler is not None else [])
        trials = self._trials(names, args, kwargs, snap)
        hal_trials = [t for t in trials if t.name.startswith("hal ")]
        copies = self._variants["hal"].copies if "hal" in self._variants else None
        if copies is not None and hal_trials and all(t.median_ms is None for t in hal_trials):
            # the weight copies are the newest part of hal's variant: where every hal candidate failed
            # with them, hal's variant is measured again without them before torch's can win by default
            failed = hal_trials[0].error or "failed"
            self._drop_weight_copies(f"every 'hal' candidate failed with them ({failed})")
            again = self._trials([t.name for t in hal_trials], args, kwargs, snap)
            trials = [t for t in trials if not t.name.startswith("hal ")] + again
        r.trials = sorted(trials + skipped, key=lambda t: CANDIDATES.index(t.name))
        r.measuring_s = time.perf_counter() - started
        r.kernel_measurements = len(LOG) - first_log
        r.snapshot = f"{snap.nbytes / 2**20:.1f} MiB in {'device' if snap.where == 'device' else 'host'} memory"
        ok = [t for t in r.trials if t.median_ms is not None]
        if not ok:
            _raise_for(trials)
        for t in trials:
            t.exception = None  # its traceback holds the failed step's tensors
        best = min(ok, key=lambda t: t.median_ms)
        chosen = next(t for t in ok if t.median_ms <= best.median_ms / (1.0 - self.margin))
        others = ", ".join(f"{t.name} {t.median_ms:.2f}" for t in ok if t is not best)
        if chosen is best:
            why = f"fastest measured: {best.median_ms:.2f} ms/step" + (f" (against {others} ms)" if others else "")
        else:
            why = (f"{best.name} measured {best.median_ms:.2f} ms/step, within {self.margin:.0%} of {chosen.name}'s "
                   f"{chosen.median_ms:.2f}: not worth it (the simpler candidate is kept)")
        self._settle(chosen.name, why)

    def _trials(self, names: list[str], args: tuple, kwargs: dict, snap: Snapshot) -> list[Trial]:
        """Each candidate of ``names`` measured in turn, the state put back after each."""
        trials = []
        for name in names:
            trials.append(self._trial(name, args, kwargs))
            run = self._runs.get(name)
            if hasattr(run, "reset"):
                run.reset()  # its graph holds the measured steps' memory; the real steps capture afresh
            snap.restore()
        return trials

    def _drop_weight_copies(self, why: str) -> None:
        """hal's variant without weight copies from now on (its linears are nn.Linear again)."""
        variant = self._variants["hal"]
        assert variant.copies is not None
        variant.copies.detach(variant.model)
        variant.copies = None
        self._runs = {n: run for n, run in self._runs.items() if not n.startswith("hal ")}
        self._compiled.pop("hal", None)
        self.report.weights = f"as they are: {why}; measured again without copies"
        log.warning("hal.optimize: weight copies dropped: %s", why)

    def _trial(self, name: str, args: tuple, kwargs: dict) -> Trial:
        """Run candidate ``name``: its warm-up calls (compilation; a graph's eager calls and capture),
        then ``measure_steps`` timed steps. Any exception is the candidate's failure."""
        trial, sync, ran = Trial(name), _synchronizer(self.device), 0
        on_cuda = self.device.type == "cuda"
        if on_cuda:
            sync()
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
        try:
            run = self._make(name)
            warm = 1 + (getattr(run, "warmup", 0) if "graph" in name else 0)
            started = time.perf_counter()
            for _ in range(warm):
                ran += 1
                run(*args, **kwargs)
            sync()
            trial.warmup_s = time.perf_counter() - started
            if "graph" in name and not run.captured():
                trial.error = "not captured: " + run.explain().splitlines()[-1].strip()
                return trial
            for _ in range(self.measure_steps):
                t0 = time.perf_counter()
                ran += 1
                run(*args, **kwargs)
                sync()
                trial.times_ms.append((time.perf_counter() - t0) * 1e3)
            if on_cuda:
                trial.grew_gib = (torch.cuda.max_memory_allocated(self.device) - before) / 2**30
        except Exception as exc:  # noqa: BLE001 - a candidate that fails is reported and left out
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            trial.error = f"{type(exc).__name__}: {message}"[:300]
            trial.exception = exc
            log.info("hal.optimize: candidate %s failed: %s", name, trial.error)
        finally:
            self.report.extra_steps += ran
        return trial

    def _settle(self, name: str, why: str) -> None:
        r = self.report
        r.chosen, r.why = name, why
        if "graph" not in name:
            for group in self._made_capturable:  # as you made it: eager steps keep their step counts on the host
                group["capturable"] = False
            r.notes = [n for n in r.notes if "capturable=True" not in n]
        which = name.split(" ", 1)[0]
        variant = self._variants[which]
        if which == "hal" and variant.model is not self._user_model and r.rewrite.choice != "fuse" \
                and (r.rewrite.choice == "patch" or r.recompute.choice != "none" or r.fp8.choice != "none"):
            import hal.nn

            # measured on a twin sharing your parameters; the step runs on your model, patched in
            # place as hal.nn.patch does (a compiled step compiles again, for your model's modules)
            if r.rewrite.choice == "patch":
                hal.nn.patch(self._user_model)
            if r.fp8.choice != "none":
                import hal.fp8

                hal.fp8.convert(self._user_model, self._fp8, within="auto")
            if r.recompute.choice != "none":
                from hal.nn.recompute import recompute

                recompute(self._user_model, r.recompute.choice)
            if variant.copies is not None:
                variant.copies.attach(self._user_model)
            variant.model = self._user_model
            self._runs = {n: run for n, run in self._runs.items() if not n.startswith("hal ")}
            self._compiled.pop("hal", None)
        self.model, self.optimizer = variant.model, variant.optimizer
        self._chosen_copies = variant.copies
        self._copy_hyper = self._user_optimizer is not None and self.optimizer is not self._user_optimizer
        self._hyper = plan.hyperparameters(self._user_optimizer if self._copy_hyper else self.optimizer)  # type: ignore[arg-type]
        self._run = self._make(name)
        self._graph = self._run if "graph" in name else None
        measured = {t.name: t for t in r.trials if t.skipped is None}
        if r.compile.choice == "measure":
            r.compile = Decision("yes" if "compile" in name else "no", _versus(name, "compile", measured, why))
        if r.graph.choice == "measure":
            r.graph = Decision("yes" if "graph" in name else "no", _versus(name, "graph", measured, why))
        if "compile" in name and name not in measured:
            r.notes.append("torch.compile compiles on the first call (seconds to minutes; recompiles on new input shapes)")

    # --- introspection -------------------------------------------------------------------------

    def explain(self) -> str:
        """What the step does and why: the two variants (yours untouched; hal's rewrite and
        optimizer), precision, compile, graph, every candidate with its measured times (or why it
        failed or was skipped), the one chosen and why, and what measuring cost."""
        r = self.report
        lines = [f"hal.optimize: training step of {r.model} on {r.device}",
                 f"  torch      {r.untouched}",
                 f"  model      {r.rewrite.choice}: {r.rewrite.reason} ({r.rewrite.seconds:.2f} s)",
                 f"  optimizer  {r.optimizer.choice}: {r.optimizer.reason}",
                 f"  precision  {r.precision}",
                 f"  weights    {r.weights}",
                 f"  fp8        {r.fp8.choice}: {r.fp8.reason}",
                 f"  recompute  {r.recompute.choice}: {r.recompute.reason}",
                 f"  compile    {r.compile.choice}: {r.compile.reason}",
                 f"  graph      {r.graph.choice}: {r.graph.reason}"]
        if r.chosen is None:
            lines.append(f"  step       not chosen yet: candidates {', '.join(self._names)} are measured on the first call")
        else:
            lines.append(f"  step       {r.chosen}: {r.why}")
        if any(t.skipped is None for t in r.trials):
            lines.append(f"  measured on the first batch, {self.measure_steps} timed step(s) each after its warm-up:")
        lines += [f"    {t}" for t in r.trials]
        if any(t.skipped is None for t in r.trials):
            lines.append(f"  measuring cost {r.measuring_s:.2f} s and {r.extra_steps} step(s), all undone (snapshot {r.snapshot}); "
                         f"hal measured {r.kernel_measurements} kernel choice(s) meanwhile (HAL_TUNE)")
        lines += [f"  note       {n}" for n in r.notes]
        if self._graph is not None and hasattr(self._graph, "explain"):
            lines += ["  " + line for line in self._graph.explain().splitlines()]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<hal.OptimizedStep {self.report.model} step={self.report.chosen or 'not chosen yet'}>"

    def train(self, mode: bool = True) -> "OptimizedStep":
        """Set the training mode of the model passed in and of every variant's model (a fused
        model's new modules are not children of yours: ``your_model.eval()`` alone does not reach
        them)."""
        self._user_model.train(mode)
        for variant in self._variants.values():
            variant.model.train(mode)
        return self

    def eval(self) -> "OptimizedStep":
        return self.train(False)


def _versus(name: str, feature: str, measured: dict[str, Trial], why: str) -> str:
    """Why ``feature`` (compile or graph) is used or not, by the measured times."""
    if not measured:
        return why
    if feature in name:
        return f"chosen, {why}"
    tried = [t for t in measured.values() if feature in t.name]
    if not tried:
        return why
    if all(t.error for t in tried):
        return "every candidate with it failed: " + "; ".join(f"{t.name}: {t.error}" for t in tried)
    return f"not chosen, {why}"


def _written_when(copies: WeightCopies) -> str:
    """When the weight copies are written, for the report: by the optimizer's update kernel
    (hal.optim.AdamW), after each optimizer step, or some each way."""
    by_optimizer = copies.by_optimizer
    if by_optimizer == len(copies):
        return "written by the optimizer's update kernel as it steps the weights (hal.optim.AdamW.write_copies)"
    if by_optimizer:
        return (f"{by_optimizer} written by the optimizer's update kernel as it steps their weights (hal.optim.AdamW.write_copies) "
                "and the others after each optimizer step")
    return "written after each optimizer step"


def _unique(items: list[Any]) -> list[Any]:
    """``items`` without repeats (by identity), in order."""
    return list({id(x): x for x in items}.values())


def _raise_for(trials: list[Trial]) -> None:
    """Every candidate failed: raise the exception of your own model and optimizer (the untouched
    candidates run nothing of hal's, so that is your code's error, as a plain loop would raise it),
    else a RuntimeError listing each candidate's failure."""
    summary = "\n  ".join(map(str, trials))
    yours = next((t.exception for t in trials if t.name.startswith("torch ") and t.exception is not None), None)
    if yours is not None:
        yours.add_note(f"hal.optimize: your model and optimizer, run as given, raised this on the first batch; every candidate failed:\n  {summary}")
        raise yours
    raise RuntimeError("hal.optimize: no way to run the step worked on the first batch:\n  " + summary
                       + "\nfix the first error above (the 'torch eager' step is your own forward, loss and backward)")


def _check_int(name: str, value: Any, what: str) -> None:
    """Refuse a non-integer count up front (it would fail, or be compared, deep inside the first step)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError("hal.optimize", name, f"an int ({what})", repr(value))


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _check_loss(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        got = f"a tensor of shape {tuple(loss.shape)} and dtype {loss.dtype}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"hal.optimize: the loss must be a 0-d floating-point tensor, got {got}; reduce it (mean or sum) in loss_fn")
    return loss


def _loss_of(out: Any) -> torch.Tensor:
    """The loss in what a model returned when no ``loss_fn`` is given: the output itself, its
    ``.loss`` (Hugging Face outputs) or its ``["loss"]``."""
    if isinstance(out, torch.Tensor):
        if out.dim() != 0:
            raise ValueError(f"hal.optimize: without loss_fn the model must return the loss, but it returned a tensor of shape "
                             f"{tuple(out.shape)} (the logits?); pass loss_fn=lambda output, target: ... (for example "
                             "torch.nn.functional.cross_entropy), called as step(input, target)")
        return _check_loss(out)
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if loss is None:
        raise ValueError(f"hal.optimize: without loss_fn the model must return the loss (a tensor, an output with .loss, "
                         f"or a dict with 'loss'), but it returned {type(out).__name__}; pass loss_fn=lambda output, target: ... "
                         "(and labels to a Hugging Face model)")
    return _check_loss(loss)


def optimize(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
             loss_fn: Optional[Callable[..., torch.Tensor]] = None, inputs: int = 1,
             amp: Optional[torch.dtype] = None, scaler: Any = None, rewrite: str = "auto",
             replace_optimizer: bool = True, compile: Optional[bool] = None, compile_mode: Optional[str] = None,
             graph: Optional[bool] = None, measure_steps: int = 5, margin: float = 0.03,
             candidates: Optional[Sequence[str]] = None, recompute: Optional[str] = None, fp8: Any = None) -> OptimizedStep:
    """The fastest training step hal can build for ``model`` and ``optimizer``, never slower (as
    measured on the first batch) than the model and optimizer as given; see ``docs/api.md`` ("A fast
    step in one call") and :class:`OptimizedStep`.

    ``loss = step(*batch, **kwargs)``: without ``loss_fn`` the model is called on every argument
    and must return the loss (or an output with ``.loss``); with it, the model is called on the
    first ``inputs`` arguments (and the keyword arguments) and the loss is ``loss_fn(output,
    *rest)``. ``amp``: autocast dtype (bfloat16; float16 adds a ``hal.amp.DynamicLossScaler``
    unless ``scaler`` is given). ``rewrite``: how the ``hal`` variant rewrites the model: "auto"
    (fuse, else patch), "fuse", "patch", "none". ``replace_optimizer``: allow hal's AdamW in place of
    an equivalent torch AdamW/Adam in the ``hal`` variant. ``compile`` / ``graph``: True or False to
    decide, None (default) to measure on the first call; ``compile_mode`` is passed to
    ``torch.compile``. ``measure_steps``: timed steps per candidate; ``margin``: how much faster than
    a simpler candidate another must be to be chosen. ``candidates``: names from ``CANDIDATES``
    ("torch eager" ... "hal compile+graph") to restrict the measurement to (None: all).
    ``recompute``: "selective" or "full" to make the ``hal`` variant's repeated blocks recompute
    their activations in the backward (``hal.nn.recompute``: less memory for some arithmetic; your
    model untouched, as ever, until that variant wins); None (default) holds them. ``explain()``
    shows how far device memory grew in each candidate's step. ``fp8``: a ``hal.fp8`` recipe
    (``hal.fp8.CurrentScaling()``, ``DelayedScaling()``, ``RowwiseScaling()``, ...) to run the ``hal``
    variant's linear layers inside repeated blocks (a transformer's layers) in FP8
    (``hal.fp8.convert(..., within="auto")``; embeddings and the LM head stay in the autocast
    dtype): other numbers than bf16's, so only where you ask; the measurement still decides
    against your untouched model. A device without FP8 keeps the autocast dtype (``explain()`` says why).

    Dropout and other random ops: the eager candidates draw what a plain loop draws; compiled ones
    draw other numbers of the same distribution (Inductor's generator), so their run is not the
    plain loop's draw for draw. A ValueError (or any exception) raised by your own model or loss on
    the first batch is raised as it is, with a note listing every candidate's failure."""
    return OptimizedStep(model, optimizer, loss_fn=loss_fn, inputs=inputs, amp=amp, scaler=scaler, rewrite=rewrite,
                         replace_optimizer=replace_optimizer, compile=compile, compile_mode=compile_mode, graph=graph,
                         measure_steps=measure_steps, margin=margin, candidates=candidates, recompute=recompute, fp8=fp8)


__all__ = ["optimize", "OptimizedStep", "OptimizeReport", "Trial", "Variant", "CANDIDATES"]
