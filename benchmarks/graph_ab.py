"""(dev) One model's step under the kernel forcing of the environment (HAL_KERNEL_*), graphed by
default: step time, peak memory, the loss after a few steps, the kernels that ran (hal.stats), and
with ``--profile`` the CUDA kernels of three steps by device time (torch.profiler).

    HAL_KERNEL_BATCH_NORM=cpp python benchmarks/graph_ab.py resnet50_train [--impl hal] [--eager] [--profile]
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.profiler import ProfilerActivity, profile

import hal
from hal_bench import models
from hal_bench.timing import Timer

parser = argparse.ArgumentParser()
parser.add_argument("model")
parser.add_argument("--impl", default="hal", help="the workload's implementation (hal, torch, hal_bf16_weights, ...)")
parser.add_argument("--eager", action="store_true", help="not graphed")
parser.add_argument("--profile", action="store_true")
opts = parser.parse_args()

workload = next(w for w in models.all_workloads("full") if w.name == opts.model)
dev = torch.device("cuda")
torch.cuda.reset_peak_memory_stats(dev)
step = workload.make(opts.impl, None, dev, 0)
if not opts.eager:
    step = models.with_graphs(step)
losses = [float(step().float().sum()) for _ in range(8)]  # a training loss, or an inference output summed
timing = Timer(dev)(step, warmup=0)
forced = " ".join(f"{k.removeprefix('HAL_KERNEL_')}={v}" for k, v in sorted(os.environ.items()) if k.startswith("HAL_KERNEL_")) or "defaults"
print(f"RESULT {opts.model} {opts.impl}{'' if opts.eager else '+graph'} [{forced}]: step {timing['median_us'] / 1e3:.2f} ms, "
      f"peak {torch.cuda.max_memory_allocated(dev) / 2**30:.2f} GiB, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
ran = {k: v for k, v in hal.stats().items() if v["calls"]}
print("  kernels:", "; ".join(f"{op}:{kernel}{' (' + str(c['fallbacks']) + ' fallbacks)' if c['fallbacks'] else ''}" for (op, _, kernel), c in sorted(ran.items())))
if opts.profile:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    rows = [(e.self_device_time_total / 3, e.count // 3, e.key) for e in prof.key_averages() if e.self_device_time_total > 0]
    total = sum(r[0] for r in rows)
    print(f"  device time per step {total / 1e3:.2f} ms; kernels by device time (us per step, launches per step):")
    for us, n, key in sorted(rows, reverse=True)[:22]:
        print(f"    {us:8.0f}  {n:4d}  {key[:110]}")
