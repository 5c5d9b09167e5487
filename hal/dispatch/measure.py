"""Step 5: where several routes can serve a call, time them on the call's own inputs and take the
fastest (as ``cudnnFind`` and ``torch.backends.cudnn.benchmark`` do for convolutions).

Priority is a guess made when a kernel is registered; the call's shape, dtype, layout and device
decide which kernel is fastest, and whether the host's time per launch counts. So, once per device
model, op, dtypes, layout, shape bucket, static arguments and *context*, the routes are run and
timed, and the winner is kept in a per-device cache on disk (:mod:`hal.tuning.cache`) that later
processes read. The contexts rank differently:

- ``eager``: a call as Python issues it: the time between one call and the next in a steady loop,
  host time included (on a slow host a kernel with a cheaper launch wins small calls);
- ``graph``: inside :func:`hal.graphs.device_bound` (a step that will be replayed from a CUDA
  graph): device time alone, the host having queued the calls ahead behind a sleep kernel;
- ``compiled``: inside a torch.compile graph, a call whose kernel is not made of torch's ops is one
  opaque node; its alternative is the best kernel that is, whose ops Inductor compiles into the
  graph. Measured only when asked (:func:`hal.tuning.for_compile`, ``hal tune --contexts
  compiled``): the opaque route against ``torch.compile`` of the torch-ops kernel, wall time
  (:mod:`hal.integration.compile`);
- ``/train`` after any of them: the call needs autograd, and each route is timed forward and
  backward (torch's autograd recording a kernel, hal's node with the backward op's own choice, or
  the training decomposition), since that pair is what a training step pays.

``HAL_TUNE``: ``on`` (default) measures where nothing is cached; ``cached`` uses cached and shipped
results only (else priority); ``off`` ranks by priority alone. Nothing is measured inside a CUDA
graph capture, a torch.compile trace or ``hal.explain`` following a decomposition: the priority
choice serves that call and the decision is not cached, so the next eager call measures.

Measurement has no effect on the caller's data: arrays an op writes are copied, inputs that
require grad are replaced by detached leaves, gradients are returned by ``torch.autograd.grad``
and dropped, and nothing counts in ``hal.stats()``. A route that raises while timed is never
chosen; if hal's first choice raises, measurement is abandoned and the call raises as it would
untuned. The first choice keeps its place unless another route is faster by more than
:data:`MARGIN` (the noise of a shared host would otherwise flip choices between processes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import math
import re
import statistics
import threading
import time
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from hal import arrays, config
from hal.registry import OpDecl
from hal.runtime import Runtime
from hal.tuning.cache import TuneCache
from hal.types import ARRAY_KINDS, Kind
from hal.version import __version__

from .route import Route
from .validate import Prepared

log = logging.getLogger("hal")

#: another route must beat hal's first choice by more than this fraction to replace it.
MARGIN = 0.03
#: rounds of timing per route, interleaved across routes (medians over them).
ROUNDS = 3
#: the time one round of one route aims at, in seconds (enough runs to outlast a timer's grain).
ROUND_S = 0.004
#: at most this many runs in one round.
MAX_RUNS = 200
#: arrays an op writes are copied for the measurement; above this many bytes it is not measured.
COPY_BUDGET = 1 << 30
#: a route slower than this many times the fastest on its best of two single runs is timed no further.
PRUNE = 4.0
#: after two rounds, stop once measuring one call has taken this many seconds.
BUDGET_S = 0.08


@dataclasses.dataclass(frozen=True)
class Measurement:
    """How a route was chosen by time: the context, each route's median time, the winner."""

    key: str
    context: str
    #: (route label, median microseconds; inf where the route raised), in hal's priority order.
    times_us: tuple[tuple[str, float], ...]
    winner: str
    #: "measured" (just now), "cache" (measured earlier on this device) or "seed" (shipped by a plugin).
    source: str
    #: seconds this process spent measuring it (0 when read from a cache), the measurements of the
    #: calls its routes made in turn included.
    spent_s: float = 0.0
    #: made while another call's routes were timed (a backward op's, say): its time is in that one's.
    nested: bool = False

    def time_of(self, label: str) -> Optional[float]:
        return dict(self.times_us).get(label)

    def describe(self) -> str:
        where = {"measured": f"measured now in {self.spent_s:.2f} s", "cache": "from this device's tune cache",
                 "seed": "seeded by its plugin's shipped measurements"}[self.source]
        return f"by measured time, context {self.context} ({where})"


