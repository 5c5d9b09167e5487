"""Conformance cases of hal.dist for ``hal conformance --world-size N``.

:func:`run` starts ``N`` local ranks (gloo on the CPU, or NCCL/RCCL with one rank per local GPU),
runs every (collective, algorithm, dtype, case) on each, and returns one result record per case in
the report schema of API.md. Each rank draws every rank's input from the seed, so it computes the
float64 NumPy reference of the whole collective itself and checks its own output (nccl-tests'
verifiable mode). ``exact`` inputs are small non-zero integers whose sums every dtype holds, so
they must match bit for bit (``avg`` up to one rounding); ``random`` inputs are normal draws checked
against the rounding bound of the algorithm's transfer dtype; ``near_max`` inputs sit near the fp16
maximum, where a 16-bit sum would overflow and the compressed algorithms must not.
With N >= 4 even, the ranks are declared as 2 nodes (``LOCAL_WORLD_SIZE = N/2``) so ``hierarchical`` runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import zlib
from typing import Any, Optional

import numpy as np

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send_recv")
ALL_REDUCE_ALGORITHMS = ("native", "hierarchical", "compressed_fp16", "compressed_bf16")
REDUCING_DTYPES = ("float32", "float16", "bfloat16", "float64", "int32")
MOVING_DTYPES = ("float32", "float16", "bfloat16", "int64", "uint8")
OPS = ("sum", "avg", "max", "min")
#: unit roundoff of what an algorithm sends / accumulates in, for the random cases' bound.
_UNIT = {"compressed_fp16": 2.0**-11, "compressed_bf16": 2.0**-8}
_DTYPE_UNIT = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53}


@dataclasses.dataclass(frozen=True)
class Case:
    """One conformance case; ``id`` is stable across runs (the xfail lists name it)."""

    collective: str
    algorithm: str
    dtype: str
    kind: str  # exact, random, near_max
    op: str = ""
    shape: tuple[int, ...] = ()
    layout: str = "contiguous"  # or "transposed" (a non-contiguous view)
    variant: str = ""  # all_to_all split mode, broadcast root

    @property
    def id(self) -> str:
        parts = [self.op, self.kind, "x".join(map(str, self.shape)) or "scalar", self.layout, self.variant]
        return "-".join(p for p in parts if p)


def _ops(dtype: str) -> tuple[str, ...]:
    return OPS if dtype.startswith(("float", "bfloat")) else tuple(o for o in OPS if o != "avg")  # avg: floats only


def cases(world_size: int, quick: bool) -> list[Case]:
    """Every case for a group of ``world_size`` ranks (fewer and smaller with ``quick``)."""
    n = world_size
    shapes: list[tuple[tuple[int, ...], str]] = [((1,), "contiguous"), ((1037,), "contiguous"), ((17, 33), "transposed")]
    if not quick:
        shapes.append((((1 << 20) + 3,), "contiguous"))
    out: list[Case] = []
    for alg in ALL_REDUCE_ALGORITHMS:
        for dtype in REDUCING_DTYPES:
            for op in _ops(dtype):
                for shape, layout in shapes:
                    out.append(Case("all_reduce", alg, dtype, "exact", op, shape, layout))
        out.append(Case("all_reduce", alg, "float32", "random", "sum", (4099,)))
        out.append(Case("all_reduce", alg, "float32", "random", "avg", (17, 33), "transposed"))
    for alg in ("compressed_fp16", "compressed_bf16"):
        out.append(Case("all_reduce", alg, "float32", "near_max", "sum", (2053,)))
        out.append(Case("all_reduce", alg, "float16", "near_max", "avg", (2053,)))
    for dtype in REDUCING_DTYPES:
        for op in _ops(dtype):
            out.append(Case("reduce_scatter", "native", dtype, "exact", op, (3 * n, 5)))
        out.append(Case("reduce_scatter", "native", dtype, "exact", "sum", (n, 1)))
    for dtype in MOVING_DTYPES:
        out.append(Case("all_gather", "native", dtype, "exact", "", (5, 3)))
        out.append(Case("all_gather", "native", dtype, "exact", "", (9, 4), "transposed"))
        out.append(Case("all_gather", "native", dtype, "exact", "", ()))
        for mode in ("equal", "splits", "exchanged"):
            out.append(Case("all_to_all", "native", dtype, "exact", "", (2 * n, 3), variant=mode))
        for root in sorted({0, n - 1}):
            out.append(Case("broadcast", "native", dtype, "exact", "", (257,), variant=f"src{root}"))
        out.append(Case("send_recv", "native", dtype, "exact", "", (129, 2)))
    if not quick:
        out.append(Case("all_gather", "native", "float32", "exact", "", ((1 << 18) + 1,)))
        out.append(Case("all_to_all", "native", "float32", "exact", "", (n * 4099, 8), variant="splits"))
    return out


def _a2a_splits(case: Case, seed: int, n: int) -> Optional[list[list[int]]]:
    """splits[src][dst]: rows rank src sends to rank dst (some zero), for the split-size variants."""
    if case.collective != "all_to_all" or case.variant == "equal":
        return None
    rng = np.random.default_rng([seed, zlib.crc32(case.id.encode()), n])
    rows = case.shape[0] // n
    return [[int(v) for v in rng.integers(0, 2 * rows, size=n)] for _ in range(n)]


def _inputs(case: Case, seed: int, n: int, splits: Optional[list[list[int]]]) -> list[np.ndarray]:
    """Every rank's input of ``case``, in float64 (deterministic in seed, case and world size)."""
    rng = np.random.default_rng([seed, zlib.crc32(f"{case.collective}/{case.algorithm}/{case.dtype}/{case.id}".encode()), n])
    out = []
    for rank in range(n):
        shape = case.shape if splits is None else (sum(splits[rank]), *case.shape[1:])
        if case.kind == "exact":
            magnitude = rng.integers(1, 9 if case.dtype == "uint8" else 5, size=shape)
            sign = 1 if case.dtype == "uint8" else rng.choice(np.array([-1, 1]), size=shape)
            out.append((magnitude * sign).astype(np.float64))
        elif case.kind == "random":
            out.append(rng.standard_normal(shape) * 2.0 ** float(rng.integers(-20, 20)))
        else:  # near_max: magnitudes in [0.5, 0.98] x 65504, signs mostly positive so sums grow
            signs = rng.choice(np.array([-1.0, 1.0]), size=shape, p=[0.1, 0.9])
            out.append(rng.uniform(0.5, 0.98, size=shape) * 65504.0 * signs)
    return out


