"""On a GPU with FP8 (NVIDIA sm_89+: e4m3fn, e5m2; AMD gfx942: the fnuz formats): every Triton FP8
kernel of hal_triton against cpu_ref, bit for bit for quantisation and dequantisation (the
hardware casts and the emulated ones), within the op's tolerance for the scaled GEMM, on random
inputs with NaN, infinities and values past the format's range, outputs poisoned first; and the
per-tensor current-scaled quantisation (amax, scale and cast all on the device) captured in a CUDA
graph and replayed on new values.

Skipped without a CUDA device (CI); run on the device machine:
``pytest -q tests/cuda/device/test_fp8_kernels.py``.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from tests.cuda._support import assert_bits, assert_close, finite_codes, rms
from tests.cuda.device._fp8 import DEV, kern, poison

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

if torch.cuda.is_available():
    from hal_backend_cpu_ref import fp8 as ref
    from hal_triton import fp8 as f8

from hal.ops.fp8 import scale_shape  # noqa: E402


def wide(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, specials: bool = True) -> torch.Tensor:
    """Log-normally spread values, signs mixed; with ``specials``: NaN, +-inf, huge values, -0,
    float32 subnormals scattered in."""
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * torch.exp(3.0 * torch.randn(shape, generator=gen, dtype=torch.float64))
    if specials:
        flat = x.view(-1)
        idx = torch.randint(0, flat.numel(), (8,), generator=gen)
        flat[idx] = torch.tensor([math.nan, math.inf, -math.inf, 1e30, -1e30, -0.0, 1e-40, -1e-39], dtype=torch.float64)
    return x.to(dtype).to(DEV)


def reference(x: torch.Tensor, fmt: str, granularity: str, scale, bs: int, transpose: bool):
    fn = ref.fp8_quantize_transpose if transpose else ref.fp8_quantize
    with np.errstate(all="ignore"):
        return fn(x.float().cpu().numpy(), fmt, granularity, None if scale is None else scale.cpu().numpy(), bs)


SHAPES = [((3, 300, 520), 128), ((512, 2048), 128), ((257, 1000), 64), ((2, 130, 200), 48)]


@pytest.mark.parametrize("hw", [True, False], ids=["hardware-cast", "emulated-cast"])
@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
@pytest.mark.parametrize("given", [False, True], ids=["current", "given"])
@pytest.mark.parametrize("transpose", [False, True], ids=["plain", "transposed"])
def test_quantize_bit_for_bit(fmts: list[str], gen: torch.Generator, hw: bool, granularity: str, given: bool, transpose: bool) -> None:
    if transpose and given and granularity == "row":
        pytest.skip("row-wise given scales do not apply to x.mT (the op refuses them)")
    for fmt in fmts:
        cases = list(zip(SHAPES, (torch.bfloat16, torch.float32, torch.float16, torch.bfloat16)))
        # every distinct launch compiles once (about a second each): the emulated cast gets one
        # format and one shape; tensor and row scales the large 2-D shape (the tables' 4096-element tiles)
        # and one of 257 rows, block scales the 3-D one and the odd block size (48) besides
        if not hw:
            if fmt != fmts[0]:
                continue
            cases = cases[:1]
        else:
            cases = [cases[0], cases[1], cases[3]] if granularity == "block" else cases[1:3]
        for (shape, bs), dtype in cases:
            # current scaling per tensor: no specials (a NaN makes the whole tensor NaN); per row or
            # block they make a few groups NaN or infinite and leave the others
            x = wide(gen, *shape, dtype=dtype, specials=given or granularity != "tensor")
            scale = None
            if given:
                scale = (torch.rand(scale_shape(shape, granularity, bs), generator=gen) * 3 + 1e-3).float().to(DEV)
            poison()
            if hw:
                op = "fp8_quantize_transpose" if transpose else "fp8_quantize"
                got = kern(op)(x, fmt, granularity, scale, bs)
            else:
                got = f8.quantize(x, fmt, granularity, scale, bs, transpose, False, 1024, 4)
            torch.cuda.synchronize()
            want = reference(x, fmt, granularity, scale, bs, transpose)
            assert len(got) == len(want)
            for g, w, what in zip(got, want, ("q", "scale", "q_t", "scale_t")):
                assert_bits(g, w, f"{fmt} {granularity} {shape} {dtype} {what}")


@pytest.mark.skipif(not os.environ.get("HAL_FP8_HW_CAST_PROBE"), reason="a probe: HAL_FP8_HW_CAST_PROBE=1 runs it (-s shows its counts)")
def test_probe_hardware_cast_in_the_emulated_modes(fmts: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The modes hal_triton.fp8 encodes with the emulated cast (given blocks, transposed row-wise
    current scaling) run with the hardware cast, on the configurations that failed on the H200:
    prints how many codes each cast gets wrong; asserts the emulated cast gets none."""
    monkeypatch.setattr(f8, "_EMULATED_MODES", ())
    gen = torch.Generator().manual_seed(0)
    for shape, dtype, granularity, transpose, block_elems, warps in [((512, 2048), torch.float32, "block", False, 4096, 8),
                                                                      ((3, 300, 520), torch.bfloat16, "block", True, 1024, 4),
                                                                      ((512, 2048), torch.float32, "row", True, 4096, 8)]:
        x = wide(gen, *shape, dtype=dtype, specials=False)
        scale = (torch.rand(scale_shape(shape, granularity, 128), generator=gen) * 3 + 1e-3).float().to(DEV) if granularity == "block" else None
        want = reference(x, fmts[0], granularity, scale, 128, transpose)
        for hw in (True, False):
            poison()
            got = f8.quantize(x, fmts[0], granularity, scale, 128, transpose, hw, block_elems, warps)
            wrong = [int((g.cpu() != torch.from_numpy(np.array(w))).sum()) for g, w in zip(got, want) if g.dtype == torch.uint8]
            print(f"{shape} {dtype} {granularity} transpose={transpose} {'hardware' if hw else 'emulated'} cast: wrong codes {wrong}")
            assert hw or not any(wrong)