@dataclasses.dataclass(frozen=True)
class Outcome:
    """The route to run, how it was chosen, and whether the decision may be cached (False where it
    fell back to priority only because measuring was not possible at this moment)."""

    route: Route
    measurement: Optional[Measurement] = None
    final: bool = True
    #: why nothing was measured where alternatives exist (explain shows it).
    note: str = ""


#: every measurement made in this process, in order (hal.tuning.tune reports the ones of a step).
LOG: list[Measurement] = []
_LOG_LOCK = threading.Lock()


class _Busy(threading.local):
    """Per thread: the keys being measured now (a route timed may call the same op again)."""

    keys: Optional[set[str]] = None


_BUSY = _Busy()


def choose(
    decl: OpDecl,
    prepared: Prepared,
    args: Sequence[Any],
    routes: Sequence[Route],
    mode: str,
    device_bound: bool,
    may_measure: bool,
    runtime: Runtime,
    runner: Callable[[Route], Callable[..., Any]],
    nested: bool = False,
    base_context: Optional[str] = None,
) -> Outcome:
    """The route for a call among ``routes`` (hal's first choice first). ``mode`` is HAL_TUNE's;
    ``may_measure`` False inside a capture, a trace or explain's walk; ``runner(route)`` gives an
    uncounted runnable plan of a route; ``nested``: the call is made while another's routes are
    timed (its cost is part of that one's; a backward runs on torch's device threads, so this comes
    from the scope, which hal's autograd node carries there); ``base_context``: "compiled" for
    :mod:`hal.integration.compile`'s measurements (default: eager or graph, as the scope says)."""
    first = routes[0]
    if len(routes) < 2 or mode == "off":
        return Outcome(first)
    inputs = prepared.inputs
    train = any(r.kind != "kernel" for r in routes)
    base = base_context or ("graph" if device_bound and inputs.device_kind != "cpu" else "eager")
    context = base + ("/train" if train else "")
    key = tune_key(decl, prepared, context, grads=base_context is None)
    labels = [r.label for r in routes]
    cache = cache_of(prepared, runtime)
    record = cache.get(key)
    if record is not None and record.get("winner") in labels:
        times = tuple((label, float(record.get("times_us", {}).get(label, math.inf))) for label in labels)
        source = "seed" if record.get("source") == "seed" else "cache"
        found = Measurement(key, context, times, record["winner"], source)
        return Outcome(routes[labels.index(record["winner"])], found)
    if mode == "cached":
        return Outcome(first, note="HAL_TUNE=cached and nothing cached for these inputs: ranked by priority")
    busy = _BUSY.keys if _BUSY.keys is not None else set()
    if not may_measure or key in busy:
        return Outcome(first, final=False, note="not measured here (a capture, a trace or explain): ranked by priority this once")
    copied = _written_bytes(decl, prepared.inputs.args)
    if copied > COPY_BUDGET:
        return Outcome(first, note=f"not measured: it writes {copied / 2**30:.1f} GiB in place, which measuring would copy")
    _BUSY.keys = busy | {key}
    try:
        with config.scope(measuring=True):  # nothing it runs counts in hal.stats()
            measured = _measure(decl, args, routes, context, runner, inputs.device)
    finally:
        _BUSY.keys = busy
    if measured is None:
        return Outcome(first, note="not measured: hal's first choice raised while timed (the call raises as it would untuned)")
    times, spent = measured
    best = min(range(len(routes)), key=lambda i: times[i])
    if not times[0] > times[best] * (1 + MARGIN):
        best = 0
    found = Measurement(key, context, tuple(zip(labels, times)), labels[best], "measured", spent, nested=nested or bool(busy))
    cache.put(key, {"winner": labels[best], "times_us": {label: _rounded(t) for label, t in zip(labels, times)},
                    "context": context, "op": decl.name, "source": "measured",
                    "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
    with _LOG_LOCK:
        LOG.append(found)
    log.info("hal: %s %s: %s", decl.name, found.describe(), ", ".join(f"{lb} {t:.1f} us" for lb, t in found.times_us))
    return Outcome(routes[best], found)


# --- keys and caches --------------------------------------------------------------------------


def bucket(n: int) -> int:
    """The shape bucket of a size: exact up to 16, else the next power of two (one measurement
    serves neighbouring sizes)."""
    return n if n <= 16 else 1 << (int(n) - 1).bit_length()


def _layout(a: Any) -> str:
    if isinstance(a, torch.Tensor):
        if a.is_contiguous():
            return "c"
        if a.dim() == 4 and a.is_contiguous(memory_format=torch.channels_last):
            return "cl"
        if a.dim() >= 2 and a.transpose(-1, -2).is_contiguous():
            return "t"
        return "s"
    return "c" if a.flags.c_contiguous else "s"


def _array_key(a: Any, grads: bool = True) -> str:
    grad = "g" if grads and isinstance(a, torch.Tensor) and a.requires_grad else ""
    return f"{arrays.dtype_name(a)}[{','.join(str(bucket(int(s))) for s in a.shape)}]{_layout(a)}{grad}"


def tune_key(decl: OpDecl, prepared: Prepared, context: str, grads: bool = True) -> str:
    """What a measurement is valid for: the op, the context, each array's dtype, bucketed shape,
    layout and (``grads``) whether it requires grad, and the static arguments that shape the
    computation (floats and volatile values by type only: an epsilon or a learning rate does not
    change which kernel is fastest). The compiled context keys without grads: a graph's node sees
    its inputs below autograd, and the context says whether the call trains. A NumPy caller's
    measurements are its own ("numpy" after the context): they include the conversions to and from
    a torch kernel, and a kernel may serve NumPy callers only, so a winner measured for one array
    type is neither valid for the other nor to be overwritten by its measurements."""
    parts = [decl.name, context]
    if prepared.inputs.array_type == "numpy":
        parts.append("numpy")
    for p, a in zip(decl.params, prepared.inputs.args):
        if p.kind in ARRAY_KINDS and arrays.is_array(a):
            parts.append(_array_key(a, grads))
        elif isinstance(a, (list, tuple)) and a and all(arrays.is_array(x) for x in a):
            parts.append(f"{len(a)}x" + _array_key(max(a, key=lambda x: x.numel() if isinstance(x, torch.Tensor) else x.size), grads))
        elif p.name in decl.volatile or isinstance(a, float) or (p.kind is not Kind.STATIC and a is not None):
            parts.append(type(a).__name__)
        else:
            parts.append(repr(a))
    return "|".join(parts)


_CACHES: dict[tuple[str, str], TuneCache] = {}
_CACHES_LOCK = threading.Lock()


def device_slug(device: torch.device) -> str:
    """The device model measurements are kept for: "nvidia-h200-sm90", "cpu-<model>-<threads>t"."""
    if device.type != "cpu":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        arch = getattr(props, "gcnArchName", "").split(":")[0] if torch.version.hip else f"sm{props.major}{props.minor}"
        return _slug(f"{props.name}-{arch}")
    return _slug(f"cpu-{_cpu_model()}-{torch.get_num_threads()}t")


def cache_for(device: torch.device, runtime: Runtime) -> TuneCache:
    """The tune cache of a device's model, keyed by the versions that make a measurement stale
    (hal, torch, the driver, the loaded plugins and their kernels), seeded by the backends' shipped
    measurements."""
    slug = device_slug(device)
    signature = runtime.signature()
    with _CACHES_LOCK:
        cache = _CACHES.get((slug, signature))
        if cache is None:
            versions = {"hal": __version__, "torch": torch.__version__, "plugins": signature,
                        "driver": _driver_version() if device.type != "cpu" else "none"}
            seeds = [state.info.tuning_seeds / f"{slug}.json" for state in runtime.backends.values()
                     if state.info.tuning_seeds is not None]
            cache = _CACHES[(slug, signature)] = TuneCache(slug, versions, seeds=[s for s in seeds if s.is_file()])
        return cache


def cache_of(prepared: Prepared, runtime: Runtime) -> TuneCache:
    """The tune cache of the device a call's arrays are on (the CPU's for NumPy arrays)."""
    inputs = prepared.inputs
    return cache_for(inputs.device if inputs.array_type == "torch" else torch.device("cpu"), runtime)


def forget_caches() -> None:
    """Drop the tune caches held in memory (they are read again from disk; HAL_TUNE_CACHE is read
    again): for tests and after changing the environment."""
    with _CACHES_LOCK:
        _CACHES.clear()


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _driver_version() -> str:
    """The GPU driver's version: CUDA's from libcuda (cuDriverGetVersion), ROCm's HIP version."""
    if torch.version.hip:
        return str(torch.version.hip)
    try:
        import ctypes

        version = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0:
            return str(version.value)
    except OSError:
        pass
    return "unknown"


def _rounded(t: float) -> Any:
    return round(t, 3) if math.isfinite(t) else "inf"


# --- timing -------------------------------------------------------------------------------------


def _measure(decl: OpDecl, args: Sequence[Any], routes: Sequence[Route], context: str,
             runner: Callable[[Route], Callable[..., Any]], device: Any) -> Optional[tuple[list[float], float]]:
    """Median microseconds of each route over interleaved rounds, and the seconds spent; None when
    hal's first choice raised. torch's random streams (CPU, and the call's GPU) are as they were
    before: measuring draws gradients and may run random kernels, and a step measured on its first
    call must draw the same dropout masks as any other (activation checkpointing replays them)."""
    gpus = [device] if isinstance(device, torch.device) and device.type == "cuda" else []
    with torch.random.fork_rng(devices=gpus, device_type="cuda"), _apart():
        return _measure_routes(decl, args, routes, context, runner, device)


@contextlib.contextmanager
def _apart() -> Iterator[None]:
    """Measuring outside whatever watches the caller's ops: the tensors its forward and backward
    save go to no saved-tensor hooks (activation checkpointing counts what a block saves, and
    recomputes the block later without measuring), and its ops to no dispatch mode (selective
    checkpointing caches each op it sees; a user's FLOP counter would count the candidates)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with torch.autograd.graph.saved_tensors_hooks(_same, _same), _disable_current_modes():
        yield


def _same(t: Any) -> Any:
    return t


def _measure_routes(decl: OpDecl, args: Sequence[Any], routes: Sequence[Route], context: str,
                    runner: Callable[[Route], Callable[..., Any]], device: Any) -> Optional[tuple[list[float], float]]:
    started = time.perf_counter()
    on_device = isinstance(device, torch.device) and device.type != "cpu"
    graph = context.startswith("graph")
    sync = torch.cuda.synchronize if on_device else _nothing
    timer = _device_time if (graph and on_device) else _wall_time
    calls: list[Optional[Callable[[], Any]]] = []
    walls: list[float] = []  # one call, host and device: what a round of it costs to run
    singles: list[float] = []  # one call as the context counts it
    for i, route in enumerate(routes):
        try:
            call = _one_call(decl, args, runner(route), context.endswith("/train"))
            call()  # warm-up: compilation, autotuning, lazy state, the backward op's own decision
            walls.append(max(min(_wall_time(call, 1, sync) for _ in range(2)), 1e-7))
            singles.append(max(min(timer(call, 1, sync) for _ in range(2)), 1e-7) if timer is not _wall_time else walls[-1])
        except Exception as exc:  # noqa: BLE001 - a route that fails here is never chosen
            if i == 0:
                log.info("hal: %s: measuring stopped, hal's first choice %s raised %s: %s", decl.name, route.label, type(exc).__name__, exc)
                return None
            log.info("hal: %s: route %s raised while timed (%s: %s); not chosen", decl.name, route.label, type(exc).__name__, exc)
            calls.append(None)
            walls.append(math.inf)
            singles.append(math.inf)
            continue
        calls.append(call)
    # a route several times slower than the fastest on its best of two single runs is not timed
    # further: that is its figure (rounds of it would only cost time)
    fastest = min(singles)
    timed = [c is not None and singles[i] <= PRUNE * fastest for i, c in enumerate(calls)]
    runs = [max(1, min(MAX_RUNS, int(ROUND_S / walls[i]))) if timed[i] else 0 for i in range(len(calls))]
    samples: list[list[float]] = [[] for _ in routes]
    for r in range(ROUNDS):
        for i, call in enumerate(calls):
            if timed[i]:
                assert call is not None
                samples[i].append(timer(call, runs[i], sync) / runs[i] * 1e6)
        if r >= 1 and time.perf_counter() - started > BUDGET_S:
            break
    times = [statistics.median(samples[i]) if samples[i] else singles[i] * 1e6 for i in range(len(calls))]
    return times, time.perf_counter() - started


def _wall_time(call: Callable[[], Any], n: int, sync: Callable[[], None]) -> float:
    """Seconds for ``n`` calls in a loop, host and device together (what an eager loop pays)."""
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    sync()
    return time.perf_counter() - t0


def _device_time(call: Callable[[], Any], n: int, sync: Callable[[], None]) -> float:
    """Seconds of device time for ``n`` calls: the host queues them behind a sleep kernel long
    enough to cover its own time, so the events see back-to-back kernels (as a graph replays)."""
    sync()
    t0 = time.perf_counter()
    call()
    host = time.perf_counter() - t0
    sync()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(2 * host * n * _clock_hz()))
    start.record()
    for _ in range(n):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _clock_hz() -> float:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    khz = getattr(props, "clock_rate", 0) or 2_000_000
    return khz * 1e3


def _nothing() -> None:
    return None


def _one_call(decl: OpDecl, args: Sequence[Any], run: Callable[..., Any], train: bool) -> Callable[[], Any]:
    """A call of ``run`` on copies of the arguments that leave the caller's untouched: written
    arrays cloned, inputs that require grad as detached leaves; with ``train``, forward and
    backward (gradients by ``torch.autograd.grad``, dropped)."""
    own = list(args)
    for name in decl.mutates:
        i = decl.index(name)
        own[i] = _cloned(own[i])
    leaves: list[torch.Tensor] = []
    for i, p in enumerate(decl.params):
        if p.kind in ARRAY_KINDS:
            own[i] = _leaves_of(own[i], leaves)
    if not (train and leaves):
        return lambda: run(*own)
    grads: dict[int, torch.Tensor] = {}

    def forward_backward() -> None:
        out = run(*own)
        outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not outs:
            return
        for j, t in enumerate(outs):
            if j not in grads or grads[j].shape != t.shape:
                grads[j] = torch.randn_like(t) if t.is_floating_point() else torch.ones_like(t)
        torch.autograd.grad(outs, leaves, [grads[j] for j in range(len(outs))], allow_unused=True)

    return forward_backward


def _cloned(a: Any) -> Any:
    if isinstance(a, (list, tuple)):
        return type(a)(_cloned(x) for x in a)
    if isinstance(a, torch.Tensor):
        return a.detach().clone()
    if arrays.is_array(a):
        return a.copy()
    return a


def _leaves_of(a: Any, leaves: list[torch.Tensor]) -> Any:
    if isinstance(a, (list, tuple)):
        return type(a)(_leaves_of(x, leaves) for x in a)
    if isinstance(a, torch.Tensor) and a.requires_grad:
        leaf = a.detach().requires_grad_(True)
        leaves.append(leaf)
        return leaf
    return a


def _written_bytes(decl: OpDecl, args: Sequence[Any]) -> int:
    total = 0
    for name in decl.mutates:
        a = args[decl.index(name)]
        for x in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(x, torch.Tensor):
                total += x.numel() * x.element_size()
            elif arrays.is_array(x):
                total += x.nbytes
    return total