def _reference(case: Case, xs: list[np.ndarray], rank: int, n: int, splits: Optional[list[list[int]]]) -> Optional[np.ndarray]:
    c = case.collective
    if c in ("all_reduce", "reduce_scatter"):
        stack = np.stack(xs)
        full = {"sum": stack.sum(0), "avg": stack.sum(0) / n, "max": stack.max(0), "min": stack.min(0)}[case.op]
        return full if c == "all_reduce" else np.split(full, n)[rank]
    if c == "all_gather":
        return np.concatenate(xs) if xs[0].ndim else np.stack(xs)
    if c == "broadcast":
        return xs[int(case.variant[3:])]
    if c == "send_recv":
        return xs[(rank - 1) % n]
    if case.variant == "equal":
        return np.concatenate([np.split(x, n)[rank] for x in xs])
    assert splits is not None
    blocks = []
    for src in range(n):
        offsets = np.cumsum([0, *splits[src]])
        blocks.append(xs[src][offsets[rank] : offsets[rank + 1]])
    return np.concatenate(blocks)


def _tolerance(case: Case, xs: list[np.ndarray], n: int) -> tuple[float, float]:
    """(atol, rtol) of ``case``: zero for exact data, else the rounding bound of the transfer."""
    if case.kind == "exact":
        if case.op == "avg":  # one rounding of the division
            return 0.0, 2 * _DTYPE_UNIT.get(case.dtype, 0.0)
        return 0.0, 0.0
    unit = _UNIT.get(case.algorithm, n * _DTYPE_UNIT[case.dtype])
    unit = max(unit, _DTYPE_UNIT[case.dtype])
    magnitude = float(np.abs(np.stack(xs)).sum(0).max())
    if case.op == "avg":
        magnitude /= n
    return 2 * unit * magnitude, 2 * unit


def _tensor(torch: Any, x: np.ndarray, dtype: str, layout: str, device: str) -> Any:
    t = torch.from_numpy(np.array(x.T if layout == "transposed" else x)).to(getattr(torch, dtype))  # a copy
    t = t.to(device)
    return t.T if layout == "transposed" else t


