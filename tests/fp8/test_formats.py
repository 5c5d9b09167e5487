"""FP8 formats emulated exactly: hand-computed bit patterns of the OCP (e4m3fn, e5m2) and AMD fnuz
(e4m3fnuz, e5m2fnuz) formats, every finite value round-tripping through fp8_quantize, saturation,
NaN and zero rules, ties to even, the scales of each granularity, and the ops against cpu_ref
through the conformance runner (which must also catch a wrong kernel)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

import hal
from hal.conformance.runner import Suite
from hal.ops import fp8_dequantize, fp8_quantize, fp8_scaled_mm
from hal.ops.fp8 import FORMATS, format_values

BACKENDS = ("cpu_ref", "eager", "cpu")
FP8_OPS = ["fp8_quantize", "fp8_dequantize", "fp8_scaled_mm"]

#: hand-computed: (largest finite, its bit pattern, smallest subnormal, bit pattern of 1.0, NaN patterns)
HAND = {
    "e4m3fn": (448.0, 0x7E, 2.0**-9, 0x38, {0x7F, 0xFF}),
    "e5m2": (57344.0, 0x7B, 2.0**-16, 0x3C, {0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF}),
    "e4m3fnuz": (240.0, 0x7F, 2.0**-10, 0x40, {0x80}),
    "e5m2fnuz": (57344.0, 0x7F, 2.0**-17, 0x40, {0x80}),
}


def quantize(x, fmt, backend, scale=1.0, granularity="tensor", **kw):
    """fp8_quantize on ``backend`` with a fixed scale (None: current scaling), as NumPy arrays."""
    s = None if scale is None else torch.tensor(scale, dtype=torch.float32)
    with hal.use(backend=backend):
        q, sc = fp8_quantize(torch.as_tensor(x, dtype=torch.float32), fmt, granularity, s, **kw)
    assert q.dtype == torch.uint8 and sc.dtype == torch.float32
    return q.numpy(), sc.numpy()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_decoded_values_match_hand_computed_ones_and_ml_dtypes(fmt):
    top, top_bits, tiny, one_bits, nans = HAND[fmt]
    v = format_values(fmt)
    assert FORMATS[fmt].max_finite == top and v[top_bits] == top and v[top_bits | 0x80] == -top
    assert np.nanmax(np.where(np.isinf(v), np.nan, v)) == top  # no finite value beyond it
    assert v[1] == tiny and v[one_bits] == 1.0
    assert {b for b in range(256) if math.isnan(v[b])} == nans
    assert (fmt == "e5m2") == bool(np.isinf(v).any())
    if fmt == "e5m2":
        assert v[0x7C] == math.inf and v[0xFC] == -math.inf
    # negative zero exists in the OCP formats only (0x80 is the fnuz NaN)
    assert (not FORMATS[fmt].fnuz) == (v[0x80] == 0 and math.copysign(1, v[0x80]) < 0)
    # an independent decoder agrees on all 256 patterns
    other = np.arange(256, dtype=np.uint8).view(getattr(ml_dtypes, f"float8_{fmt}")).astype(np.float64)
    np.testing.assert_array_equal(v, other)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_finite_value_round_trips_with_scale_one(fmt, backend, rng):
    v = format_values(fmt)
    codes = np.array([b for b in range(256) if np.isfinite(v[b])], dtype=np.uint8)
    order = rng.permutation(len(codes))
    q, scale = quantize(v[codes[order]], fmt, backend)
    np.testing.assert_array_equal(q, codes[order])
    assert scale == 1.0
    with hal.use(backend=backend):
        back = fp8_dequantize(torch.from_numpy(q), 1.0, fmt).numpy()
    np.testing.assert_array_equal(back, v[codes[order]])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_saturation_nan_and_zero_rules(fmt, backend):
    top, top_bits, tiny, _, _ = HAND[fmt]
    fnuz = FORMATS[fmt].fnuz
    x = [top * 1.01, -top * 3, math.inf, -math.inf, 1e30, math.nan, -math.nan, 0.0, -0.0, tiny / 2, -tiny / 2, tiny * 0.75]
    q, _ = quantize(x, fmt, backend)
    nan = 0x80 if fnuz else 0x7F
    want = [top_bits, top_bits | 0x80, top_bits, top_bits | 0x80, top_bits, nan, nan,
            0x00, 0x00 if fnuz else 0x80,  # fnuz has no negative zero
            0x00, 0x00 if fnuz else 0x80,  # half the smallest subnormal ties to zero (even)
            0x01]
    assert [hex(b) for b in q] == [hex(b) for b in want]


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_computed_spot_values_and_ties_to_even(backend):
    # e5m2: 1.0 = 0 01111 00; 1.25 = ..01; 1.75 = ..11; 1.125 ties 1.0 / 1.25 -> 1.0 (even);
    # 1.875 ties 1.75 / 2.0 -> 2.0 (0 10000 00, even); -3.0 = 1 10000 10; 2^-16 = smallest
    # subnormal; 1.5 * 2^-16 ties 2^-16 / 2^-15 -> 2^-15; 61440, halfway to 2^16, saturates
    q, _ = quantize([1.0, 1.25, 1.75, 1.125, 1.875, -3.0, 2.0**-16, 3 * 2.0**-17, 57344.0, 61440.0], "e5m2", backend)
    assert list(q) == [0x3C, 0x3D, 0x3F, 0x3C, 0x40, 0xC2, 0x01, 0x02, 0x7B, 0x7B]
    # e4m3fn: 1.0625 ties 1.0 / 1.125 -> 1.0; 1.1875 ties 1.125 / 1.25 -> 1.25; 464 (past 448) saturates
    q, _ = quantize([1.0625, 1.1875, -0.3125, 464.0, 2.0**-9 * 5], "e4m3fn", backend)
    assert list(q) == [0x38, 0x3A, 0xAA, 0x7E, 0x05]
    # e4m3fnuz: bias 8, so 1.0 = 0 1000 000 and 240 = 0 1111 111; 250 saturates, -0.5 = 1 0111 000
    q, _ = quantize([1.0, 240.0, 250.0, -0.5, 2.0**-10], "e4m3fnuz", backend)
    assert list(q) == [0x40, 0x7F, 0x7F, 0xB8, 0x01]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_rounding_matches_an_independent_cast_in_range(fmt, backend, rng):
    """Random float32 values within range (no saturation involved), including subnormals, against
    ml_dtypes' round-to-nearest-even cast."""
    top = FORMATS[fmt].max_finite
    x = (rng.standard_normal(4000) * np.exp2(rng.uniform(-20, math.log2(top) - 1, 4000))).astype(np.float32)
    x = np.clip(x, -top, top)  # ml_dtypes' cast does not saturate
    q, _ = quantize(x, fmt, backend)
    want = x.astype(getattr(ml_dtypes, f"float8_{fmt}")).view(np.uint8)
    np.testing.assert_array_equal(q, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_current_scaling_per_granularity(backend, rng):
    x = rng.standard_normal((40, 300)).astype(np.float32) * np.float32(7)
    x[3] = 0.0  # an all-zero row keeps scale 1
    top = np.float32(448)
    q, s = quantize(x, "e4m3fn", backend, scale=None)
    assert s.shape == () and s == np.abs(x).max() / top
    q, s = quantize(x, "e4m3fn", backend, scale=None, granularity="row")
    assert s.shape == (40, 1)
    want = np.abs(x).max(axis=1, keepdims=True) / top
    want[3] = 1
    np.testing.assert_array_equal(s, want)
    assert (q[3] == 0).all()
    # the largest |x| of each row maps to the largest finite value, with its sign
    rows = np.arange(40) != 3
    peak = np.abs(x).argmax(axis=1)
    assert set(q[rows, peak[rows]] & 0x7F) == {0x7E}
    q, s = quantize(x, "e4m3fn", backend, scale=None, granularity="block", block_size=128)
    assert s.shape == (1, 3)  # ceil(40 / 128), ceil(300 / 128): the edge tiles are cropped
    for j in range(3):
        np.testing.assert_array_equal(s[0, j], np.abs(x[:, 128 * j: 128 * (j + 1)]).max() / top)
    q, s = quantize(x, "e4m3fn", backend, scale=None, granularity="block", block_size=16)
    assert s.shape == (3, 19)
    np.testing.assert_array_equal(s[2, 18], np.abs(x[32:, 288:]).max() / top)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dequantize_and_scaled_mm_against_hand_decoding(backend, rng):
    """Every granularity of scales: dequantize is decode * scale in float32; scaled_mm the float64
    product of the dequantised operands, within float32 accumulation."""
    a = rng.standard_normal((48, 64)).astype(np.float32)
    b = rng.standard_normal((24, 64)).astype(np.float32)
    v = format_values("e4m3fn")
    for gran in ("tensor", "row", "block"):
        qa, sa = quantize(a, "e4m3fn", backend, scale=None, granularity=gran, block_size=16)
        qb, sb = quantize(b, "e5m2", backend, scale=None, granularity=gran, block_size=16)
        with hal.use(backend=backend):
            da = fp8_dequantize(torch.from_numpy(qa), torch.from_numpy(sa), "e4m3fn", 16).numpy()
            out = fp8_scaled_mm(torch.from_numpy(qa), torch.from_numpy(qb), torch.from_numpy(sa), torch.from_numpy(sb),
                                None, "e4m3fn", "e5m2", "float32", 16).numpy()
        full_sa = np.repeat(np.repeat(sa, 16, 0), 16, 1)[:48, :64] if gran == "block" else sa
        want_da = v[qa].astype(np.float32) * full_sa
        np.testing.assert_array_equal(da, want_da)
        np.testing.assert_allclose(da, a, rtol=2.0**-4, atol=float(np.max(full_sa)) * 2.0**-9)
        full_sb = np.repeat(np.repeat(sb, 16, 0), 16, 1)[:24, :64] if gran == "block" else sb
        want = (v[qa] * full_sa.astype(np.float64)) @ (format_values("e5m2")[qb] * full_sb.astype(np.float64)).T
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.sqrt(np.mean(want**2)) * 8)