def test_power_of_two_tensor_scales(fmts: list[str], gen: torch.Generator) -> None:
    """Given tensor scales that are normal powers of two (x times the exact reciprocal) and others
    (the division), both ends of the exponent range, specials in x: the same codes as cpu_ref."""
    x = wide(gen, 300, 520, dtype=torch.float32)
    for sv in (2.0**-7, 8.0, 2.0**-126, 2.0**126, 2.0**127, 2.0**-149, 0.75):
        scale = torch.tensor(sv, dtype=torch.float32, device=DEV)
        poison()
        got = kern("fp8_quantize")(x, fmts[0], "tensor", scale, 128)
        torch.cuda.synchronize()
        for g, w, what in zip(got, reference(x, fmts[0], "tensor", scale, 128, False), ("q", "scale")):
            assert_bits(g, w, f"{fmts[0]} tensor scale {sv} {what}")


def test_long_rows_in_one_tile_and_in_chunks(fmts: list[str], gen: torch.Generator) -> None:
    """Row-wise current scaling of rows the row kernel keeps whole (8192 columns: one read of x, 16
    warps) and of rows past its one-tile limit (two passes over each row), NaN and infinities in."""
    for shape in ((64, 8192), (4, 20000)):
        x = wide(gen, *shape, dtype=torch.bfloat16)
        poison()
        got = kern("fp8_quantize")(x, fmts[0], "row", None, 128)
        torch.cuda.synchronize()
        for g, w, what in zip(got, reference(x, fmts[0], "row", None, 128, False), ("q", "scale")):
            assert_bits(g, w, f"{fmts[0]} row {shape} {what}")


@pytest.mark.parametrize("granularity", ["number", "tensor", "row", "block"])
def test_dequantize_bit_for_bit(fmts: list[str], gen: torch.Generator, granularity: str) -> None:
    shape, bs = (3, 200, 300), 128
    for fmt in fmts:
        for out_dtype in ("float32", "bfloat16", "float16"):
            q = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
            q.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)  # every pattern, NaN and infinities included
            scale = 0.37 if granularity == "number" else torch.rand(scale_shape(shape, granularity, bs), generator=gen).float() * 4 + 1e-3
            poison()
            got = kern("fp8_dequantize")(q.to(DEV), scale if granularity == "number" else scale.to(DEV), fmt, bs, out_dtype)
            with np.errstate(all="ignore"):
                want = ref.fp8_dequantize(q.numpy(), scale if granularity == "number" else scale.numpy(), fmt, bs, out_dtype)
            assert got.dtype == getattr(torch, out_dtype)
            assert_bits(got.float(), np.asarray(want).astype(np.float32), f"{fmt} {granularity} {out_dtype}")