def _execute(case: Case, xs: list[np.ndarray], rank: int, n: int, device: str, splits: Optional[list[list[int]]]) -> Any:
    import torch

    import hal.dist as hd

    t = _tensor(torch, xs[rank], case.dtype, case.layout, device)
    c = case.collective
    if c == "all_reduce":
        hd.all_reduce(t, op=case.op, algorithm=case.algorithm)
        return t
    if c == "reduce_scatter":
        return hd.reduce_scatter(t, op=case.op, algorithm=case.algorithm)
    if c == "all_gather":
        return hd.all_gather(t, algorithm=case.algorithm)
    if c == "broadcast":
        if rank != int(case.variant[3:]):
            t.fill_(-7 if case.dtype != "uint8" else 77)  # poison: must be overwritten
        hd.broadcast(t, int(case.variant[3:]))
        return t
    if c == "send_recv":  # a ring; odd ranks receive first, so that no cycle of blocked sends forms (NCCL)
        out = torch.full_like(t, -7 if case.dtype != "uint8" else 77)
        if rank % 2:
            hd.recv(out, (rank - 1) % n)
            hd.send(t, (rank + 1) % n)
        else:
            hd.send(t, (rank + 1) % n)
            hd.recv(out, (rank - 1) % n)
        return out
    if case.variant == "equal":
        return hd.all_to_all(t)
    mine = splits[rank] if splits else None
    theirs = [splits[src][rank] for src in range(n)] if splits else None
    return hd.all_to_all(t, input_split_sizes=mine, output_split_sizes=theirs if case.variant == "splits" else None)


def _record(case: Case, n: int, status: str, errs: tuple[float, float] = (0.0, 0.0), tol: tuple[float, float] = (0.0, 0.0), reason: str = "") -> dict[str, Any]:
    return {
        "op": case.collective,
        "kernel": case.algorithm,
        "dtype": case.dtype,
        "case": f"{case.id}-ws{n}",
        "status": status,
        "max_abs_err": errs[0],
        "max_rel_err": errs[1],
        "atol": tol[0],
        "rtol": tol[1],
        "reason": reason,
    }


def _check(case: Case, got: np.ndarray, want: np.ndarray, tol: tuple[float, float]) -> tuple[str, tuple[float, float], str]:
    if got.shape != want.shape:
        return "fail", (float("inf"), float("inf")), f"shape {got.shape}, expected {want.shape}"
    if got.size == 0:
        return "pass", (0.0, 0.0), ""
    if case.kind == "near_max" and not np.all(np.isfinite(got)):
        return "fail", (float("inf"), float("inf")), "overflowed: non-finite values in the result"
    diff = np.abs(got - want)
    errs = (float(diff.max()), float((diff / np.maximum(np.abs(want), 1e-300)).max()))
    bad = diff > tol[0] + tol[1] * np.abs(want)
    if bad.any():
        i = int(np.argmax(bad.reshape(-1)))
        return "fail", errs, f"{int(bad.sum())} element(s) off, first at flat index {i}: {got.reshape(-1)[i]!r} != {want.reshape(-1)[i]!r}"
    return "pass", errs, ""


def rank_cases(rank: int, world_size: int, seed: int, quick: bool, device: str, folder: str = "") -> list[dict[str, Any]]:
    """Run every case on this rank (inside a launched group); one record per case.

    With ``folder``, each record is also appended to ``folder/rank<r>.jsonl`` as soon as it exists,
    so the cases before a crash are still reported.
    """
    import torch

    from hal.dist import CommError
    from hal.errors import UnsupportedError

    n = world_size
    dev = f"cuda:{torch.cuda.current_device()}" if device != "cpu" else "cpu"
    out: list[dict[str, Any]] = []
    broken = ""
    for case in cases(n, quick):
        if broken:  # the group is out of step after a failed transfer: nothing more can run
            out.append(_record(case, n, "error", reason=broken))
            continue
        splits = _a2a_splits(case, seed, n)
        xs = _inputs(case, seed, n, splits)
        tol = _tolerance(case, xs, n)
        want = _reference(case, xs, rank, n, splits)
        try:
            got = _execute(case, xs, rank, n, dev, splits)
        except UnsupportedError as exc:  # raised on every rank alike, before anything is sent
            out.append(_record(case, n, "skip", tol=tol, reason=str(exc)))
            _log(folder, rank, out[-1])
            continue
        except Exception as exc:  # reported as this case's error; a transfer failure ends the run
            out.append(_record(case, n, "error", tol=tol, reason=f"rank {rank}: {type(exc).__name__}: {exc}"))
            _log(folder, rank, out[-1])
            if isinstance(exc, CommError):
                broken = f"not run: an earlier case broke the group ({exc})"
            continue
        status, errs, reason = _check(case, got.detach().cpu().double().numpy(), want, tol)
        out.append(_record(case, n, status, errs, tol, f"rank {rank}: {reason}" if reason else ""))
        _log(folder, rank, out[-1])
    return out


