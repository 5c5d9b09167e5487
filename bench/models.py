"""Whole-model benchmarks (``hal bench --models``): one training or inference step of a real model,
timed for eager PyTorch, torch.compile, hal, hal under torch.compile, the whole-step CUDA-graph
variants of each (``+graph``, on a GPU) and other peers (Liger-Kernel), in one run on one device
(the columns: :mod:`hal_bench.workload`).

A model is a :class:`Workload`: it builds, from a seed, the model, its data and its optimizer for
one *implementation* (``torch``, ``hal``, ``liger``, or a workload's own peer) and returns the step as
a closure; the harness applies torch.compile through the workload (the model is compiled, the
optimizer and the loss scaling stay eager) and measures every variant the same way:

- **step time**: the median over batches of back-to-back steps timed with CUDA events (the host clock
  on the CPU), after the 20 steps of the loss trajectory, which absorb compilation and autotuning;
- **throughput**: the workload's items (images, tokens) per step over the step time;
- **model TFLOP/s and MFU** (the rows that count their flops, :mod:`hal_bench.flops`): the training
  flops of a step over the step time, and that as a fraction of the device's peak (its datasheet's
  dense bfloat16 figure, or ``--peak-tflops``);
- **peak memory**: ``torch.cuda.max_memory_allocated`` over the timed steps less what was allocated
  before the variant was built (the timer's L2-flush buffer): parameters, optimizer state and
  activations, everything of the variant alive during a step; for a CUDA-graph variant over the
  whole variant instead (its graph's memory is allocated during the capture, in the trajectory);
  None on the CPU, whose allocator keeps no statistics (the table says n/a);
- **host time per step**: the host clock from the call of the step to its return, started on an idle
  device (synchronised before, outside the clock) and synchronised after (outside the clock). A
  step that does not synchronise only queues work, so this is the CPU time spent issuing it. It is a
  true host time as long as the device keeps up with the host: when the device is slower (a
  device-bound step), the host may block on a full launch queue and the figure approaches the step
  time; ``host_bound`` says the host time is at least 90% of the step time;
- **syncs**: the host synchronisations of one step (``torch.cuda.set_sync_debug_mode("warn")``);
- **check**: training and forward + backward steps: the loss after 20 steps from the same seed and
  data (next to eager's); inference: the relative error ‖out − ref‖ / ‖ref‖ of the output against
  the eager model run in float32 on the same input;
- **best peer / best hal** (issue 28): per model, the fastest peer (every variant that is not one of
  hal's: eager, the torch.compile modes, the graphed peers, Liger-Kernel, a workload's own) and the
  fastest of hal, hal+compile, hal+graph and hal+compile+graph, their ratio (peer time / hal time)
  and the best hal step's peak memory over eager's (``row["best"]``);
- **side by side** (``row["paired"]``): the judged pairs, (compile, hal+compile) and (best peer, best
  hal), built again after the sweep and timed in alternating rounds (:mod:`hal_bench.models_paired`):
  the targets take these ratios, which the host's drift between variants does not bias;
- **largest batch** (``--max-batch``, the rows that can be rebuilt at another batch): for the variants
  named, the largest batch whose steps fit in device memory (:mod:`hal_bench.batch_search`).

Sizes come from a preset (:data:`hal_bench.workload.SIZES`): ``full`` (the issue's sizes, for a GPU), ``cpu`` (small
models that take milliseconds per step on a CPU) and ``tiny`` (the CI tests).
"""

from __future__ import annotations

import gc
import statistics
import time
import traceback
import warnings
from typing import Any, Callable, Optional, Sequence

import torch

from . import models_big, torchao_float8
from .batch_search import largest_batch
from .flops import mfu
from .flops import peak_tflops as peak_tflops_of
from .models_hf import HFLlamaTrain
from .models_llama import LlamaPrefill, LlamaTrain
from .models_moe import MoEForwardBackward
from .models_paired import ROUNDS, judged_pairs, time_side_by_side
from .models_resnet import ResNetInference, ResNetTrain
from .timing import Timer
from .workload import HAL_VARIANTS, TRAJECTORY_STEPS, NotApplicable, Step, Variant, Workload

#: the steps of each try of the largest-batch search (the first creates the optimizer's state)
MAX_BATCH_STEPS = 3
#: the batch the search stops at without running out of memory
MAX_BATCH_LIMIT = 1024

