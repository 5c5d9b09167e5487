"""Where a whole-model step spends its time: torch.profiler over a few steps of each workload of
``hal bench --models`` (the GPU sizes), for eager PyTorch and for hal, printing per variant the host
time of a step, the device time, the CUDA kernels and host operators that cost most, and the counts
of copies and host-to-device transfers per step. For finding what to fix, not for the results table.

    python benchmarks/profile_steps.py OUT_DIR [resnet50_train,llama_train,...] [--compile]

With ``--compile`` both variants run under torch.compile (default mode), as the table's compile and
hal+compile columns do.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

import torch
from torch.profiler import ProfilerActivity, profile

from hal_bench.models_llama import LlamaPrefill, LlamaTrain
from hal_bench.models_moe import MoEForwardBackward
from hal_bench.models_resnet import ResNetInference, ResNetTrain

WORKLOADS = {
    "llama_prefill": lambda: LlamaPrefill("full"),
    "resnet50_train": lambda: ResNetTrain("full"),
    "resnet50_infer_fp16": lambda: ResNetInference("full"),
    "llama_train": lambda: LlamaTrain("full"),
    "moe_fwd_bwd": lambda: MoEForwardBackward("full"),
}
STEPS = 3


def profile_variant(name: str, impl: str, out: Path, compile_mode: Optional[str] = None) -> None:
    workload = WORKLOADS[name]()
    step = workload.make(impl, compile_mode, torch.device("cuda"), 0)
    for _ in range(3):  # compile, tune, allocate
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        step()
    host = (time.perf_counter() - t0) / STEPS
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / STEPS
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    copies = sum(e.count for e in events if e.key == "aten::copy_") / STEPS
    h2d = sum(e.count for e in events if "HtoD" in e.key or e.key == "Memcpy HtoD (Pageable -> Device)") / STEPS
    device_us = sum(e.self_device_time_total for e in events
                    if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation) / STEPS  # kernels only
    print(f"== {name} [{impl}{'+compile' if compile_mode else ''}]: host {host * 1e3:.1f} ms/step (issue), wall {wall * 1e3:.1f} ms/step, device {device_us / 1e3:.1f} ms/step, "
          f"aten::copy_ {copies:.0f}/step, HtoD {h2d:.0f}/step", flush=True)
    table_dev = events.table(sort_by="self_cuda_time_total", row_limit=18)
    table_cpu = events.table(sort_by="self_cpu_time_total", row_limit=18)
    extra = census(step) + host_profile(step) if impl == "hal" else ""
    (out / f"{name}-{impl}{'-compile' if compile_mode else ''}.txt").write_text(f"{table_dev}\n\n{table_cpu}\n{extra}")
    print(table_dev[:6000], extra[:8000], sep="\n", flush=True)


def census(step) -> str:
    """Which kernel every hal call of one step ran (hal.stats: op, backend, kernel -> calls)."""
    import hal

    hal.reset_stats()
    step()
    torch.cuda.synchronize()
    rows = sorted(hal.stats().items(), key=lambda kv: -sum(v for v in kv[1].values() if isinstance(v, int)))
    lines = ["-- hal calls of one step (op, backend, kernel: counts)"]
    lines += [f"{op:<36} {backend:<8} {kernel:<22} {counts}" for (op, backend, kernel), counts in rows]
    return "\n".join(lines) + "\n"


def host_profile(step) -> str:
    """cProfile of the host side of STEPS steps: the Python functions that cost the most."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(STEPS):
        step()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(30)
    return f"-- cProfile of {STEPS} steps\n{buf.getvalue()}"


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--compile"]
    compile_mode = "default" if "--compile" in sys.argv else None
    out = Path(args[0])
    out.mkdir(parents=True, exist_ok=True)
    names = args[1].split(",") if len(args) > 1 else list(WORKLOADS)
    for name in names:
        for impl in ("torch", "hal"):
            try:
                profile_variant(name, impl, out, compile_mode)
            except Exception as exc:  # one workload failing must not hide the others
                print(f"== {name} [{impl}]: {type(exc).__name__}: {exc}", flush=True)


if __name__ == "__main__":
    main()
