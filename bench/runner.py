"""Running benchmark cases: each case's hal call, its peers, ratios, fractions of the ceilings, and
the issues' targets judged met or missed. One case failing (out of memory, a peer that does not
exist on this torch) is recorded and the run goes on; a peer that cannot run here is recorded with
its reason. Each record keeps the wall time its case took (setup, compilation, timing).

Every time comes with its spread (:func:`hal_bench.timing.spread`); a row where hal's or a timed
peer's spread exceeds :data:`hal_bench.timing.NOISY_SPREAD` is marked ``noisy`` (its ratios are not
to be trusted: another process, frequency scaling). The fraction of copy bandwidth is taken against
a copy of the case's own footprint (:func:`hal_bench.ceilings.copy_at`), recorded as the row's
``copy_bytes_per_s``."""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os
import platform
import subprocess
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

import hal

from . import ceilings, liger
from .cases import Case, all_cases
from .peer import Peer, as_peer
from .timing import NOISY_SPREAD, Timer, host_overhead_us


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _ratio(peer_us: Optional[float], hal_us: Optional[float]) -> Optional[float]:
    if peer_us is None or not hal_us:
        return None
    return peer_us / hal_us


def run_case(case: Case, device: torch.device, timer: Timer, ceil: dict[str, Any], compile_mode: Optional[str], use_compile: bool,
             copies: Optional[dict[int, float]] = None) -> dict[str, Any]:
    """One result record: times in microseconds, ratios peer/hal (> 1 means hal is faster).
    ``copies``: copy bandwidths by footprint measured so far in this run (filled here)."""
    t0 = time.perf_counter()
    rec = _measure(case, device, timer, ceil, compile_mode, use_compile, {} if copies is None else copies)
    rec["wall_s"] = round(time.perf_counter() - t0, 2)
    return rec


def _time_peer(timer: Timer, peer: Peer, hal_us: float) -> dict[str, Any]:
    if peer.run is None:
        return {"skipped": peer.reason}
    out: dict[str, Any] = {"detail": peer.detail} if peer.detail else {}
    try:
        timed = timer(peer.run, before=peer.restore)
    except Exception as exc:  # noqa: BLE001
        return out | {"error": _error(exc)}
    us = timed["median_us"]
    out |= {"us": us, "ratio": _ratio(us, hal_us), "spread": timed["spread"]}
    if peer.restore is not None:
        out["per_run"] = True  # timed run by run, its inputs restored before each (outside the timing)
    return out


def _measure(case: Case, device: torch.device, timer: Timer, ceil: dict[str, Any], compile_mode: Optional[str], use_compile: bool,
             copies: dict[int, float]) -> dict[str, Any]:
    rec: dict[str, Any] = {"op": case.op, "case": case.name, "dtype": case.dtype, "bytes": case.bytes, "flops": case.flops}
    if case.published:
        rec["published"] = [dataclasses.asdict(p) for p in case.published]
    try:
        setup = case.setup(device)
    except Exception as exc:  # noqa: BLE001 - a case that cannot be built is reported, not fatal
        rec["error"] = f"setup: {_error(exc)}"
        return rec
    try:
        op, args, kwargs = setup.explain
        decision = hal.explain(op, *args, **kwargs)
        rec["kernel"] = f"{decision.backend}/{decision.kernel}" + (f" ({decision.fallback} fallback)" if decision.fallback else "")
        timed = timer(setup.hal)
        rec["hal_us"], rec["hal_spread"] = timed["median_us"], timed["spread"]
    except Exception as exc:  # noqa: BLE001
        rec["error"] = f"hal: {_error(exc)}"
        traceback.print_exc()
        return rec
    hal_us = rec["hal_us"]
    peers: dict[str, Any] = {}
    columns: list[tuple[str, Optional[Callable[[], Any]]]] = [("eager", setup.eager)]
    mode = compile_mode or case.compile_mode or "default"
    if use_compile and setup.compiled is not None and case.compile_mode != "off":
        try:
            columns.append(("compile", setup.compiled(mode)))
            rec["compile_mode"] = mode
        except Exception as exc:  # noqa: BLE001
            peers["compile"] = {"error": _error(exc)}
    for name, fn in columns:
        if fn is not None:
            peers[name] = _time_peer(timer, Peer(run=fn), hal_us)
    for name, p in setup.peers.items():
        peers[f"peer:{name}"] = _time_peer(timer, as_peer(p), hal_us)
    rec["peers"] = peers
    if case.bytes:
        footprint = int(case.bytes)
        if footprint not in copies:
            copies[footprint] = ceilings.copy_at(device, footprint, timer)
        rec["copy_bytes_per_s"] = copies[footprint]
        rec["bw_fraction"] = case.bytes / (hal_us * 1e-6) / copies[footprint]
    if case.flops and ceil.get("matmul_flops_per_s"):
        rec["rate_fraction"] = case.flops / (hal_us * 1e-6) / ceil["matmul_flops_per_s"]
    rec["targets"] = judge(case.targets, rec)
    rec["noisy"] = noisy(rec)
    del setup
    return rec


def noisy(rec: dict[str, Any]) -> list[str]:
    """The timings of a record whose spread exceeds NOISY_SPREAD ("hal ±14%", "eager ±22%")."""
    spreads = [("hal", rec.get("hal_spread"))] + [(k.removeprefix("peer:"), p.get("spread")) for k, p in rec.get("peers", {}).items()]
    return [f"{name} ±{100 * s:.0f}%" for name, s in spreads if s is not None and s > NOISY_SPREAD]


