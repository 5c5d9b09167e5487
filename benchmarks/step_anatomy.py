"""Why one model step is slower than another: host and device time split, and the parts that cost most.

For a workload of ``hal bench --models`` and a few of its variants (by default the strongest peer,
``compile+graph``, against hal's ``hal+graph`` and ``hal+compile+graph``), in one process:

* **step**: the median wall time of a step with its spread (a step synchronised at its end);
* **host**: the time the host takes to issue a step (until the call returns, before the sync);
* **device**: the sum of the kernels' durations per step (profiler), and how much of the step the
  device is idle (step minus device time);
* **kernels**: the kernels that cost most per step, for each variant;
* **ops** (for the variants not replayed from a CUDA graph): the operators whose kernels cost
  most, with the flops the profiler counts and the bytes of their inputs, and the fraction of the
  H200's measured ceilings (``--tflops``/``--gbps``) these reach. A replayed graph runs the same
  kernels as its eager warm-up, so the eager ``hal`` and ``eager`` variants attribute them.

    python benchmarks/step_anatomy.py MODEL [--variants a,b,...] [--json OUT] [--steps N]

For explaining a missed target with figures, not for the results table (``hal bench --models``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile

from hal_bench.models import all_workloads, build_step
from hal_bench.timing import print_host_profile

ELEMENT_BYTES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8, "int": 4, "bool": 1,
                 "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4}


def _sync() -> None:
    torch.cuda.synchronize()


def step_times(step: Callable[[], Any], reps: int) -> tuple[list[float], list[float]]:
    """Wall and host-issue milliseconds of ``reps`` steps, each started on an idle device."""
    wall, host = [], []
    for _ in range(reps):
        _sync()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        _sync()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        wall.append((t2 - t0) * 1e3)
    return wall, host


def _input_bytes(evt: Any) -> int:
    shapes = getattr(evt, "input_shapes", None) or []
    dtypes = getattr(evt, "input_dtypes", None) or []
    total = 0
    for i, shape in enumerate(shapes):
        if not isinstance(shape, (list, tuple)) or not shape or not all(isinstance(d, int) for d in shape):
            continue
        size = ELEMENT_BYTES.get(str(dtypes[i]) if i < len(dtypes) else "", 2)
        n = 1
        for d in shape:
            n *= d
        total += n * size
    return total


def anatomy(step: Callable[[], Any], steps: int, attribute_ops: bool) -> dict[str, Any]:
    """Profile ``steps`` steps: device time, kernels by time, and (eager runs) operators by time."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=attribute_ops, with_flops=attribute_ops) as prof:
        for _ in range(steps):
            step()
        _sync()
    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA and not getattr(evt, "is_user_annotation", False):
            k = kernels[evt.name[:110]]
            k[0] += 1
            k[1] += evt.device_time if hasattr(evt, "device_time") else evt.cuda_time
    device_us = sum(v[1] for v in kernels.values()) / steps
    top_kernels = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:80]  # the JSON keeps 80 for diffs between variants
    out: dict[str, Any] = {
        "device_ms": device_us / 1e3,
        "kernels": [{"name": n, "per_step": c / steps, "ms": t / steps / 1e3} for n, (c, t) in top_kernels],
    }
    if attribute_ops:
        ops: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
        for evt in prof.events():
            if evt.device_type != torch.autograd.DeviceType.CPU:
                continue
            self_dev = getattr(evt, "self_device_time_total", None)
            if self_dev is None:
                self_dev = evt.self_cuda_time_total
            if self_dev <= 0:
                continue
            key = (evt.name, str(getattr(evt, "input_shapes", ""))[:90])
            o = ops[key]
            o[0] += 1
            o[1] += self_dev
            o[2] += getattr(evt, "flops", 0) or 0
            o[3] += _input_bytes(evt)
        rows = sorted(ops.items(), key=lambda kv: -kv[1][1])[:40]
        out["ops"] = [{"op": name, "shapes": shapes, "per_step": c / steps, "ms": t / steps / 1e3,
                       "gflop": f / steps / 1e9, "input_mb": b / steps / 1e6} for (name, shapes), (c, t, f, b) in rows]
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--variants", default="eager,compile+graph,hal,hal+graph,hal+compile+graph")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--tflops", type=float, default=0.0, help="measured bf16 GEMM ceiling, for the % column")
    ap.add_argument("--gbps", type=float, default=0.0, help="measured copy bandwidth, for the % column")
    ap.add_argument("--json")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N", help="also cProfile N steps of each variant (host time by function)")
    args = ap.parse_args()
    device = torch.device("cuda")
    workload = {w.name: w for w in all_workloads("full")}[args.model]
    wanted = args.variants.split(",")
    known = {v.name: v for v in workload.variants(True, False, graphs=True)}
    doc: dict[str, Any] = {"model": args.model, "device": torch.cuda.get_device_name(), "torch": torch.__version__, "variants": {}}
    print(f"== {args.model} on {doc['device']}, torch {torch.__version__}: {workload.describe()}", flush=True)
    for name in wanted:
        variant = known.get(name)
        if variant is None:
            print(f"-- {name}: not a variant of {args.model} ({', '.join(known)})")
            continue
        try:
            torch._dynamo.reset()
            step = build_step(workload, variant, device, 0)
            for _ in range(4):  # compile, tune, capture
                step()
            _sync()
            torch.cuda.reset_peak_memory_stats()
            wall, host = step_times(step, args.reps)
            rec = {"step_ms": statistics.median(wall), "step_spread_ms": [min(wall), max(wall)], "host_ms": statistics.median(host),
                   "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
            rec.update(anatomy(step, args.steps, attribute_ops=not variant.graph))
            rec["idle_ms"] = rec["step_ms"] - rec["device_ms"]
            if args.cprofile:
                print_host_profile(f"{args.model} {name}", step, args.cprofile, _sync)
        except Exception as exc:  # noqa: BLE001 - one variant failing is recorded, the others still run
            rec = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        doc["variants"][name] = rec
        if "error" in rec:
            print(f"-- {name}: {rec['error']}", flush=True)
            continue
        print(f"-- {name}: step {rec['step_ms']:.2f} ms [{rec['step_spread_ms'][0]:.2f}-{rec['step_spread_ms'][1]:.2f}], host issue {rec['host_ms']:.2f} ms, "
              f"device {rec['device_ms']:.2f} ms, idle {rec['idle_ms']:.2f} ms, peak {rec['peak_gib']:.2f} GiB", flush=True)
        for k in rec["kernels"][:10]:
            print(f"     {k['ms']:7.3f} ms  x{k['per_step']:<5.0f} {k['name']}")
        for o in rec.get("ops", [])[:14]:
            rate = ""
            if o["ms"] > 0:
                tf = o["gflop"] / o["ms"]  # GFLOP per ms = TFLOP/s
                gb = o["input_mb"] / o["ms"]  # MB per ms = GB/s
                rate = f"{tf:6.1f} TFLOP/s{f' ({tf / args.tflops:.0%})' if args.tflops else ''}  {gb:6.0f} GB/s in{f' ({gb / args.gbps:.0%})' if args.gbps else ''}"
            print(f"   op {o['ms']:7.3f} ms  x{o['per_step']:<4.0f} {o['gflop']:8.2f} GFLOP {o['input_mb']:8.1f} MB in  {rate}  {o['op']} {o['shapes']}")
        del step
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