GEMM_GRANULARITIES = [("tensor", "tensor"), ("row", "row"), ("block", "block"), ("row", "block"), ("block", "tensor")]


GEMM_CASES = [(g, (256, 384, 512)) for g in GEMM_GRANULARITIES] + [(("row", "block"), (300, 200, 384)),
                                                                  (("block", "block"), (1024, 2048, 1024))]  # autotuned


@pytest.mark.parametrize("grans,mnk", GEMM_CASES, ids=lambda v: "x".join(map(str, v)))
def test_scaled_mm_within_tolerance(fmts: list[str], gen: torch.Generator, grans: tuple, mnk: tuple) -> None:
    (a_gran, b_gran), (m, n, k) = grans, mnk
    bs = 128
    pairs = [(fmts[0], fmts[0])] + ([(fmts[1], fmts[0])] if len(fmts) > 1 else [])  # forward e4m3 x e4m3, gradient e5m2 x e4m3
    for (a_fmt, b_fmt), out_dtype in zip(pairs, ("bfloat16", "float32")):
        a, b = finite_codes(gen, a_fmt, m, k), finite_codes(gen, b_fmt, n, k)
        a[5, 17] = 0x7F if a_fmt in ("e4m3fn", "e5m2") else 0x80  # a NaN code: row 5 of the result is NaN
        sa = (torch.rand(scale_shape((m, k), a_gran, bs), generator=gen) + 0.5) / (rms(a_fmt) * k**0.25)
        sb = (torch.rand(scale_shape((n, k), b_gran, bs), generator=gen) + 0.5) / (rms(b_fmt) * k**0.25)
        bias = torch.randn(n, generator=gen).to(torch.bfloat16)
        args = (a.to(DEV), b.to(DEV), sa.float().to(DEV), sb.float().to(DEV), bias.to(DEV), a_fmt, b_fmt, out_dtype, bs)
        poison()
        got = kern("fp8_scaled_mm")(*args)
        with np.errstate(all="ignore"):
            want = ref.fp8_scaled_mm(a.numpy(), b.numpy(), sa.float().numpy(), sb.float().numpy(), bias.float().numpy(), a_fmt, b_fmt,
                                     "float32", bs)
        got = got.cpu()
        assert got.dtype == getattr(torch, out_dtype)
        assert got[5].isnan().all()
        assert_close("fp8_scaled_mm", got, torch.from_numpy(np.asarray(want, dtype=np.float64)), tuple(t.cpu() if isinstance(t, torch.Tensor) else t for t in args))


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
@pytest.mark.parametrize("transpose", [False, True], ids=["plain", "transposed"])
def test_current_scaling_runs_in_a_cuda_graph(fmts: list[str], gen: torch.Generator, granularity: str, transpose: bool) -> None:
    """Capture the current-scaled quantisation (amax, scale and codes on the device, no host
    synchronisation), then replay it on new values written into the captured input."""
    fmt = fmts[0]
    op = kern("fp8_quantize_transpose" if transpose else "fp8_quantize")
    x = wide(gen, 512, 768, dtype=torch.bfloat16, specials=False)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op(x, fmt, granularity, None, 128)  # compile and autotune outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = op(x, fmt, granularity, None, 128)
    for _ in range(2):
        x.copy_(wide(gen, 512, 768, dtype=torch.bfloat16, specials=False) * float(torch.rand((), generator=gen) * 100))
        graph.replay()
        torch.cuda.synchronize()
        want = reference(x, fmt, granularity, None, 128, transpose)
        for g, w, what in zip(outs, want, ("q", "scale", "q_t", "scale_t")):
            assert_bits(g, w, f"replayed {granularity} {what}")


def test_the_dispatcher_runs_the_triton_quantisation(fmts: list[str], gen: torch.Generator) -> None:
    """hal.ops on GPU tensors pick the Triton kernels of the quantisation ops (the GPU backend's
    only native FP8 casts) and match cpu_ref."""
    import hal

    x = wide(gen, 2, 256, 384, dtype=torch.bfloat16, specials=False)
    for op, transpose in (("fp8_quantize", False), ("fp8_quantize_transpose", True)):
        for granularity in ("tensor", "row", "block"):
            d = hal.explain(op, x, fmts[0], granularity)
            assert d.kernel == "triton", d
            got = getattr(hal.ops, op)(x, fmts[0], granularity)
            for g, w in zip(got, reference(x, fmts[0], granularity, None, 128, transpose)):
                assert_bits(g, w, f"hal.ops.{op} {granularity}")


