"""The two performance targets of hal.dist, measured: wrapper overhead and compression speed-up.

    python benchmarks/collectives.py --world-size 4 --bytes 64M --runs 3
    python benchmarks/collectives.py --device cuda --world-size 2

For one message size, each run starts a fresh process group and times ``all_reduce`` of raw
torch.distributed, hal ``native`` and every other algorithm that can run, one timed batch of each in
turn (hal.dist.bench does the timing). It prints, per run and as the median over runs:

* ``torch/native``: raw torch's time over hal ``native``'s (target >= 0.97: hal's wrapper within 3%);
* ``compressed_fp16 speed-up``: fp32 ``native`` time over ``compressed_fp16`` time (target >= 1.6 on gloo).

Times are the median over batches of back-to-back calls, slowest rank (see hal.dist.bench). On a
small shared CPU machine the runs scatter by tens of percent: read the spread, not only the median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from hal.dist import bench
from hal.dist.launch import launch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bytes", type=bench.parse_bytes, default=64 << 20)
    parser.add_argument("--iters", type=int, default=3, help="calls per timed batch")
    parser.add_argument("--batches", type=int, default=7, help="timed batches per peer and run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per CPU rank")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    cfg = {
        "world_size": args.world_size, "device": args.device, "sizes": [args.bytes], "collectives": ["all_reduce"],
        "algorithms": [], "dtype": "float32", "iters": args.iters, "batches": args.batches, "ranks_per_node": 0,
        "threads": args.threads,
    }
    engine = "gloo" if args.device == "cpu" else "nccl"
    runs = []
    for i in range(args.runs):
        results = launch(bench.bench_rank, args.world_size, (cfg,), backend=engine, timeout_s=1800, threads=args.threads)
        if not all(r.ok for r in results):
            print("\n".join(f"rank {r.rank}: {r.message}\n{r.traceback}" for r in results if not r.ok), file=sys.stderr)
            return 1
        times = {row["algorithm"]: row["time_us"] for row in results[0].value}
        run = {
            "times_ms": {k: round(v / 1e3, 2) for k, v in times.items()},
            "native_over_torch": times["torch"] / times["native"],
            "fp16_speedup": times["native"] / times["compressed_fp16"],
            "bf16_speedup": times["native"] / times["compressed_bf16"],
        }
        runs.append(run)
        print(f"run {i + 1}: " + "  ".join(f"{k} {v} ms" for k, v in run["times_ms"].items())
              + f"  | torch/native {run['native_over_torch']:.3f}  native/fp16 {run['fp16_speedup']:.2f}"
              + f"  native/bf16 {run['bf16_speedup']:.2f}", flush=True)
    summary = {k: statistics.median(r[k] for r in runs) for k in ("native_over_torch", "fp16_speedup", "bf16_speedup")}
    print(f"median of {args.runs} runs, {args.world_size} ranks on {engine}, {args.bytes} bytes: "
          f"native time / torch time {1 / summary['native_over_torch']:.3f}, "
          f"compressed_fp16 {summary['fp16_speedup']:.2f}x, compressed_bf16 {summary['bf16_speedup']:.2f}x vs fp32 native")
    if args.json:
        print(json.dumps({"runs": runs, "median": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