def _log(folder: str, rank: int, record: dict[str, Any]) -> None:
    if folder:
        with open(os.path.join(folder, f"rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")


_ORDER = {"pass": 0, "skip": 1, "xfail": 2, "xpass": 3, "fail": 4, "error": 5}


def _merge(per_rank: list[list[dict[str, Any]]], n: int) -> list[dict[str, Any]]:
    merged = []
    for records in zip(*per_rank):
        worst = max(records, key=lambda r: _ORDER[r["status"]])
        rec = dict(worst)
        rec["max_abs_err"] = max(r["max_abs_err"] for r in records)
        rec["max_rel_err"] = max(r["max_rel_err"] for r in records)
        reasons = [r["reason"] for r in records if r["reason"] and r["status"] == worst["status"]]
        rec["reason"] = "; ".join(dict.fromkeys(reasons))[:2000]
        merged.append(rec)
    return merged


def _backend_for(device: str) -> tuple[str, str, Optional[str]]:
    """(engine, device kind, reason it cannot run here or None)."""
    import torch

    kind = device.split(":")[0]
    if kind == "cpu":
        return "gloo", "cpu", None
    if kind in ("cuda", "rocm"):
        if not torch.cuda.is_available():
            return "nccl", "cuda", f"no {kind} device is available to torch here"
        return "nccl", "cuda", None
    return "", kind, f"hal.dist conformance runs on cpu, cuda or rocm, not {device!r}"


def run(world_size: int, device: str = "cpu", seed: int = 0, quick: bool = False) -> list[dict[str, Any]]:
    """Spawn ``world_size`` local ranks on ``device`` and return one merged record per case."""
    import torch

    from hal.dist.launch import launch

    engine, kind, problem = _backend_for(device)
    if problem is None and kind == "cuda" and torch.cuda.device_count() < world_size:
        problem = f"--world-size {world_size} needs {world_size} GPUs, one per rank; torch sees {torch.cuda.device_count()}"
    all_cases = cases(world_size, quick)
    if problem is not None:
        return [_record(c, world_size, "skip", reason=problem) for c in all_cases]
    env = {"LOCAL_WORLD_SIZE": str(world_size // 2)} if world_size >= 4 and world_size % 2 == 0 else {}
    with tempfile.TemporaryDirectory(prefix="hal-collectives-") as folder:
        results = launch(
            "hal.conformance.collectives:rank_cases",
            world_size,
            (seed, quick, kind, folder),
            backend=engine,
            timeout_s=600.0 if not quick else 240.0,
            env=env,
        )
        if all(r.ok for r in results):
            return _merge([r.value for r in results], world_size)
        return _partial(all_cases, results, folder, world_size)


def _partial(all_cases: list[Case], results: list[Any], folder: str, n: int) -> list[dict[str, Any]]:
    """Records after a rank died: the cases every rank finished, then errors naming the case it died in."""
    logged = []
    for r in results:
        path = os.path.join(folder, f"rank{r.rank}.jsonl")
        lines = open(path).read().splitlines() if os.path.exists(path) else []
        logged.append([json.loads(line) for line in lines])
    done = min(len(records) for records in logged)
    merged = _merge([records[:done] for records in logged], n)
    why = "; ".join(f"rank {r.rank}: {r.message}" for r in results if not r.ok)[:1500]
    crashed = all_cases[done].id if done < len(all_cases) else "?"
    for case in all_cases[done:]:
        merged.append(_record(case, n, "error", reason=f"not finished: a rank ended during case {crashed} ({why})"))
    return merged
