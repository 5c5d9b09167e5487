"""Which kernels a graphed step runs, and how long each takes on the device: a model of
``hal bench --models`` built with hal, its step run eagerly inside ``hal.graphs.device_bound()`` (the
decisions a whole-step CUDA graph captures), then profiled. Prints hal's measurements made in the
warm-up (graph context: the winner and each route's device time), the kernels hal chose, and the
device kernels that cost most per step. For finding why a +graph variant is slow, not for tables.

    python benchmarks/graph_step_profile.py [hf_llama_train] [--eager] [--replay]

``--eager``: the step's eager decisions (no device_bound); ``--replay``: profile a replay of the step
captured by ``hal.graphs.graphed`` (as the bench's +graph variants run it) instead of the eager run.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import hal
from hal.dispatch import measure
from hal_bench.models import all_workloads


def main() -> None:
    name = next((a for a in sys.argv[1:] if not a.startswith("--")), "hf_llama_train")
    bound = "--eager" not in sys.argv
    workload = {w.name: w for w in all_workloads("full")}[name]
    step = workload.make("hal", None, torch.device("cuda"), 0)
    if "--replay" in sys.argv:
        step = hal.graphs.graphed(step)
        bound = False  # graphed() makes its warm-up and capture device-bound itself
    scope = hal.graphs.device_bound if bound else contextlib.nullcontext
    first = len(measure.LOG)
    with scope():
        for _ in range(5):  # decisions and measurements, autotuning (and a graphed step's capture)
            step()
        torch.cuda.synchronize()
        print(f"== {name} ({'device_bound' if bound else 'eager'}): measurements in the warm-up")
        for m in measure.LOG[first:]:
            times = ", ".join(f"{label} {t:.0f}" for label, t in m.times_us)
            print(f"  {m.key[:110]} -> {m.winner}  [{times}] us")
        hal.reset_stats()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
    if hasattr(step, "explain"):
        print(step.explain())
    print("== hal calls of one step")
    for (op, backend, kernel), c in sorted(hal.stats().items()):
        print(f"  {op:38s} {backend}/{kernel}: {c['calls']}")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=90))


if __name__ == "__main__":
    main()
