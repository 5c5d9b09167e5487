"""``hal bench --collectives``: an nccl-tests-style table of every algorithm against raw torch.distributed.

For each collective and message size (8 B to 256 MiB by default, doubling), every peer runs on the
same buffers in the same process group: ``torch`` (the raw ``torch.distributed`` call), hal's
``native``, and for all_reduce every other algorithm that can run (``hierarchical`` needs a
topology of 2+ nodes). As in nccl-tests, a timed batch is many back-to-back calls (GPU launches
overlap the host's work) divided by their number; the peers take turns, one batch each, so drift
and noise hit them alike. Time is the median over batches of the slowest rank;
``algbw = size / time``; ``busbw = algbw x factor`` with the
nccl-tests factors: all_reduce ``2(n-1)/n``, all_gather, reduce_scatter and all_to_all ``(n-1)/n``.
``size`` is the largest buffer of a rank: the gathered output of all_gather, the input of
reduce_scatter. ``vs torch`` is torch's time over the peer's (above 1: faster than torch). The
raw calls of the collectives that return a new tensor allocate it per call, as hal does.

    python -m hal.dist.bench --world-size 4 --max-bytes 64M
    hal bench --collectives --world-size 4          (the bench CLI calls run_collectives_bench)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable, Optional, Sequence

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def busbw_factor(collective: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor of a collective on ``n`` ranks."""
    return 2 * (n - 1) / n if collective == "all_reduce" else (n - 1) / n


def parse_bytes(text: str) -> int:
    """'8', '64K', '256M', '1G' -> bytes."""
    text = text.strip().upper().removesuffix("B")
    unit = text[-1] if text and text[-1] in _UNITS else ""
    try:
        return int(float(text[: len(text) - len(unit)]) * _UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 8, 64K, 256M)") from None


