"""(dev) One model's graphed hal step under the kernel forcing of the environment (HAL_KERNEL_*):
step time, peak memory, loss after the trajectory, and the kernels that ran (hal.stats).

    HAL_KERNEL_BATCH_NORM=cpp python benchmarks/graph_ab.py resnet50_train [variant]
"""

from __future__ import annotations

import os
import sys

import torch

import hal
from hal.bench import models
from hal.bench.timing import Timer
from hal.bench.workload import HAL_GRAPH, Variant

name = sys.argv[1]
variant = HAL_GRAPH if len(sys.argv) < 3 else Variant(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "hal", graph="graph" in sys.argv[2])
workload = next(w for w in models.all_workloads("full") if w.name == name)
dev = torch.device("cuda")
rec = models.measure_variant(workload, variant, dev, Timer(dev), 0, None, steps=8)
forced = " ".join(f"{k.removeprefix('HAL_KERNEL_')}={v}" for k, v in sorted(os.environ.items()) if k.startswith("HAL_KERNEL_")) or "defaults"
print(f"RESULT {name} {variant.name} [{forced}]: step {rec.get('step_us', 0) / 1e3:.2f} ms, peak {rec.get('peak_bytes', 0) / 2**30:.2f} GiB, "
      f"loss {rec.get('loss_first')} -> {rec.get('loss')} {rec.get('error', '')}")
ran = {k: v for k, v in hal.stats().items() if v["calls"]}
print("  kernels:", "; ".join(f"{op}:{kernel}{' (' + str(c['fallbacks']) + ' fallbacks)' if c['fallbacks'] else ''}" for (op, _, kernel), c in sorted(ran.items())))