# --- measurement ---------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _error(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def host_time_us(step: Callable[[], Any], device: torch.device, reps: int = 7) -> Optional[float]:
    """Median host time of issuing one step on an idle device (module docstring); None on the CPU,
    where every op runs synchronously and the step time is all host time."""
    if device.type != "cuda":
        return None
    times = []
    for _ in range(reps):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        torch.cuda.synchronize(device)
        times.append((t1 - t0) * 1e6)
    return statistics.median(times)


def count_syncs(step: Callable[[], Any], device: torch.device) -> Optional[int]:
    """Host synchronisations during one step (CUDA's sync debug mode, warnings counted)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize(device)
    return sum("synchroniz" in str(w.message) for w in caught)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64."""
    a, b = out.detach().double(), ref.detach().double()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-300))


def measure_variant(workload: Workload, variant: Variant, device: torch.device, timer: Timer, seed: int,
                    reference: Optional[torch.Tensor], steps: int = TRAJECTORY_STEPS, peak: Optional[float] = None) -> dict[str, Any]:
    """One record: times in microseconds, peak memory in bytes, the check value after ``steps``; where
    the workload counts its flops, the model TFLOP/s achieved and, given the device's ``peak``
    TFLOP/s, the MFU."""
    rec: dict[str, Any] = {"variant": variant.name, "impl": variant.impl, "compile_mode": variant.compile_mode}
    if variant.fp8:
        rec["fp8"] = True
    if variant.compile_mode:
        torch._dynamo.reset()  # each compiled variant compiles afresh (no recompile limit across variants)
    _free(device)
    baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        step = build_step(workload, variant, device, seed)
    except NotApplicable as exc:
        rec["skipped"] = str(exc)
        return rec
    except Exception as exc:  # noqa: BLE001 - one variant failing is recorded, the run goes on
        traceback.print_exc()
        rec["error"] = f"build: {_error(exc)}"
        return rec
    try:
        t0 = time.perf_counter()
        first = step()
        _sync(device)
        rec["first_step_s"] = time.perf_counter() - t0
        outputs = [first.detach()] + [step().detach() for _ in range(steps - 1)]
        _sync(device)
        if workload.kind == "infer":
            rec["rel_err"] = relative_error(outputs[-1], reference) if reference is not None else None
        else:
            rec["loss_first"] = float(outputs[0])
            rec["loss"] = float(outputs[-1])
        del outputs, first
        if device.type == "cuda" and not variant.graph:
            # a graph's memory is taken during its capture (in the trajectory above) and stays the
            # graph's; its replays allocate nothing, so a graphed step's peak is the whole variant's
            torch.cuda.reset_peak_memory_stats(device)
        timing = timer(step, warmup=0)
        rec["step_us"] = timing["median_us"]
        rec["timed_steps"] = timing["reps"]
        # the CPU allocator keeps no statistics: None (n/a in the table)
        rec["peak_bytes"] = int(torch.cuda.max_memory_allocated(device)) - baseline if device.type == "cuda" else None
        rec["host_us"] = host_time_us(step, device)
        rec["syncs"] = count_syncs(step, device)
        rec["throughput"] = workload.items_per_step() / (rec["step_us"] * 1e-6)
        flops = workload.flops_per_step()
        if flops is not None:
            rec["tflops"] = flops.total / (rec["step_us"] * 1e-6) / 1e12
            rec["mfu"] = mfu(flops.total, rec["step_us"], peak) if peak else None
        if variant.graph:
            rec["graph"] = step.run.explain()
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        rec["error"] = _error(exc)
    del step
    if variant.compile_mode:
        torch._dynamo.reset()  # frees the compiled graphs
    _free(device)
    return rec


def build_step(workload: Workload, variant: Variant, device: torch.device, seed: int) -> Step:
    """The step of one variant as the table times it: captured whole for a +graph variant, its
    outputs copied under reduce-overhead (whose graphs overwrite them on the next replay)."""
    if variant.graph and device.type != "cuda":
        raise NotApplicable("CUDA graphs need a CUDA device")
    step = workload.make(variant.impl, variant.compile_mode, device, seed)
    return with_graphs(step) if variant.graph else copied_outputs(step) if variant.compile_mode == "reduce-overhead" else step


#: the peers of hal+graph and hal+compile+graph: every step captured as CUDA graphs too
GRAPHED_PEERS = ("eager+graph", "compile reduce-overhead", "compile+graph")
#: hal's graphed steps (``ratio_vs_graphed``: the fastest graphed peer's time / theirs)
GRAPHED_HAL = ("hal+graph", "hal+compile+graph")


