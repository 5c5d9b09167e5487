"""Launch-configuration sweeps of the memory-bound Triton kernels on a GPU, at the sizes of issue 5.

Prints one line per (kernel, config): median time and fraction of the measured copy bandwidth,
so the tables in backends/cuda/hal_backend_cuda/launch.py (CudaTables) can be set from measurements
(see backends/cuda/PERF_NOTES.md). Writes the numbers as JSON to the path given as argv[1].
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from hal_bench.timing import Timer
from hal_triton import batchnorm, elementwise, norm, softmax
from hal_triton.config import BNConfig


def main(out_path: str) -> None:
    dev = torch.device("cuda")
    timer = Timer(dev, budget_s=0.2)
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    bw = 2 * src.numel() / (timer(lambda: dst.copy_(src))["median_us"] * 1e-6)
    del src, dst
    rows = []

    def record(kernel: str, cfg: str, us: float, nbytes: float) -> None:
        frac = nbytes / (us * 1e-6) / bw
        rows.append({"kernel": kernel, "config": cfg, "us": us, "bw_fraction": frac})
        print(f"{kernel:<28} {cfg:<44} {us:9.1f} us  {100 * frac:5.1f}% of copy BW", flush=True)

    x = torch.randn(32768, 4096, device=dev, dtype=torch.bfloat16)
    g = torch.randn_like(x)
    w, b = torch.randn(4096, device=dev, dtype=torch.bfloat16), torch.randn(4096, device=dev, dtype=torch.bfloat16)
    big = x.numel() * 2
    for warps in (8,) if "--quick-norms" in sys.argv else (4, 8, 16):
        for bm in (1, 2):
            cfg = dict(block_m=bm, block_n=4096, num_warps=warps)
            record("layer_norm fwd", str(cfg), timer(lambda: norm.norm_forward(x, 4096, w, b, 1e-5, False, **cfg))["median_us"], 2 * big)
            record("layer_norm bwd", str(cfg), timer(lambda: norm.norm_backward(g, x, 4096, w, 1e-5, False, programs=528, **cfg))["median_us"], 3 * big)
            record("softmax fwd", str(cfg), timer(lambda: softmax.softmax(x, 1, block_i=128, **cfg))["median_us"], 2 * big)
            record("softmax bwd", str(cfg), timer(lambda: softmax.softmax_backward(g, x, 1, block_i=128, **cfg))["median_us"], 3 * big)
    for programs in (264, 1056):
        cfg = dict(block_m=1, block_n=4096, num_warps=8)
        record("layer_norm bwd", f"programs={programs}", timer(lambda: norm.norm_backward(g, x, 4096, w, 1e-5, False, programs=programs, **cfg))["median_us"], 3 * big)
    record("torch layer_norm fwd", "F.layer_norm", timer(lambda: F.layer_norm(x, (4096,), w, b))["median_us"], 2 * big)
    record("torch softmax fwd", "torch.softmax", timer(lambda: torch.softmax(x, -1))["median_us"], 2 * big)
    for elems, warps in ((1024, 4), (2048, 4), (4096, 8), (8192, 8), (8192, 16)):
        record("bias+gelu", f"block_elems={elems} warps={warps}", timer(lambda: elementwise.affine_act(x, 1.0, b, "gelu", block_elems=elems, num_warps=warps))["median_us"], 2 * big)
        record("scalar relu", f"block_elems={elems} warps={warps}", timer(lambda: elementwise.affine_act(x, 0.5, 0.25, "relu", block_elems=elems, num_warps=warps))["median_us"], 2 * big)
    # the same bias pass with an activation that costs no arithmetic: what GELU's erf adds
    record("bias+relu", "block_elems=2048 warps=4", timer(lambda: elementwise.affine_act(x, 1.0, b, "relu", block_elems=2048, num_warps=4))["median_us"], 2 * big)
    record("bias+gelu_tanh", "block_elems=2048 warps=4", timer(lambda: elementwise.affine_act(x, 1.0, b, "gelu_tanh", block_elems=2048, num_warps=4))["median_us"], 2 * big)
    del x, g
    y = torch.randn(64, 64, 56, 56, device=dev, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    gw, gb = torch.rand(64, device=dev) + 0.5, torch.randn(64, device=dev)
    rm, rv = torch.zeros(64, device=dev), torch.ones(64, device=dev)
    act = y.numel() * 2
    sweep = (
        BNConfig(64, 32, 4, 528, reduce_block_s=128, reduce_warps=8),  # launch.batch_norm's choice
        BNConfig(64, 32, 4, 264, reduce_block_s=128, reduce_warps=8),
        BNConfig(64, 32, 4, 132, reduce_block_s=128, reduce_warps=8),
        BNConfig(64, 32, 4, 264, reduce_block_s=64, reduce_warps=4),
        BNConfig(64, 32, 4, 528, reduce_block_s=64, reduce_warps=4),
        BNConfig(64, 64, 8, 1056, reduce_block_s=64, reduce_warps=4),
    )
    for cfg in sweep:
        record("bn train fwd+relu (NHWC)", str(cfg)[8:], timer(lambda: batchnorm.batch_norm_forward(y, gw, gb, rm, rv, True, 0.1, 1e-5, True, cfg))["median_us"], 3 * act)
        gy = torch.randn_like(y)
        record("bn train bwd+relu (NHWC)", str(cfg)[8:], timer(lambda: batchnorm.batch_norm_backward(gy, y, gw, gb, rm, rv, True, 1e-5, True, cfg, (torch.float32, torch.float32)))["median_us"], 5 * act)
    record("torch bn train + relu", "F.batch_norm, relu_", timer(lambda: F.relu_(F.batch_norm(y, rm, rv, gw, gb, True)))["median_us"], 3 * act)
    kernel_times("bn train fwd + bwd, launch.batch_norm's config", lambda: (
        batchnorm.batch_norm_forward(y, gw, gb, rm, rv, True, 0.1, 1e-5, True, sweep[0]),
        batchnorm.batch_norm_backward(gy, y, gw, gb, rm, rv, True, 1e-5, True, sweep[0], (torch.float32, torch.float32))))
    del y, gy
    torch.cuda.empty_cache()
    if "--gemm" in sys.argv:
        gemm_probe(timer, record)
    with open(out_path, "w") as f:
        json.dump({"copy_bytes_per_s": bw, "rows": rows}, f, indent=1)


def kernel_times(title: str, fn, reps: int = 20) -> None:
    """Device time of each kernel ``fn`` launches (torch.profiler), averaged over ``reps`` calls."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    print(f"== {title}: device time per kernel", flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12), flush=True)


def gemm_probe(timer: Timer, record) -> None:
    """linear at the issue's first shape through each kernel (the Triton GEMM autotunes first)."""
    from hal_backend_cuda import plugin

    kernels = {k.name: k.fn for k in plugin.kernels if k.op == "linear"}

    m, k, n = 8192, 4096, 4096
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    flops = 2.0 * m * n * k
    for act in ("gelu_tanh", "gelu", "none"):
        for name, fn in kernels.items():
            if name == "cublaslt" and act == "gelu":
                continue
            us = timer(lambda: fn(x, w, b, act))["median_us"]
            print(f"linear {act:<10} {name:<14} {us:9.1f} us  {flops / us / 1e6:6.0f} TFLOP/s", flush=True)
            record(f"linear {act}", name, us, 0.0)


if __name__ == "__main__":
    main(sys.argv[1])