def sizes(low: int, high: int, factor: float) -> list[int]:
    out, s = [], low
    while s <= high:
        out.append(int(s))
        s = s * factor
    if out[-1] != high:
        out.append(high)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the collectives bench (``hal bench --collectives`` adds them too)."""
    parser.add_argument("--world-size", type=int, default=4, help="ranks to start (default 4)")
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL/RCCL, one rank per GPU)")
    parser.add_argument("--min-bytes", type=parse_bytes, default=8, help="smallest message (default 8)")
    parser.add_argument("--max-bytes", type=parse_bytes, default=256 << 20, help="largest message (default 256M)")
    parser.add_argument("--step-factor", type=float, default=2.0, help="size multiplier between rows (default 2)")
    parser.add_argument("--collective-ops", default=",".join(COLLECTIVES), help="comma-separated collectives")
    parser.add_argument("--algorithms", default="", help="all_reduce algorithms to run (default: all that can)")
    parser.add_argument("--dtype", default="float32", help="element type (default float32)")
    parser.add_argument("--iters", type=int, default=0, help="calls per timed batch (default: about 50 ms of calls)")
    parser.add_argument("--batches", type=int, default=5, help="timed batches per size and peer (default 5)")
    parser.add_argument("--ranks-per-node", type=int, default=0, help="declare a topology (hierarchical runs with 2+ nodes)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank on the CPU (default 1)")


def problems(args: argparse.Namespace) -> list[str]:
    """What is wrong with the options of :func:`add_arguments`, each saying what to give instead (empty:
    nothing), checked before any rank starts: a size range that never ends (``--step-factor 1``,
    ``--min-bytes 0``), a count below one, or an unknown collective, algorithm, device or dtype would
    otherwise hang, end in a traceback from a rank, or run nothing. ``hal bench --collectives``
    (:mod:`hal.cli.bench_collectives`) and :func:`main` report them."""
    import torch

    from hal.dist import algorithms
    from hal.errors import unknown_names

    out = [f"--{name.replace('_', '-')} {getattr(args, name)}: give {low} or more"
           for name, low in (("world_size", 1), ("min_bytes", 1), ("batches", 1), ("threads", 1), ("iters", 0), ("ranks_per_node", 0))
           if getattr(args, name) < low]
    if args.max_bytes < args.min_bytes:
        out.append(f"--max-bytes {args.max_bytes}: give at least --min-bytes ({args.min_bytes})")
    if not args.step_factor > 1:  # NaN too: the sizes would never grow
        out.append(f"--step-factor {args.step_factor}: give a factor above 1")
    if args.device not in ("cpu", "cuda"):
        out.append(f"--device {args.device}: give cpu (gloo) or cuda (NCCL/RCCL)")
    if not isinstance(getattr(torch, args.dtype, None), torch.dtype):
        out.append(f"--dtype {args.dtype}: give a torch dtype name such as float32 or bfloat16")
    collectives = [c.strip() for c in args.collective_ops.split(",") if c.strip()]
    for option, given, known in (("--collective-ops", collectives, COLLECTIVES),
                                 ("--algorithms", [a.strip() for a in args.algorithms.split(",") if a.strip()], algorithms("all_reduce"))):
        problem = unknown_names(option.removeprefix("--").rstrip("s").replace("-", " "), given, known)
        if problem:
            out.append(f"{option}: {problem}")
    if not collectives:
        out.append(f"--collective-ops {args.collective_ops!r} names nothing: give one or more of {', '.join(COLLECTIVES)}")
    return out


def _config(args: argparse.Namespace) -> dict[str, Any]:
    def get(name: str, default: Any) -> Any:
        value = getattr(args, name, None)
        return default if value in (None, "") else value

    collectives = [c.strip() for c in str(get("collective_ops", ",".join(COLLECTIVES))).split(",") if c.strip()]
    unknown = sorted(set(collectives) - set(COLLECTIVES))
    if unknown:
        raise SystemExit(f"hal bench --collectives: unknown collective(s) {', '.join(unknown)}; choose from {', '.join(COLLECTIVES)}")
    return {
        "world_size": int(get("world_size", 4)),
        "device": str(get("device", "cpu")),
        "sizes": sizes(int(get("min_bytes", 8)), int(get("max_bytes", 256 << 20)), float(get("step_factor", 2.0))),
        "collectives": collectives,
        "algorithms": [a.strip() for a in str(get("algorithms", "")).split(",") if a.strip()],
        "dtype": str(get("dtype", "float32")),
        "iters": int(get("iters", 0)),
        "batches": int(get("batches", 5)),
        "ranks_per_node": int(get("ranks_per_node", 0)),
        "threads": int(get("threads", 1)),
    }


# --- inside each rank --------------------------------------------------------------------------------


def _peers(collective: str, cfg: dict[str, Any], sample: Any) -> list[tuple[str, Callable[[Any], Any]]]:
    """(name, run(buffers)) for raw torch and every hal algorithm that can run ``sample``."""
    import torch
    import torch.distributed as dist

    import hal
    import hal.dist as hd
    from hal.dist import engine

    if collective == "all_reduce":
        peers: list[tuple[str, Callable[[Any], Any]]] = [("torch", lambda b: dist.all_reduce(b["x"]))]
        wanted = cfg["algorithms"] or hd.algorithms("all_reduce")
        for alg in wanted:
            decision = hal.explain("all_reduce", sample, algorithm=alg)
            if decision.error is None:
                peers.append((alg, lambda b, alg=alg: hd.all_reduce(b["x"], algorithm=alg)))
        return peers
    # the raw calls allocate their output as hal's do (hal returns a new tensor): the same work
    if collective == "all_gather":
        raw = lambda b: engine.all_gather_into(torch.empty_like(b["out"]), b["x"], None).wait()  # noqa: E731
        return [("torch", raw), ("native", lambda b: hd.all_gather(b["x"]))]
    if collective == "reduce_scatter":
        raw = lambda b: engine.reduce_scatter_into(torch.empty_like(b["out"]), b["x"], dist.ReduceOp.SUM, None).wait()  # noqa: E731
        return [("torch", raw), ("native", lambda b: hd.reduce_scatter(b["x"]))]
    raw = lambda b: dist.all_to_all_single(torch.empty_like(b["out"]), b["x"])  # noqa: E731
    return [("torch", raw), ("native", lambda b: hd.all_to_all(b["x"]))]


def _buffers(collective: str, nbytes: int, n: int, dtype: Any, device: str) -> dict[str, Any]:
    """Input and output buffers of one size; ``size`` is the largest buffer of a rank."""
    import torch

    itemsize = torch.empty((), dtype=dtype).element_size()
    count = max(n, (nbytes // itemsize) // n * n)
    gen = torch.Generator().manual_seed(count)
    if collective == "all_gather":
        x = torch.randn(count // n, generator=gen).to(dtype).to(device)
        return {"x": x, "out": torch.empty(count, dtype=dtype, device=device), "count": count}
    x = torch.randn(count, generator=gen).to(dtype).to(device)
    out = torch.empty(count // n if collective == "reduce_scatter" else count, dtype=dtype, device=device)
    return {"x": x, "src": x.clone(), "out": out, "count": count}


def _agreed_max(values: list[float], device: str) -> list[float]:
    """Element-wise maximum over the ranks (every rank gets the same list)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def bench_rank(rank: int, n: int, cfg: dict[str, Any]) -> Optional[list[dict[str, Any]]]:
    """Run the whole table on one rank; rank 0 returns the rows."""
    import torch
    import torch.distributed as dist

    import hal.dist as hd

    if cfg["ranks_per_node"]:
        hd.set_topology(ranks_per_node=cfg["ranks_per_node"])
    device = f"cuda:{torch.cuda.current_device()}" if cfg["device"] != "cpu" else "cpu"
    dtype = getattr(torch, cfg["dtype"])
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    rows = []
    for collective in cfg["collectives"]:
        for nbytes in cfg["sizes"]:
            bufs = _buffers(collective, nbytes, n, dtype, device)
            peers = _peers(collective, cfg, bufs["x"])
            times: dict[str, list[float]] = {name: [] for name, _ in peers}

            def batch(run: Callable[[Any], Any], iters: int) -> float:
                """Seconds per call of ``iters`` back-to-back calls (GPU launches overlap, as in nccl-tests)."""
                sync()
                dist.barrier()
                sync()
                started = time.perf_counter()
                for _ in range(iters):
                    run(bufs)
                sync()
                return (time.perf_counter() - started) / iters

            warm = _agreed_max([batch(run, 1) for _, run in peers], device)  # also the first-call setup
            iters = cfg["iters"] or max(1, min(50, int(0.05 / max(max(warm), 1e-7))))
            for _ in range(cfg["batches"]):
                for name, run in peers:  # one batch of each peer in turn: noise and drift hit all alike
                    times[name].append(batch(run, iters))
            slowest = {name: _agreed_max(ts, device) for name, ts in times.items()}
            size = bufs["count"] * bufs["x"].element_size()
            base = statistics.median(slowest["torch"])
            for name, ts in slowest.items():
                t = statistics.median(ts)
                algbw = size / t / 1e9
                rows.append({
                    "collective": collective, "algorithm": name, "bytes": size, "count": bufs["count"],
                    "time_us": t * 1e6, "algbw_GBps": algbw, "busbw_GBps": algbw * busbw_factor(collective, n),
                    "vs_torch": base / t, "iters": iters, "batches": len(ts), "min_us": min(ts) * 1e6,
                })
            del bufs
    return rows if rank == 0 else None