def with_graphs(step: Step) -> Step:
    """The step captured as one CUDA graph and replayed (:mod:`hal.graphs`); its optimizer made
    capturable first (torch's optimizers refuse a capture otherwise; hal's AdamW always is)."""
    import hal.graphs

    if step.optimizer is not None:
        for group in step.optimizer.param_groups:
            group["capturable"] = True
    return Step(hal.graphs.graphed(step.run), step.model, step.optimizer)


def copied_outputs(step: Step) -> Step:
    """A torch.compile CUDA-graph step (reduce-overhead): each step marked as a new iteration of the
    cudagraph trees, its result copied (the next replay overwrites the graph's own output buffers,
    which the loss trajectory keeps), as :mod:`hal.graphs` copies its results by default."""
    run = step.run

    def step_copied() -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()
        return run().clone()

    return Step(step_copied, step.model, step.optimizer)


def add_ratios(row: dict[str, Any]) -> None:
    """Each variant's ``ratio``: its step time over hal's (above 1: hal is faster); hal+compile's
    also over compile's (``ratio_vs_compile``: compile time / hal+compile time); hal's graphed steps'
    over the fastest graphed peer's (``ratio_vs_graphed``); and the row's ``best`` (:func:`best_of`)."""
    by_name = {r["variant"]: r for r in row["variants"]}
    hal_us = by_name.get("hal", {}).get("step_us")
    for r in row["variants"]:
        if "step_us" in r and hal_us:
            r["ratio"] = r["step_us"] / hal_us
    hc, c = by_name.get("hal+compile", {}), by_name.get("compile", {})
    if hc.get("step_us") and c.get("step_us"):
        hc["ratio_vs_compile"] = c["step_us"] / hc["step_us"]
    graphed_peers = [by_name[n]["step_us"] for n in GRAPHED_PEERS if by_name.get(n, {}).get("step_us")]
    for name in GRAPHED_HAL:
        hg = by_name.get(name, {})
        if hg.get("step_us") and graphed_peers:
            hg["ratio_vs_graphed"] = min(graphed_peers) / hg["step_us"]
    row["best"] = best_of(row)


def is_peer(rec: dict[str, Any]) -> bool:
    """A peer's record: any variant that is not a hal step (hal's own recipes, such as the decoder's
    ``hal bf16 weights``, are neither a peer nor one of the hal steps of issue 28)."""
    return rec["variant"] not in HAL_VARIANTS and not _is_hal(rec)


def _is_hal(rec: dict[str, Any]) -> bool:
    return str(rec.get("impl") or "").startswith("hal")


def best_of(row: dict[str, Any]) -> dict[str, Any]:
    """Issue 28's comparison for one row: the fastest measured peer and the fastest measured hal step
    (hal, hal+compile, hal+graph, hal+compile+graph), each ``{"variant", "step_us", "peak_bytes"}`` or
    None, ``ratio`` = best peer time / best hal time (above 1: hal is faster) and ``peak_vs_eager`` =
    the best hal step's peak memory / eager's (None where either is unknown, as on the CPU); FP8
    variants stay out of it. Where the row has FP8 variants, ``fp8``: the fastest FP8 hal step and FP8
    peer, and the best bf16 peer's and the FP8 peer's time over that hal step's (issue 40)."""
    measured = [r for r in row["variants"] if r.get("step_us")]
    fp8 = [r for r in measured if r.get("fp8")]
    measured = [r for r in measured if not r.get("fp8")]  # the bf16 comparison
    peers = [r for r in measured if is_peer(r)]
    hals = [r for r in measured if r["variant"] in HAL_VARIANTS]
    pick = lambda rs: min(rs, key=lambda r: r["step_us"]) if rs else None  # noqa: E731
    peer, hal = pick(peers), pick(hals)
    eager = next((r for r in measured if r["variant"] == "eager"), {})
    brief = lambda r: None if r is None else {"variant": r["variant"], "step_us": r["step_us"], "peak_bytes": r.get("peak_bytes")}  # noqa: E731
    ratio = lambda a, b: a["step_us"] / b["step_us"] if a and b else None  # noqa: E731
    best = {"peer": brief(peer), "hal": brief(hal), "ratio": ratio(peer, hal),
            "peak_vs_eager": hal["peak_bytes"] / eager["peak_bytes"] if hal and hal.get("peak_bytes") is not None and eager.get("peak_bytes") else None}
    if fp8:  # issue 40: the fastest FP8 hal step against the best bf16 peer and the fastest FP8 peer
        fp8_hal, fp8_peer = pick([r for r in fp8 if _is_hal(r)]), pick([r for r in fp8 if not _is_hal(r)])
        best["fp8"] = {"hal": brief(fp8_hal), "peer": brief(fp8_peer), "vs_bf16_peer": ratio(peer, fp8_hal),
                       "vs_fp8_peer": ratio(fp8_peer, fp8_hal)}
    return best


