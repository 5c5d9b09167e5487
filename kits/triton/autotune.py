"""Autotuned launch configurations, cached per device model in a JSON file (any GPU vendor).

A tunable kernel names its problem by a key (kernel name, shape bucket, dtype) and offers candidate
configurations. On the first call with a new key the candidates are timed on the call's own inputs
(device events through ``torch.cuda``, which drives ROCm builds of torch too; median of a few runs
after a warm-up that also compiles them) and the fastest is kept, in memory and in
``$HAL_TRITON_CACHE_DIR/autotune-<device>.json`` (default ``~/.cache/hal/triton``), so later
processes on the same model reuse it. A plugin may ship choices measured on the project's machines
(its :attr:`LaunchTables.seed_dir`); they seed the cache.

Tuning never happens where it would be wrong or wasteful: during graph capture, with
``HAL_TRITON_AUTOTUNE=0``, on CPU tensors, or for problems too small to matter; the first candidate
is used then.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, TypeVar, Union

import torch

from .tables import LaunchTables

log = logging.getLogger("hal")
C = TypeVar("C")  # a launch configuration (GemmConfig) or any hashable choice

#: problems below this many floating-point (or integer) operations use the default configuration
MIN_TUNED_FLOPS = 2e9
#: the operations a GPU's matrix units do in the time its memory moves one byte, about (dense bf16
#: rate over HBM bandwidth: H100 SXM 989e12 / 3.35e12 = 295, H200 989e12 / 4.8e12 = 206, MI300X
#: 1307e12 / 5.3e12 = 247): what a byte of a memory-bound kernel weighs against MIN_TUNED_FLOPS
FLOPS_PER_BYTE = 250.0


def streaming_work(nbytes: float) -> float:
    """The work measure :func:`choose` compares with MIN_TUNED_FLOPS for a memory-bound kernel that
    moves ``nbytes``: a kernel is tuned from about the same duration on, a few microseconds, whether
    its time goes to arithmetic or to bytes (2e9 / 250: from 8 MB moved)."""
    return nbytes * FLOPS_PER_BYTE


def cache_dir() -> Path:
    return Path(os.environ.get("HAL_TRITON_CACHE_DIR") or Path.home() / ".cache" / "hal" / "triton")


def enabled() -> bool:
    return os.environ.get("HAL_TRITON_AUTOTUNE", "1").strip().lower() not in ("0", "false", "no", "off")


class Cache:
    """The choices for one device model: in memory, backed by one JSON file."""

    def __init__(self, path: Path, seed: Optional[Path] = None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._choices: dict[str, dict[str, Any]] = {}
        for source in (seed, path):
            if source is not None:
                self._choices.update(_read(source))


    def get(self, key: str) -> Optional[dict[str, Any]]:
        return self._choices.get(key)

    def put(self, key: str, value: dict[str, Any]) -> None:
        with self._lock:
            self._choices[key] = value
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".autotune-", suffix=".json")
                with os.fdopen(fd, "w") as f:
                    json.dump({"device": self.path.stem, "choices": self._choices}, f, indent=1, sort_keys=True)
                os.replace(tmp, self.path)  # atomic: concurrent processes never read half a file
            except OSError as exc:
                log.warning("hal: cannot write autotune cache %s (%s); choices stay in memory", self.path, exc)


def _read(path: Path) -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
        if isinstance(data, dict) and isinstance(data.get("choices"), dict):
            return data["choices"]
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as exc:
        log.warning("hal: ignoring unreadable autotune cache %s (%s)", path, exc)
    return {}


_caches: dict[str, Cache] = {}
_caches_lock = threading.Lock()


def cache_for(tables: LaunchTables, device: torch.device) -> Cache:
    """The cache of a device model (its plugin's slug), seeded from the plugin's shipped choices."""
    name = tables.slug(device)
    with _caches_lock:
        if name not in _caches:
            seed = tables.seed_dir / f"autotune-{name}.json" if tables.seed_dir is not None else None
            _caches[name] = Cache(cache_dir() / f"autotune-{name}.json", seed)
        return _caches[name]


def _time_ms(fn: Callable[[], Any], reps: int = 5) -> float:
    fn()  # compile and warm up
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


#: this process's choices by (launch tables, device index, key), cached or tuned: a later call of
#: the same problem costs one lookup, not the device's identity, the candidates and the decoding of
#: the cached record (tens of microseconds a call on the H100's host, where a 50 us norm backward
#: called through the autotuner took 80-104 us against 52-67 us launched directly, 2026-12-08)
_chosen: dict[tuple[int, Optional[int], str], Any] = {}


def choose(tables: LaunchTables, device: torch.device, key: str, candidates: Union[Sequence[C], Callable[[], Sequence[C]]],
           run: Callable[[C], Any], flops: float) -> C:
    """The configuration for problem ``key``: chosen before in this process, cached, else tuned now
    by calling ``run(candidate)`` (which launches the kernel on the real inputs), else the first
    candidate (the only one, where there is nothing to choose). ``candidates``: the sequence, or a
    function making it (called only where the choice is not known yet). ``flops``: the problem's
    operations (:func:`streaming_work` for a memory-bound kernel)."""
    if device.type != "cuda" or flops < MIN_TUNED_FLOPS:
        return _listed(candidates)[0]
    memo = (id(tables), device.index, key)  # a tensor's device always has its index
    known = _chosen.get(memo)
    if known is not None:
        return known
    candidates = _listed(candidates)
    if len(candidates) == 1:
        return candidates[0]
    hit = cache_for(tables, device).get(key)
    if hit is not None:
        try:
            chosen = _chosen[memo] = _from_record(type(candidates[0]), hit["config"])
            return chosen
        except (TypeError, KeyError, ValueError):
            pass
    if not enabled() or torch.cuda.is_current_stream_capturing():
        return candidates[0]
    timings: list[tuple[float, C]] = []
    for cand in candidates:
        try:
            timings.append((_time_ms(lambda: run(cand)), cand))
        except Exception as exc:  # a candidate that does not fit (shared memory, registers) is skipped
            log.info("hal: autotune %s: candidate %s failed: %s", key, cand, exc)
    if not timings:
        return candidates[0]
    ms, best = min(timings, key=lambda t: t[0])
    cache_for(tables, device).put(key, {"config": dataclasses.asdict(best), "ms": round(ms, 4), "candidates": len(timings)})
    _chosen[memo] = best
    log.info("hal: autotune %s -> %s (%.3f ms)", key, best, ms)
    return best


def _listed(candidates: Union[Sequence[C], Callable[[], Sequence[C]]]) -> Sequence[C]:
    return candidates() if callable(candidates) else candidates


@dataclasses.dataclass(frozen=True)
class Route:
    """One of several kernels that can run the same call, as a choice timed and cached like a tile
    configuration."""

    name: str


def fastest(tables: LaunchTables, device: torch.device, key: str, runs: Mapping[str, Callable[[], Any]], flops: float) -> str:
    """The name of the fastest of ``runs`` (kernels launched on the same inputs) for problem ``key``,
    timed once per device model and cached as :func:`choose` does; the first name where tuning does
    not happen (graph capture, ``HAL_TRITON_AUTOTUNE=0``, small problems)."""
    routes = tuple(Route(name) for name in runs)
    return choose(tables, device, key, routes, lambda route: runs[route.name](), flops).name


def _from_record(cls: type, record: dict[str, Any]) -> Any:
    """A candidate from its cached ``dataclasses.asdict`` form."""
    from_dict = getattr(cls, "from_dict", None)
    return from_dict(record) if from_dict is not None else cls(**record)


def grouped_key(what: str, x: torch.Tensor, weight: torch.Tensor) -> str:
    """The problem key of a grouped GEMM (x (rows, K), weight (G, K, N)): rows bucketed, the rest exact."""
    g, k, n = weight.shape
    return f"{what}/{x.dtype}/m{bucket(x.shape[0])}/g{g}/k{k}/n{n}"


def bucket(n: int) -> int:
    """Shape bucket of a size: the next power of two (one tuning serves neighbouring sizes)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()