# --- the table ------------------------------------------------------------------------------------------


def format_table(rows: list[dict[str, Any]], cfg: dict[str, Any], engine: str) -> str:
    n = cfg["world_size"]
    lines = [
        f"# hal.dist collectives bench: {n} ranks on {engine} ({cfg['device']}), {cfg['dtype']}; "
        "time per call = median over batches of back-to-back calls, slowest rank",
    ]
    for collective in cfg["collectives"]:
        lines.append("")
        lines.append(f"## {collective}   busbw = algbw x {busbw_factor(collective, n):.3f}")
        lines.append(f"{'size(B)':>12} {'count':>11}  {'algorithm':<16} {'time(us)':>11} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12} {'vs torch':>9}")
        for r in rows:
            if r["collective"] != collective:
                continue
            lines.append(
                f"{r['bytes']:>12} {r['count']:>11}  {r['algorithm']:<16} {r['time_us']:>11.1f} "
                f"{r['algbw_GBps']:>12.3f} {r['busbw_GBps']:>12.3f} {r['vs_torch']:>9.3f}"
            )
    return "\n".join(lines)


def run_collectives_bench(args: argparse.Namespace) -> int:
    """Entry point of ``hal bench --collectives`` (and ``python -m hal.dist.bench``); exit status."""
    from hal.dist.launch import launch

    import torch

    from hal.dist.groups import engine_name

    cfg = _config(args)
    backend = "gloo" if cfg["device"] == "cpu" else "nccl"
    engine = engine_name(backend, "cpu" if backend == "gloo" else "cuda", getattr(torch.version, "hip", None))  # rccl on ROCm
    if backend == "nccl":
        if torch.cuda.device_count() < cfg["world_size"]:
            print(f"hal bench --collectives: --world-size {cfg['world_size']} needs as many GPUs; torch sees "
                  f"{torch.cuda.device_count()}", file=sys.stderr)
            return 2
    results = launch(bench_rank, cfg["world_size"], (cfg,), backend=backend, timeout_s=1800, threads=cfg["threads"])
    failed = [r for r in results if not r.ok]
    if failed:
        for r in failed:
            print(f"rank {r.rank}: {r.message}\n{r.traceback}", file=sys.stderr)
        return 1
    rows = results[0].value
    if getattr(args, "json", False):
        print(json.dumps({"world_size": cfg["world_size"], "engine": engine, "dtype": cfg["dtype"], "rows": rows}, indent=1))
    else:
        print(format_table(rows, cfg, engine))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m hal.dist.bench``: the options checked as ``hal bench --collectives`` checks them
    (:func:`problems`: a bad one is one line on stderr and exit status 2, before any rank starts),
    then the bench."""
    parser = argparse.ArgumentParser(prog="python -m hal.dist.bench", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    found = problems(args)
    if found:
        print(f"{parser.prog}: {'; '.join(found)}", file=sys.stderr)
        return 2  # hal.cli.usage.EXIT_USAGE, as the command line's own checks exit
    return run_collectives_bench(args)


if __name__ == "__main__":
    sys.exit(main())
