"""The one-pass numba quantize / dequantize equal the torch kernels (the op's float32 formula) bit
for bit: random values, rounding ties, NaN, infinities and magnitudes past 2**22, where the
vectorised rounding's trick no longer rounds (the saturation must still come out right)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hal


def _specials(scale: float) -> np.ndarray:
    ties = (np.arange(-300, 300) + 0.5) * scale  # x / scale lands on .5: ties to even
    big = np.array([2.0**22, 2.0**22 + 1, 2.0**23, 1.5 * 2**23, 2.0**24, 3e38], dtype=np.float64) * scale
    return np.concatenate([ties, big, -big, [np.nan, np.inf, -np.inf, 0.0, -0.0]])


@pytest.mark.parametrize("qtype", ["int8", "uint8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_quantize_matches_the_torch_kernel(rng, qtype, dtype):
    scale = float(rng.uniform(0.005, 0.5))
    zero_point = int(rng.integers(0, 40)) if qtype == "uint8" else int(rng.integers(-20, 20))
    values = np.concatenate([rng.standard_normal(10_000) * scale * 150, _specials(scale)])
    x = torch.from_numpy(values).to(dtype)
    assert hal.explain("quantize", x, scale, zero_point, None, qtype).kernel == "numba"
    got = hal.ops.quantize(x, scale, zero_point, None, qtype)
    with hal.use(backend="cpu", kernel={"quantize": "torch"}):
        want = hal.ops.quantize(x, scale, zero_point, None, qtype)
    mismatch = (got != want).nonzero().flatten()
    assert mismatch.numel() == 0, f"{mismatch.numel()} differ, e.g. x={values[mismatch[:5].numpy()]}: {got[mismatch[:5]]} vs {want[mismatch[:5]]}"


@pytest.mark.parametrize("qtype", ["int8", "uint8"])
def test_dequantize_matches_the_torch_kernel(rng, qtype):
    lo, hi = (-128, 127) if qtype == "int8" else (0, 255)
    q = torch.from_numpy(rng.integers(lo, hi + 1, size=(33, 517))).to(getattr(torch, qtype))
    scale, zero_point = float(rng.uniform(0.001, 2.0)), int(rng.integers(lo, hi + 1))
    assert hal.explain("dequantize", q, scale, zero_point).kernel == "numba"
    with hal.use(backend="cpu", kernel={"dequantize": "torch"}):
        want = hal.ops.dequantize(q, scale, zero_point)
    got = hal.ops.dequantize(q, scale, zero_point)
    assert got.dtype == want.dtype == torch.float32
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fake_quantize_backward_matches_the_torch_kernel(rng, dtype):
    scale = float(rng.uniform(0.005, 0.5))
    zero_point = int(rng.integers(-20, 20))
    values = np.concatenate([rng.standard_normal(10_000) * scale * 150, _specials(scale)])
    x = torch.from_numpy(values).to(dtype)
    g = torch.from_numpy(rng.standard_normal(values.size)).to(dtype)
    args = (g, x, scale, zero_point, -128, 127, None)
    assert hal.explain("fake_quantize_backward", *args).kernel == "numba"
    got = hal.ops.fake_quantize_backward(*args)
    with hal.use(backend="cpu", kernel={"fake_quantize_backward": "torch"}):
        want = hal.ops.fake_quantize_backward(*args)
    mismatch = (got != want).nonzero().flatten()
    assert mismatch.numel() == 0, f"{mismatch.numel()} differ, e.g. x={values[mismatch[:5].numpy()]}"


def test_fake_quantize_backward_leaves_wide_ranges_to_torch(rng):
    x = torch.from_numpy(rng.standard_normal(64)).float()
    decision = hal.explain("fake_quantize_backward", torch.ones_like(x), x, 0.1, 0, -(2**24), 2**24, None)
    assert decision.kernel == "torch"
    assert any("quantised range" in r for c in decision.candidates if c.kernel == "numba" for r in c.reasons)
