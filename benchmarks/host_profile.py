"""Where the host time of a hal call goes, on a GPU: small inputs (so the device is never the
bottleneck), host time per call for each layer of a call, then a cProfile of the hal calls.

    python benchmarks/host_profile.py [OUT.txt]

Layers timed per op: the torch op a user would call instead, the plugin's kernel called directly
(no dispatcher), and ``hal.ops`` (dispatcher + kernel). The differences say what the dispatcher
and the kernel wrapper cost; the profile says which functions.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F

import hal
from hal_bench.timing import host_overhead_us


def main(out_path: str | None) -> None:
    dev = torch.device("cuda")
    lines: list[str] = []

    def row(name: str, fn: Callable[[], Any]) -> None:
        fn()
        torch.cuda.synchronize()
        us = host_overhead_us(fn, calls=1000)
        torch.cuda.synchronize()
        lines.append(f"{name:<58} {us:8.2f} us/call")
        print(lines[-1], flush=True)

    x = torch.randn(64, 64, device=dev, dtype=torch.bfloat16)
    b = torch.randn(64, device=dev, dtype=torch.bfloat16)
    row("torch: x * 0.5 + 0.25 then relu (2 ops)", lambda: torch.relu(x * 0.5 + 0.25))
    row("torch: torch.relu(x) (1 op)", lambda: torch.relu(x))
    row("torch: torch.empty_like(x)", lambda: torch.empty_like(x))
    from hal_triton import elementwise

    row("triton direct: elementwise.affine_act(x, 0.5, 0.25, relu)", lambda: elementwise.affine_act(x, 0.5, 0.25, "relu", block_elems=1024, num_warps=4))
    row("hal.ops.scale_shift_act(x, 0.5, 0.25, relu)", lambda: hal.ops.scale_shift_act(x, 0.5, 0.25, "relu"))
    row("hal.ops.scale_shift_act(x, 1.0, bias, gelu)", lambda: hal.ops.scale_shift_act(x, 1.0, b, "gelu"))
    w = torch.ones(64, device=dev, dtype=torch.bfloat16)
    row("torch: F.layer_norm", lambda: F.layer_norm(x, (64,), w, b))
    row("hal.ops.layer_norm", lambda: hal.ops.layer_norm(x, (64,), w, b))

    xc = torch.randn(2, 16, 8, 8, device=dev, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    cw = torch.randn(16, 16, 3, 3, device=dev, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    cb = torch.randn(16, device=dev, dtype=torch.float16)
    gamma, beta = torch.rand(16, device=dev, dtype=torch.float16) + 0.5, torch.randn(16, device=dev, dtype=torch.float16)
    rm, rv = torch.randn(16, device=dev, dtype=torch.float16), torch.rand(16, device=dev, dtype=torch.float16) + 0.5
    from hal_backend_cuda import conv

    fw, fb = conv.fold(xc.dtype, True, cw, cb, gamma, beta, rm, rv, 1e-5)
    row("torch: cudnn_convolution_relu, folded beforehand", lambda: torch.cudnn_convolution_relu(xc, fw, fb, (1, 1), (1, 1), (1, 1), 1))
    row("torch: eager conv2d -> batch_norm -> relu", lambda: F.relu(F.batch_norm(F.conv2d(xc, cw, cb, 1, 1), rm, rv, gamma, beta, False)))
    row("cuda plugin: FOLDED.get (fold-cache lookup)", lambda: conv.FOLDED.get(xc, cw, cb, gamma, beta, rm, rv, 1e-5))
    args = (xc, cw, cb, gamma, beta, rm, rv, (1, 1), (1, 1), (1, 1), 1, 1e-5, 0.1, False)
    row("hal.ops.fused_conv_bn_relu (eval)", lambda: hal.ops.fused_conv_bn_relu(*args))

    for name, fn in (
        ("hal.ops.scale_shift_act(x, 0.5, 0.25, relu)", lambda: hal.ops.scale_shift_act(x, 0.5, 0.25, "relu")),
        ("hal.ops.fused_conv_bn_relu (eval)", lambda: hal.ops.fused_conv_bn_relu(*args)),
    ):
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(2000):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
        lines += ["", f"== cProfile of 2000 x {name} (sorted by own time)", s.getvalue()]
        print("\n".join(lines[-2:]), flush=True)
    if out_path:
        with open(out_path, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