def test_bad_arguments_say_what_to_do():
    x = torch.randn(4, 8)
    with pytest.raises(hal.InvalidArgumentError, match="format"):
        fp8_quantize(x, "e4m3")
    with pytest.raises(hal.InvalidArgumentError, match=r"\(4, 1\)"):
        fp8_quantize(x, "e4m3fn", "row", torch.ones(4))
    q, s = fp8_quantize(x, "e4m3fn", "row")
    with pytest.raises(hal.InvalidArgumentError, match="block"):
        fp8_scaled_mm(q, q, s, torch.ones(3), out_dtype="float32")
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(hal.InvalidArgumentError, match="positive, finite"):
            fp8_quantize(x, "e4m3fn", "tensor", torch.tensor(bad))
        with pytest.raises(hal.InvalidArgumentError, match="positive, finite"):
            fp8_scaled_mm(q, q, s, torch.tensor(bad), out_dtype="float32")
        with pytest.raises(hal.InvalidArgumentError, match="scale"):
            fp8_dequantize(q, bad)


@pytest.mark.parametrize("backend", ["eager", "cpu", "cpu_ref"])
def test_conformance_runner_passes_every_fp8_case(backend, seed):
    """eager and cpu against cpu_ref; cpu_ref itself against PyTorch's casts (the eager backend)."""
    suite = Suite(backend, seed=seed, ops=FP8_OPS)
    results = suite.run(suite.plan())
    assert {r.op for r in results} == set(FP8_OPS)
    assert len(results) > 150
    bad = [f"{r.id}: {r.status} {r.reason}" for r in results if r.status != "pass"]
    assert not bad, "\n".join(bad)