def judge(targets: dict[str, float], rec: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target as {"target", "goal", "value", "met"} (value None when it could not be measured,
    with the "reason" of the peers that did not run where a peer target has none)."""
    out = []
    peers = rec.get("peers", {})
    for name, goal in targets.items():
        named = [(k, p) for k, p in peers.items() if k.startswith("peer:")] if name == "best_peer" else [(name, peers.get(name, {}))]
        if name == "bw":
            value = rec.get("bw_fraction")
        elif name == "rate":
            value = rec.get("rate_fraction")
        elif name == "best_peer":
            times = [p["us"] for _, p in named if "us" in p]
            value = _ratio(min(times), rec.get("hal_us")) if times else None
        else:  # "eager", "compile", "peer:<name>"
            value = peers.get(name, {}).get("ratio")
        t: dict[str, Any] = {"target": name, "goal": goal, "value": value, "met": None if value is None else value >= goal}
        reasons = [f"{k.removeprefix('peer:')}: {p.get('skipped') or p.get('error')}" for k, p in named if "skipped" in p or "error" in p]
        if value is None and name not in ("bw", "rate"):
            t["reason"] = "; ".join(reasons) or "no peer measured"
        out.append(t)
    return out


def dispatch_overhead(device: torch.device) -> dict[str, Any]:
    """Host time of a hal.ops call over calling the chosen kernel directly (same canonical args),
    on a small input where the host cost is what shows."""
    x = torch.randn(64, 64, device=device)
    decision = hal.explain("scale_shift_act", x, 0.5, 0.25, "relu")
    from hal.dispatch import DISPATCHER

    rt = DISPATCHER.runtime()
    spec = next(k for k in rt.kernels("scale_shift_act", decision.backend) if k.name == decision.kernel)
    if (spec.array_api or rt.backends[decision.backend].info.array_api) == "numpy":
        from hal.arrays import to_numpy

        x_direct: Any = to_numpy(x)
    else:
        x_direct = x
    direct = lambda: spec.fn(x_direct, 0.5, 0.25, "relu")  # noqa: E731
    via_hal = lambda: hal.ops.scale_shift_act(x, 0.5, 0.25, "relu")  # noqa: E731
    via_hal()
    direct()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t_hal, t_direct = host_overhead_us(via_hal), host_overhead_us(direct)
    if device.type == "cuda":
        torch.cuda.synchronize()
    over = t_hal - t_direct
    return {"op": "scale_shift_act", "kernel": f"{decision.backend}/{decision.kernel}", "hal_call_us": t_hal, "direct_call_us": t_direct,
            "overhead_us": over, "target_us": 2.0, "met": over <= 2.0}


def _git(*cmd: str) -> Optional[str]:
    root = Path(__file__).resolve().parents[1]  # bench/ sits at the top of the repository
    try:
        return subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device: torch.device) -> dict[str, Any]:
    dev: dict[str, Any] = {"type": device.type}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        dev.update(name=p.name, arch=f"sm_{p.major}{p.minor}", memory_bytes=int(p.total_memory), multiprocessors=p.multi_processor_count)
    else:
        dev.update(name=platform.processor() or platform.machine())
    told = os.environ.get("HAL_COMMIT")  # a copy of the tree on a device machine: wins over its .git
    status = None if told else _git("status", "--porcelain")
    try:
        import triton

        triton_version: Optional[str] = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": told or _git("rev-parse", "HEAD"),
        "dirty": bool(status) if status is not None else ((os.environ["HAL_DIRTY"] == "1") if "HAL_DIRTY" in os.environ else None),
        "hal_version": hal.__version__,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "liger": liger.version(),
        "device": dev,
    }


def run(
    device: torch.device,
    ops: Optional[Sequence[str]] = None,
    use_compile: Optional[bool] = None,
    compile_mode: Optional[str] = None,
    progress: Callable[[str], None] = lambda s: None,
    on_case: Callable[[dict[str, Any]], None] = lambda doc: None,
) -> dict[str, Any]:
    """Measure every case (or those of ``ops``) on ``device``; returns the result document.
    ``on_case`` sees the document after each case (to save partial results)."""
    gpu = device.type == "cuda"
    if use_compile is None:
        use_compile = gpu
    timer = Timer(device, budget_s=0.3 if gpu else 0.05, min_reps=5 if gpu else 3)
    doc: dict[str, Any] = environment(device)
    doc["ceilings"] = ceilings.measure(device, timer)
    _free(device)
    doc["compile"] = {"enabled": use_compile, "mode": compile_mode or "per case (default, or max-autotune-no-cudagraphs for the convolutions)"}
    started = time.perf_counter()
    wanted = set(ops) if ops else None
    results: list[dict[str, Any]] = []
    doc["results"] = results
    copies: dict[int, float] = {}
    for case in all_cases(gpu):
        if wanted and case.op not in wanted and case.op.removesuffix("_backward") not in wanted:
            continue
        progress(f"{case.op}: {case.name}")
        results.append(run_case(case, device, timer, doc["ceilings"], compile_mode, use_compile, copies))
        if results[-1].get("noisy"):
            progress(f"warning: noisy timings ({', '.join(results[-1]['noisy'])}): this row's ratios are not reliable")
        _free(device)
        doc["wall_s"] = round(time.perf_counter() - started, 1)
        on_case(doc)
    if not wanted or "dispatch" in wanted or "scale_shift_act" in wanted:
        try:
            doc["dispatch_overhead"] = dispatch_overhead(device)
        except Exception as exc:  # noqa: BLE001
            doc["dispatch_overhead"] = {"error": _error(exc)}
    return doc