def run_workload(workload: Workload, device: torch.device, timer: Timer, seed: int, use_compile: bool, max_autotune: bool,
                 wanted: Optional[set[str]] = None, progress: Callable[[str], None] = lambda s: None,
                 on_variant: Callable[[dict[str, Any]], None] = lambda row: None, steps: int = TRAJECTORY_STEPS,
                 graphs: bool = False, paired_rounds: int = ROUNDS, peak: Optional[float] = None, max_batch: Sequence[str] = (),
                 max_batch_limit: int = MAX_BATCH_LIMIT) -> dict[str, Any]:
    """The row of one workload: every variant measured in turn (``on_variant`` after each), then the
    judged pairs timed again side by side in ``paired_rounds`` rounds (:mod:`hal_bench.models_paired`),
    then the largest batch of each variant named in ``max_batch`` (:func:`max_batch_of`). ``peak``:
    the device's TFLOP/s for MFU."""
    row: dict[str, Any] = {"model": workload.name, "kind": workload.kind, "describe": workload.describe(), "unit": workload.unit,
                           "items_per_step": workload.items_per_step(), "variants": []}
    flops = workload.flops_per_step()
    if flops is not None:
        row["flops"] = {"per_step": flops.total, "matmul": flops.matmul, "attention": flops.attention, "counted": flops.formula()}
    reference = None
    if workload.kind == "infer":
        try:
            reference = workload.reference(device, seed)
        except Exception as exc:  # noqa: BLE001
            row["reference_error"] = _error(exc)
        _free(device)
    built: dict[str, Variant] = {}
    for variant in workload.variants(use_compile, max_autotune, graphs):
        if wanted and variant.name not in wanted:
            continue
        built[variant.name] = variant
        t0 = time.perf_counter()
        progress(f"{workload.name}: {variant.name} ...")
        rec = measure_variant(workload, variant, device, timer, seed, reference, steps, peak)
        row["variants"].append(rec)
        add_ratios(row)
        state = rec.get("skipped") or rec.get("error") or f"{rec['step_us'] / 1000:.2f} ms/step"
        progress(f"{workload.name}: {variant.name}: {state} ({time.perf_counter() - t0:.0f} s)")
        on_variant(row)
    pairs = judged_pairs(row)
    if pairs and paired_rounds > 0:
        t0 = time.perf_counter()
        progress(f"{workload.name}: {', '.join(' against '.join(p) for p in pairs)}, side by side ...")
        torch._dynamo.reset()
        _free(device)
        row["paired"] = time_side_by_side(pairs, lambda name: build_step(workload, built[name], device, seed), timer,
                                          lambda: _sync(device), paired_rounds)
        torch._dynamo.reset()
        _free(device)
        progress(f"{workload.name}: side by side: " + (row["paired"].get("error") or ", ".join(
            f"{p['peer']} / {p['hal']} {p['ratio']:.2f}x" for p in row["paired"]["pairs"])) + f" ({time.perf_counter() - t0:.0f} s)")
        on_variant(row)
    offered = {v.name: v for v in workload.variants(use_compile, max_autotune, graphs)}
    for name in max_batch:
        t0 = time.perf_counter()
        progress(f"{workload.name}: {name}: the largest batch ...")
        found = (max_batch_of(workload, offered[name], device, seed, limit=max_batch_limit) if name in offered
                 else {"skipped": f"{workload.name} has no variant {name!r}"})
        row.setdefault("max_batch", {})[name] = found
        progress(f"{workload.name}: {name}: largest batch {found.get('largest', found.get('skipped') or found.get('error'))} "
                 f"({time.perf_counter() - t0:.0f} s)")
        on_variant(row)
    return row