def test_conformance_runner_catches_round_half_away_from_zero(install, seed):
    """A quantiser that rounds ties away from zero (a common bug) fails the ties cases, and only
    cases that hold a tie; the exact cases leave it no tolerance."""
    from hal_backend_cpu_ref import fp8 as ref

    from tests.conformance._support import make_backend, run_suite

    def away(x, format, granularity, scale, block_size):
        q, s = ref.fp8_quantize(x, format, granularity, scale, block_size)
        y = (np.asarray(x, np.float32) / ref.expand(s, x.shape, block_size)).astype(np.float64)
        halfway = np.isin(np.abs(y), _midpoints(format))
        return np.where(halfway, ref.encode(y * (1 + 2.0**-30), format), q), s

    plugin = make_backend()
    plugin.kernel("fp8_quantize", name="away", dtypes=["float32"])(away)
    install(plugin)
    results = run_suite("buggy", seed, ["fp8_quantize"], dtypes=["float32"])
    failed = {r.case for r in results.values() if r.status == "fail"}
    assert {f"{f}_ties_to_even" for f in FORMATS} <= failed
    assert not any(name.endswith("every_value") for name in failed)


def _midpoints(fmt: str) -> np.ndarray:
    v = format_values(fmt)[:128]
    pos = v[np.isfinite(v)]
    return (pos[:-1] + pos[1:]) / 2
