"""The FP8 casts of a Llama-3-8B layer with and without their producers' amax (issue 40's FP8 lever
"quantisation fused into its producers"), at T 4096, d 4096, ffn 14336, bf16:

* the input norm feeding q, k and v's casts (each cast writes codes and their transpose): unfused,
  ``rms_norm`` then three current-scaled casts that each reduce the amax (an amax pass and an encode
  pass each); fused, ``rms_norm_amax`` then three casts given that amax (the encode pass alone);
* SwiGLU feeding down_proj's cast: ``swiglu`` + cast, against ``swiglu_amax`` + cast given the amax.

Prints each chain's time both ways (Triton's do_bench, medians), the ratio, and the bytes the amax
passes read that the fusion removes, against the rate that time saved implies. CUDA only.

    python benchmarks/fp8_amax_fusion.py
"""

from __future__ import annotations

import sys


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("fp8_amax_fusion: needs a CUDA device", file=sys.stderr)
        return 2
    import triton.testing

    from hal.plugin_sdk.fp8_hardware import fp8_device

    dev = torch.device("cuda")
    if fp8_device(dev, ["e4m3fn"]):
        print("fp8_amax_fusion: this GPU has no e4m3fn", file=sys.stderr)
        return 2
    from hal_backend_cuda import plugin

    def kern(op: str):
        return next(k.fn for k in plugin.kernels if k.op == op and k.name == "triton")

    t, d, ffn = 4096, 4096, 14336
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(t, d, generator=gen, device=dev).bfloat16()
    w = torch.rand(d, generator=gen, device=dev).bfloat16() + 0.5
    gate = torch.randn(t, ffn, generator=gen, device=dev).bfloat16()
    up = torch.randn(t, ffn, generator=gen, device=dev).bfloat16()
    cast, cast_given = kern("fp8_quantize_transpose"), kern("fp8_quantize_transpose_from_amax")
    norm, norm_amax, swiglu, swiglu_amax = kern("rms_norm"), kern("rms_norm_amax"), kern("swiglu"), kern("swiglu_amax")

    def norm_unfused() -> None:
        y = norm(x, (d,), w, 1e-5)
        for _ in range(3):
            cast(y, "e4m3fn", "tensor", None, 128)

    def norm_fused() -> None:
        y, a = norm_amax(x, (d,), w, 1e-5)
        for _ in range(3):
            cast_given(y, a, "e4m3fn")

    def mlp_unfused() -> None:
        cast(swiglu(gate, up), "e4m3fn", "tensor", None, 128)

    def mlp_fused() -> None:
        h, a = swiglu_amax(gate, up)
        cast_given(h, a, "e4m3fn")

    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    for name, unfused, fused, saved in (("norm + q/k/v casts", norm_unfused, norm_fused, 3 * t * d * 2),
                                        ("swiglu + down cast", mlp_unfused, mlp_fused, t * ffn * 2)):
        a = triton.testing.do_bench(unfused, warmup=25, rep=200, return_mode="median")
        b = triton.testing.do_bench(fused, warmup=25, rep=200, return_mode="median")
        rate = saved / max((a - b) * 1e-3, 1e-12) / 1e12
        print(f"  {name}: unfused {a * 1e3:.1f} us, fused {b * 1e3:.1f} us ({a / b:.3f}x); the amax passes removed "
              f"read {saved / 2**20:.0f} MiB ({rate:.2f} TB/s over the time saved)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