def reference_amax(x: torch.Tensor, fmt: str, scale: torch.Tensor, transpose: bool):
    fn = ref.fp8_quantize_transpose_amax if transpose else ref.fp8_quantize_amax
    with np.errstate(all="ignore"):
        return fn(x.float().cpu().numpy(), scale.cpu().numpy(), fmt)


@pytest.mark.parametrize("hw", [True, False], ids=["hardware-cast", "emulated-cast"])
@pytest.mark.parametrize("transpose", [False, True], ids=["plain", "transposed"])
def test_quantize_amax_bit_for_bit(fmts: list[str], gen: torch.Generator, hw: bool, transpose: bool) -> None:
    """fp8_quantize_amax / fp8_quantize_transpose_amax (delayed scaling's cast, the amax reduced by
    atomic max in the cast's own pass): codes, scale and amax equal cpu_ref's, with and without
    specials (NaN: amax NaN from whichever tile holds it; infinities: amax infinite), outputs
    poisoned first."""
    op = "fp8_quantize_transpose_amax" if transpose else "fp8_quantize_amax"
    shapes = [((3, 300, 520), torch.bfloat16), ((512, 2048), torch.float32), ((257, 1000), torch.float16), ((1, 8193), torch.float32)]
    for fmt in (fmts if hw else fmts[:1]):
        for (shape, dtype), specials in zip(shapes, (False, True, False, True)):
            x = wide(gen, *shape, dtype=dtype, specials=specials)
            scale = (torch.rand((), generator=gen) * 3 + 1e-3).float().to(DEV)
            poison()
            got = kern(op)(x, scale, fmt) if hw else f8.quantize_amax(x, fmt, scale, transpose, False, 1024, 4)
            torch.cuda.synchronize()
            want = reference_amax(x, fmt, scale, transpose)
            assert len(got) == len(want)
            for g, w, what in zip(got, want, ("q", "scale", "q_t", "amax") if transpose else ("q", "scale", "amax")):
                assert_bits(g, w, f"{op} {fmt} {shape} {dtype} {what}")
            assert got[-1].isnan() if specials else float(got[-1]) == float(x.float().abs().max())
    # only the NaN-free infinities: amax infinite
    x = wide(gen, 300, 520, specials=False)
    x[17, 400] = -math.inf
    got = kern(op)(x, torch.tensor(0.5, device=DEV), fmts[0])
    assert float(got[-1]) == math.inf


def test_delayed_scaling_cast_runs_in_a_cuda_graph(fmts: list[str], gen: torch.Generator) -> None:
    """The amax word is zeroed and reduced on the device: a captured fp8_quantize_transpose_amax
    replays on new values with their amax."""
    fmt = fmts[0]
    op = kern("fp8_quantize_transpose_amax")
    x = wide(gen, 512, 768, dtype=torch.bfloat16, specials=False)
    scale = torch.tensor(0.05, device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op(x, scale, fmt)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = op(x, scale, fmt)
    for _ in range(2):
        x.copy_(wide(gen, 512, 768, dtype=torch.bfloat16, specials=False) * float(torch.rand((), generator=gen) * 100))
        graph.replay()
        torch.cuda.synchronize()
        for g, w, what in zip(outs, reference_amax(x, fmt, scale, True), ("q", "scale", "q_t", "amax")):
            assert_bits(g, w, f"replayed {what}")


def test_the_dispatcher_runs_the_triton_amax_casts(fmts: list[str], gen: torch.Generator) -> None:
    """hal.ops picks the Triton kernels of the amax casts on GPU tensors, and DelayedScaler uses them."""
    import hal
    from hal.fp8 import DelayedScaling

    x = wide(gen, 2, 256, 384, dtype=torch.bfloat16, specials=False)
    scale = torch.tensor(0.02, device=DEV)
    for op, transpose in (("fp8_quantize_amax", False), ("fp8_quantize_transpose_amax", True)):
        assert hal.explain(op, x, scale, fmts[0]).kernel == "triton"
        for g, w in zip(getattr(hal.ops, op)(x, scale, fmts[0]), reference_amax(x, fmts[0], scale, transpose)):
            assert_bits(g, w, f"hal.ops.{op}")
    scaler = DelayedScaling(fmts[0], history=4).scaler(fmts[0], DEV)
    scaler.quantize_with_transpose(x)
    assert float(scaler.amax_history[0]) == float(x.float().abs().max())
