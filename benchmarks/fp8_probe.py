"""What torch 2.11 and Triton offer for FP8 on this GPU, and at what rate: the facts the FP8
kernels' design rests on (issue 31). Prints one line per probe; --json writes them.

* ``torch._scaled_mm`` at 8192^3 with per-tensor, row-wise and block-wise scales (which the build
  accepts, and its TFLOP/s), e4m3 x e5m2, against the bfloat16 GEMM;
* the FP8 and bfloat16 GEMMs of the Llama-style model's linear layers (d 1024, 4096 tokens);
* quantisation written in torch ops, eager and compiled, against a copy of the same bytes;
* which FP8 types Triton compiles for this device.

    python benchmarks/fp8_probe.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any, Callable

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def time_ms(fn: Callable[[], Any], reps: int = 20, inner: int = 5) -> tuple[float, float, float]:
    """Median, min and max milliseconds per call over ``reps`` batches of ``inner`` calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / inner)
    return statistics.median(out), min(out), max(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    doc: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "probes": []}

    def record(name: str, **kw: Any) -> None:
        doc["probes"].append({"name": name, **kw})
        print(name, json.dumps(kw), flush=True)

    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    flop = 2.0 * n**3
    t = time_ms(lambda: a @ b.t())
    record("bf16 mm 8192^3", ms=t, tflops=flop / t[0] / 1e9)
    a8, b8 = a.to(E4M3), b.to(E4M3)
    one = torch.ones((), device=dev)
    scales = {
        "tensor": (one, one),
        "row": (torch.ones(n, 1, device=dev), torch.ones(1, n, device=dev)),
        "block 1x128 x 128x128": (torch.ones(n, n // 128, device=dev), torch.ones(n // 128, n // 128, device=dev)),
        "block 128x128 x 128x128": (torch.ones(n // 128, n // 128, device=dev), torch.ones(n // 128, n // 128, device=dev)),
        "block 1x128 x 1x128": (torch.ones(n, n // 128, device=dev), torch.ones(n, n // 128, device=dev)),
    }
    for name, (sa, sb) in scales.items():
        for variant, (sa2, sb2) in {"as given": (sa, sb), "b scale transposed": (sa, sb.t())}.items():
            try:
                fn = lambda: torch._scaled_mm(a8, b8.t(), sa2, sb2, out_dtype=torch.bfloat16)  # noqa: E731
                ref = (a8.float() @ b8.float().t())[:64, :64]
                got = fn()[:64, :64].float()
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                t = time_ms(fn)
                record(f"_scaled_mm e4m3 {name} ({variant})", ok=True, ms=t, tflops=flop / t[0] / 1e9, rel_err=err)
            except Exception as exc:  # noqa: BLE001 - what the build refuses is the finding
                record(f"_scaled_mm e4m3 {name} ({variant})", ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
    for fa, fb in ((E4M3, E5M2), (E5M2, E4M3), (E5M2, E5M2)):
        try:
            x, y = a.to(fa), b.to(fb)
            t = time_ms(lambda: torch._scaled_mm(x, y.t(), one, one, out_dtype=torch.bfloat16))
            record(f"_scaled_mm {fa} x {fb} tensor", ok=True, ms=t, tflops=flop / t[0] / 1e9)
        except Exception as exc:  # noqa: BLE001
            record(f"_scaled_mm {fa} x {fb} tensor", ok=False, error=f"{type(exc).__name__}: {str(exc)[:200]}")
    try:
        bias = torch.randn(n, device=dev, dtype=torch.bfloat16)
        t = time_ms(lambda: torch._scaled_mm(a8, b8.t(), one, one, bias=bias, out_dtype=torch.bfloat16))
        record("_scaled_mm e4m3 tensor + bias", ok=True, ms=t)
        t = time_ms(lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.float32))
        record("_scaled_mm e4m3 tensor, float32 out", ok=True, ms=t)
    except Exception as exc:  # noqa: BLE001
        record("_scaled_mm e4m3 + bias / f32", ok=False, error=f"{type(exc).__name__}: {str(exc)[:200]}")
    del a, b, a8, b8

    # the Llama-style model's GEMMs (d 1024, SwiGLU 2816, vocab 32000, batch 4 x T 1024): forward shapes
    m = 4096
    for name, (k, nn_) in {"qkv": (1024, 3072), "out": (1024, 1024), "gate+up": (1024, 5632), "down": (2816, 1024),
                           "lm head": (1024, 32000), "d4096 qkv": (4096, 12288), "d4096 up": (4096, 22016), "d4096 down": (11008, 4096)}.items():
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(nn_, k, device=dev, dtype=torch.bfloat16)
        tb = time_ms(lambda: x @ w.t())
        x8, w8 = x.to(E4M3), w.to(E4M3)
        tf = time_ms(lambda: torch._scaled_mm(x8, w8.t(), one, one, out_dtype=torch.bfloat16))
        xs = torch.ones(m, 1, device=dev)
        ws = torch.ones(1, nn_, device=dev)
        try:
            tr = time_ms(lambda: torch._scaled_mm(x8, w8.t(), xs, ws, out_dtype=torch.bfloat16))[0]
        except Exception:  # noqa: BLE001
            tr = None
        f = 2.0 * m * k * nn_
        record(f"linear {name} M{m} K{k} N{nn_}", bf16_ms=tb[0], fp8_tensor_ms=tf[0], fp8_row_ms=tr,
               speedup=tb[0] / tf[0], bf16_tflops=f / tb[0] / 1e9, fp8_tflops=f / tf[0] / 1e9)

    # quantisation in torch ops against a copy of the same bytes
    x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(x)
    t = time_ms(lambda: dst.copy_(x))
    copy_gbps = 2 * x.numel() * 2 / t[0] / 1e6
    record("copy bf16 8192^2", ms=t, gbps=copy_gbps)

    def quant(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = v.abs().amax().float() / 448.0
        return (v.float() / s).clamp(-448, 448).to(E4M3), s

    def quant_row(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = v.abs().amax(-1, keepdim=True).float() / 448.0
        return (v.float() / s).clamp(-448, 448).to(E4M3), s

    bytes_moved = x.numel() * 2 + x.numel()  # read bf16, write fp8 (the amax pass re-reads in eager)
    for name, fn in {"eager tensor": quant, "eager row": quant_row}.items():
        t = time_ms(lambda: fn(x))
        record(f"quantize {name}", ms=t, gbps=bytes_moved / t[0] / 1e6, of_copy=bytes_moved / t[0] / 1e6 / copy_gbps)
        try:
            c = torch.compile(fn)
            t = time_ms(lambda: c(x))
            record(f"quantize compiled {name}", ms=t, gbps=bytes_moved / t[0] / 1e6, of_copy=bytes_moved / t[0] / 1e6 / copy_gbps)
        except Exception as exc:  # noqa: BLE001
            record(f"quantize compiled {name}", error=f"{type(exc).__name__}: {str(exc)[:200]}")

    # Triton's FP8 types on this device
    try:
        import triton
        import triton.language as tl

        @triton.jit
        def cast(x_ptr, y_ptr, n, DT: tl.constexpr, BLOCK: tl.constexpr):
            i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            v = tl.load(x_ptr + i, mask=i < n)
            tl.store(y_ptr + i, v.to(DT, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True), mask=i < n)

        src = torch.randn(4096, device=dev) * 100
        for name in ("float8e4nv", "float8e5", "float8e4b8", "float8e5b16", "float8e4b15"):
            out = torch.empty(4096, device=dev, dtype=torch.uint8)
            try:
                cast[(4,)](src, out, 4096, getattr(tl, name), 1024)
                torch.cuda.synchronize()
                ref = {"float8e4nv": E4M3, "float8e5": E5M2}.get(name)
                same = None if ref is None else (out == src.clamp(-448, 448).to(ref).view(torch.uint8)).float().mean().item()
                record(f"triton cast fp32 -> {name}", ok=True, bitexact_vs_torch_clamped=same)
            except Exception as exc:  # noqa: BLE001
                record(f"triton cast fp32 -> {name}", ok=False, error=f"{type(exc).__name__}: {str(exc)[:200]}")
    except Exception as exc:  # noqa: BLE001
        record("triton", ok=False, error=str(exc)[:200])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
