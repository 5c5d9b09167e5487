"""``hal.optimize(model, optimizer)``: the fastest training step hal can build, chosen by measurement.

The step (:class:`OptimizedStep`) runs forward, loss, backward, optimizer step and ``zero_grad``
in one call. Before the first call, the model is rewritten (``hal.nn.fuse``, else ``hal.nn.patch``)
and the optimizer replaced by ``hal.optim.AdamW`` where that is the same update (:mod:`.plan`). On
the first call, the candidate ways to run the step (eager; ``torch.compile`` of forward and loss;
on CUDA the whole step as a CUDA graph, eager or compiled) each run a few steps on that batch and
the fastest is kept. Measuring must not train: the parameters, buffers, gradients, optimizer and
scaler state and random generators are saved before and written back after (:mod:`.state`), so that
after N calls the model is what N steps of a plain loop make of it (to float rounding; the compiled
and captured steps round differently from eager).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from typing import Any, Callable, Optional

import torch
from torch import nn

from hal.fast import plan
from hal.fast.plan import Decision
from hal.fast.state import Snapshot

log = logging.getLogger("hal")

#: the ways a step can run, simplest first (a tie goes to the simpler one)
CANDIDATES = ("eager", "compile", "graph", "compile+graph")
#: torch.compile modes that capture CUDA graphs of their own (hal's whole-step graph is then left out)
_CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


@dataclasses.dataclass
class Trial:
    """One candidate measured on the first batch: per-step wall times (ms, after its warm-up calls),
    what the warm-up cost (compilation, capture), or why it could not run."""

    name: str
    times_ms: list[float] = dataclasses.field(default_factory=list)
    warmup_s: float = 0.0
    error: Optional[str] = None

    @property
    def median_ms(self) -> Optional[float]:
        return statistics.median(self.times_ms) if self.times_ms and self.error is None else None

    def __str__(self) -> str:
        if self.error is not None:
            return f"{self.name}: failed ({self.error})"
        times = ", ".join(f"{t:.2f}" for t in self.times_ms)
        return f"{self.name}: {self.median_ms:.2f} ms/step (median of [{times}]; warm-up {self.warmup_s:.2f} s)"


@dataclasses.dataclass
class OptimizeReport:
    """What :func:`optimize` did and why, as data (``explain()`` prints it)."""

    model: str
    device: str
    rewrite: Decision
    optimizer: Decision
    precision: str
    compile: Decision
    graph: Decision
    chosen: Optional[str] = None  # None until the first call
    trials: list[Trial] = dataclasses.field(default_factory=list)
    measuring_s: float = 0.0
    extra_steps: int = 0  # steps run while measuring (undone)
    snapshot: str = ""
    kernel_measurements: int = 0  # hal's own measured kernel choices made meanwhile (HAL_TUNE)
    notes: list[str] = dataclasses.field(default_factory=list)


class OptimizedStep:
    """A training step: ``loss = step(*batch)`` runs forward, loss, backward, optimizer step and
    ``optimizer.zero_grad(set_to_none=True)``, and returns the loss (detached). Build it with
    :func:`hal.optimize`; ``explain()`` says what it does and why.

    ``model``: the model it runs (the fused GraphModule or the patched model; its parameters are
    the ones passed in). ``optimizer``: the optimizer it steps (hal's AdamW where it replaced yours:
    checkpoint this one). ``scaler``: the loss scaler (float16) or None. ``report``: the decisions
    as data. ``train()`` / ``eval()`` set the mode of both the model passed in and ``model``."""

    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
                 loss_fn: Optional[Callable[..., torch.Tensor]] = None, inputs: int = 1,
                 amp: Optional[torch.dtype] = None, scaler: Any = None, rewrite: str = "auto",
                 replace_optimizer: bool = True, compile: Optional[bool] = None, compile_mode: Optional[str] = None,
                 graph: Optional[bool] = None, measure_steps: int = 5, margin: float = 0.03) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"hal.optimize: model must be a torch.nn.Module, not {type(model).__name__}")
        if amp not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"hal.optimize: amp must be None, torch.bfloat16 or torch.float16 (the autocast dtype), not {amp!r}")
        if inputs < 0:
            raise ValueError(f"hal.optimize: inputs (how many leading arguments the model takes) must be >= 0, not {inputs}")
        if measure_steps < 1:
            raise ValueError(f"hal.optimize: measure_steps must be at least 1, not {measure_steps}; pass compile= and graph= to skip measuring")
        param = next(iter(model.parameters()), None)
        self.device = param.device if param is not None else torch.device("cpu")
        self._user_model, self._user_optimizer = model, optimizer
        self.loss_fn, self.inputs, self.amp = loss_fn, inputs, amp
        self.measure_steps, self.margin, self.compile_mode = measure_steps, margin, compile_mode
        self.model, rewrite_decision = plan.rewrite(model, rewrite)
        self.optimizer, opt_decision = plan.choose_optimizer(model, optimizer, replace_optimizer)
        self._copy_hyper = optimizer is not None and self.optimizer is not optimizer
        self._hyper = plan.hyperparameters(optimizer if self._copy_hyper else self.optimizer)
        precision = "float32 (no autocast)" if amp is None else f"torch.autocast({self.device.type}, {str(amp).removeprefix('torch.')})"
        if amp is torch.float16 and scaler is None:
            import hal.amp

            scaler = hal.amp.DynamicLossScaler()
            precision += " with hal.amp.DynamicLossScaler (float16 needs loss scaling)"
        elif scaler is not None:
            precision += f" with {type(scaler).__name__}"
        self.scaler = scaler
        self._names, compile_d, graph_d = self._candidates(compile, graph)
        self.report = OptimizeReport(type(model).__name__, str(self.device), rewrite_decision, opt_decision, precision, compile_d, graph_d)
        self._compiled: Optional[Callable[..., torch.Tensor]] = None
        self._runs: dict[str, Callable[..., torch.Tensor]] = {}
        self._run: Optional[Callable[..., torch.Tensor]] = None
        self._graph: Any = None  # the GraphedStep in use, if any

    # --- the candidates ------------------------------------------------------------------------

    def _candidates(self, compile: Optional[bool], graph: Optional[bool]) -> tuple[list[str], Decision, Decision]:
        """The candidate names, and the compile and graph decisions as far as they are known now."""
        compiles = [False, True] if compile is None else [bool(compile)]
        compile_d = Decision("measure" if compile is None else ("yes" if compile else "no"),
                             "to be measured on the first call" if compile is None else f"compile={compile}")
        cuda_reason = None if self.device.type == "cuda" and torch.cuda.is_available() else f"the model is on {self.device}, not a CUDA device"
        if graph is False:
            graphs, graph_d = [False], Decision("no", "graph=False")
        elif cuda_reason is not None:
            graphs, graph_d = [False], Decision("no", cuda_reason)
            if graph:
                log.warning("hal.optimize: graph=True ignored: %s", cuda_reason)
        else:
            graphs = [False, True] if graph is None else [True]
            graph_d = Decision("measure" if graph is None else "yes", "to be measured on the first call" if graph is None else "graph=True")
        names = []
        for g in graphs:
            for c in compiles:
                if g and c and self.compile_mode in _CUDAGRAPH_MODES:
                    continue  # torch.compile captures its own graphs in these modes
                names.append({(False, False): "eager", (True, False): "compile", (False, True): "graph", (True, True): "compile+graph"}[(c, g)])
        if not names:  # compile=True, graph=True with a cudagraph compile mode
            names = ["compile"]
        return sorted(names, key=CANDIDATES.index), compile_d, graph_d

    def _forward_loss(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The model's forward and the loss, under autocast when ``amp`` is set."""
        with torch.autocast(self.device.type, dtype=self.amp or torch.float32, enabled=self.amp is not None):
            if self.loss_fn is None:
                return _loss_of(self.model(*args, **kwargs))
            out = self.model(*args[: self.inputs], **kwargs)
            return _check_loss(self.loss_fn(out, *args[self.inputs:]))

    def _make(self, name: str) -> Callable[..., torch.Tensor]:
        """The step callable of candidate ``name`` (built once)."""
        if name in self._runs:
            return self._runs[name]
        if "compile" in name:
            if self._compiled is None:
                self._compiled = torch.compile(self._forward_loss, mode=self.compile_mode)
            forward = self._compiled
        else:
            forward = self._forward_loss
        opt, scaler = self.optimizer, self.scaler

        def step(*args: Any, **kwargs: Any) -> torch.Tensor:
            loss = forward(*args, **kwargs)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        step.__qualname__ = f"hal.optimize step ({name})"
        run: Callable[..., torch.Tensor] = step
        if "graph" in name:
            import hal.graphs

            run = hal.graphs.graphed(step)
        self._runs[name] = run
        return run

    # --- the call ------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """One training step on this batch; returns the loss (detached, not read to the host)."""
        if self._copy_hyper or self._graph is not None:
            self._watch_hyperparameters()
        if self._run is None:
            self._choose(args, kwargs)
        loss = self._run(*args, **kwargs)
        if self._copy_hyper:
            # your optimizer no longer steps: tell a learning-rate scheduler on it that a step was
            # taken (torch's LRScheduler reads this flag to warn about scheduler.step() before optimizer.step())
            self._user_optimizer._opt_called = True  # type: ignore[union-attr]
        return loss

    def _watch_hyperparameters(self) -> None:
        """Copy learning rates (a scheduler's) from your optimizer into hal's; leave the CUDA graph
        when they change (a graph replays the values it captured)."""
        source = self._user_optimizer if self._copy_hyper else self.optimizer
        now = plan.hyperparameters(source)
        if now == self._hyper:
            return
        self._hyper = now
        if self._copy_hyper:
            plan.copy_hyperparameters(source, self.optimizer)
        if self._graph is not None and self.report.chosen is not None:
            without = "compile" if "compile" in self.report.chosen else "eager"
            note = (f"the optimizer's hyperparameters changed after the graph was chosen (a learning-rate schedule?): a CUDA "
                    f"graph replays the values it captured, so the step runs as '{without}' from now on")
            log.warning("hal.optimize: %s", note)
            self.report.notes.append(note)
            self.report.graph = Decision("no", note)
            self.report.chosen, self._graph = without, None
            self._run = self._make(without)

    def _choose(self, args: tuple, kwargs: dict) -> None:
        """Measure the candidates on this batch (state restored after each), keep the fastest."""
        names = self._names
        if len(names) == 1:
            self._settle(names[0], "the only candidate left by the options: nothing measured")
            return
        from hal.dispatch.measure import LOG

        first_log, started = len(LOG), time.perf_counter()
        modules = [self.model] + ([self.loss_fn] if isinstance(self.loss_fn, nn.Module) else [])
        snap = Snapshot(modules, self.optimizer, [self.scaler] if self.scaler is not None else [])
        trials = []
        for name in names:
            trials.append(self._trial(name, args, kwargs))
            run = self._runs.get(name)
            if hasattr(run, "reset"):
                run.reset()  # its graph holds the measured steps' memory; the real steps capture afresh
            snap.restore()
        r = self.report
        r.trials, r.measuring_s = trials, time.perf_counter() - started
        r.kernel_measurements = len(LOG) - first_log
        r.snapshot = f"{snap.nbytes / 2**20:.1f} MiB in {'device' if snap.where == 'device' else 'host'} memory"
        ok = [t for t in trials if t.median_ms is not None]
        if not ok:
            raise RuntimeError("hal.optimize: no way to run the step worked on the first batch:\n  "
                               + "\n  ".join(map(str, trials)) + "\nfix the first error above (the eager step is your own forward, loss and backward)")
        best = min(ok, key=lambda t: t.median_ms)
        simplest = ok[0]
        if best is not simplest and best.median_ms > simplest.median_ms * (1.0 - self.margin):
            why = (f"{best.name} measured {best.median_ms:.2f} ms/step, within {self.margin:.0%} of {simplest.name}'s "
                   f"{simplest.median_ms:.2f}: not worth it")
            best = simplest
        else:
            others = ", ".join(f"{t.name} {t.median_ms:.2f}" for t in ok if t is not best)
            why = f"fastest measured: {best.median_ms:.2f} ms/step" + (f" (against {others} ms)" if others else "")
        self._settle(best.name, why)

    def _trial(self, name: str, args: tuple, kwargs: dict) -> Trial:
        """Run candidate ``name``: its warm-up calls (compilation; a graph's eager calls and capture),
        then ``measure_steps`` timed steps. Any exception is the candidate's failure."""
        trial, sync, ran = Trial(name), _synchronizer(self.device), 0
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
        except Exception as exc:  # noqa: BLE001 - a candidate that fails is reported and left out
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            trial.error = f"{type(exc).__name__}: {message}"[:300]
            log.info("hal.optimize: candidate %s failed: %s", name, trial.error)
        finally:
            self.report.extra_steps += ran
        return trial

    def _settle(self, name: str, why: str) -> None:
        r = self.report
        r.chosen = name
        self._run = self._make(name)
        self._graph = self._run if "graph" in name else None
        measured = {t.name: t for t in r.trials}
        if r.compile.choice == "measure":
            r.compile = Decision("yes" if "compile" in name else "no", _versus(name, "compile", measured, why))
        if r.graph.choice == "measure":
            r.graph = Decision("yes" if "graph" in name else "no", _versus(name, "graph", measured, why))
        if "compile" in name and "compile" not in measured:
            r.notes.append("torch.compile compiles on the first call (seconds to minutes; recompiles on new input shapes)")

    # --- introspection -------------------------------------------------------------------------

    def explain(self) -> str:
        """What the step does and why: rewrite, optimizer, precision, compile, graph, the measured
        candidates with their times, and what measuring cost."""
        r = self.report
        lines = [f"hal.optimize: training step of {r.model} on {r.device}",
                 f"  model      {r.rewrite.choice}: {r.rewrite.reason} ({r.rewrite.seconds:.2f} s)",
                 f"  optimizer  {r.optimizer.choice}: {r.optimizer.reason}",
                 f"  precision  {r.precision}",
                 f"  compile    {r.compile.choice}: {r.compile.reason}",
                 f"  graph      {r.graph.choice}: {r.graph.reason}"]
        if r.chosen is None:
            lines.append(f"  step       not chosen yet: candidates {', '.join(self._names)} are measured on the first call")
        else:
            lines.append(f"  step       {r.chosen}")
        if r.trials:
            lines.append(f"  measured on the first batch, {self.measure_steps} timed step(s) each after its warm-up:")
            lines += [f"    {t}" for t in r.trials]
            lines.append(f"  measuring cost {r.measuring_s:.2f} s and {r.extra_steps} step(s), all undone (snapshot {r.snapshot}); "
                         f"hal measured {r.kernel_measurements} kernel choice(s) meanwhile (HAL_TUNE)")
        lines += [f"  note       {n}" for n in r.notes]
        if self._graph is not None and hasattr(self._graph, "explain"):
            lines += ["  " + line for line in self._graph.explain().splitlines()]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<hal.OptimizedStep {self.report.model} step={self.report.chosen or 'not chosen yet'}>"

    def train(self, mode: bool = True) -> "OptimizedStep":
        """Set the training mode of the model passed in and of :attr:`model` (a fused model's new
        modules are not children of yours: ``your_model.eval()`` alone does not reach them)."""
        self._user_model.train(mode)
        self.model.train(mode)
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
             graph: Optional[bool] = None, measure_steps: int = 5, margin: float = 0.03) -> OptimizedStep:
    """The fastest training step hal can build for ``model`` and ``optimizer``; see ``docs/api.md``
    ("A fast step in one call") and :class:`OptimizedStep`.

    ``loss = step(*batch, **kwargs)``: without ``loss_fn`` the model is called on every argument
    and must return the loss (or an output with ``.loss``); with it, the model is called on the
    first ``inputs`` arguments (and the keyword arguments) and the loss is ``loss_fn(output,
    *rest)``. ``amp``: autocast dtype (bfloat16; float16 adds a ``hal.amp.DynamicLossScaler``
    unless ``scaler`` is given). ``rewrite``: "auto" (fuse, else patch), "fuse", "patch", "none".
    ``replace_optimizer``: allow hal's AdamW in place of an equivalent torch AdamW/Adam.
    ``compile`` / ``graph``: True or False to decide, None (default) to measure on the first call;
    ``compile_mode`` is passed to ``torch.compile``. ``measure_steps``: timed steps per candidate;
    ``margin``: how much faster than the simplest candidate another must be to be chosen."""
    return OptimizedStep(model, optimizer, loss_fn=loss_fn, inputs=inputs, amp=amp, scaler=scaler, rewrite=rewrite,
                         replace_optimizer=replace_optimizer, compile=compile, compile_mode=compile_mode, graph=graph,
                         measure_steps=measure_steps, margin=margin)


__all__ = ["optimize", "OptimizedStep", "OptimizeReport", "Trial", "CANDIDATES"]