def max_batch_of(workload: Workload, variant: Variant, device: torch.device, seed: int, steps: int = MAX_BATCH_STEPS,
                 limit: int = MAX_BATCH_LIMIT) -> dict[str, Any]:
    """The largest batch at which ``variant`` of ``workload`` runs ``steps`` steps without running out
    of device memory (:mod:`hal_bench.batch_search`: batch 1, 2, 4, ... then bisection; each try
    built afresh, everything freed between tries): ``{"largest", "smallest_oom", "tries"}``, or
    ``{"skipped"}`` / ``{"error"}``."""

    def run(batch: int) -> None:
        if variant.compile_mode:
            torch._dynamo.reset()
        step = build_step(workload.with_batch(batch), variant, device, seed)
        for _ in range(steps):
            step()
        _sync(device)

    try:
        return largest_batch(run, 1, limit, free=lambda: _free(device)).as_dict()
    except NotApplicable as exc:
        return {"skipped": str(exc)}
    except Exception as exc:  # noqa: BLE001 - a failure that is not running out of memory is recorded
        traceback.print_exc()
        return {"error": _error(exc)}
    finally:
        if variant.compile_mode:
            torch._dynamo.reset()
        _free(device)


def all_workloads(size: str) -> list[Workload]:
    """Every workload at ``size``, in the order of the table."""
    return [ResNetTrain(size), ResNetInference(size, torch.float16), ResNetInference(size, torch.bfloat16),
            LlamaTrain(size), HFLlamaTrain(size), LlamaPrefill(size), MoEForwardBackward(size)] + [cls(size) for cls in models_big.WORKLOADS]


def run(device: torch.device, models: Optional[Sequence[str]] = None, size: Optional[str] = None, use_compile: Optional[bool] = None,
        max_autotune: bool = True, variants: Optional[Sequence[str]] = None, seed: int = 0,
        progress: Callable[[str], None] = lambda s: None, on_result: Callable[[dict[str, Any]], None] = lambda doc: None,
        steps: int = TRAJECTORY_STEPS, budget_s: Optional[float] = None, graphs: Optional[bool] = None,
        paired_rounds: int = ROUNDS, peak_tflops: Optional[float] = None, max_batch: Sequence[str] = (),
        max_batch_limit: Optional[int] = None) -> dict[str, Any]:
    """Measure the workloads (all, or those named in ``models``) on ``device``; returns the result
    document (``on_result`` sees it after every variant, to save partial results). ``steps``: the
    length of the loss trajectory; ``budget_s``: the timing budget per variant (default 1 s on a
    GPU, 0.3 s on the CPU); ``graphs``: the CUDA-graph variants too (default: on a GPU);
    ``paired_rounds``: the rounds of each row's side-by-side timing (0: none); ``peak_tflops``: the
    device's peak for MFU (default: its datasheet's dense bfloat16 figure where
    :data:`hal_bench.flops.PEAK_BF16_TFLOPS` knows it); ``max_batch``: the variants whose largest
    batch each row searches, up to ``max_batch_limit`` (default :data:`MAX_BATCH_LIMIT` on a GPU, 4 on
    the CPU, where nothing runs out of device memory; no search by default: it costs a build and a
    few steps per try)."""
    from .models_report import judge
    from .runner import environment

    gpu = device.type == "cuda"
    size = size or ("full" if gpu else "cpu")
    if use_compile is None:
        use_compile = True
    graphs = gpu if graphs is None else graphs and gpu
    workloads = all_workloads(size)
    known = {w.name for w in workloads}
    unknown = sorted(set(models or ()) - known)
    if unknown:
        raise ValueError(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    timer = Timer(device, budget_s=budget_s or (1.0 if gpu else 0.3), min_reps=3)
    doc: dict[str, Any] = environment(device)
    peak = peak_tflops or peak_tflops_of(device)
    doc.update(size=size, seed=seed, steps=steps, compile={"enabled": use_compile, "max_autotune": max_autotune}, graphs=graphs, liger=_liger_version(),
               torchao=torchao_float8.version(), peak_tflops=peak, models=[])
    for workload in workloads:
        if models and workload.name not in models:
            continue

        def save(row: dict[str, Any], rows: list = doc["models"], n: int = len(doc["models"])) -> None:
            row["targets"] = judge(row, gpu)
            rows[n:] = [row]
            on_result(doc)

        run_workload(workload, device, timer, seed, use_compile, max_autotune, set(variants) if variants else None, progress, save, steps, graphs,
                     paired_rounds, peak, max_batch, max_batch_limit or (MAX_BATCH_LIMIT if gpu else 4))
    return doc


def _liger_version() -> Optional[str]:
    try:
        from importlib.metadata import version

        return version("liger-kernel")
    except Exception:  # noqa: BLE001 - not installed
        return None
