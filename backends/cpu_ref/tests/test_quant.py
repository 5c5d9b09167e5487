"""cpu_ref's quantize, dequantize, fake_quantize(+_backward) and int8_linear against PyTorch (and
hal_torch's versions).

quantize / dequantize are checked against torch's quantized tensors (``torch.quantize_per_tensor``
/ ``_per_channel`` and ``.dequantize()``, which follow the same float32 formula), fake_quantize bit
for bit against ``torch.fake_quantize_per_tensor_affine`` / ``_per_channel_affine``, int8_linear
against an int64 matmul with a float64 epilogue.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import pytest
import torch
from refcheck import as_numpy, assert_within_tolerance, canonical, randn, vjp

import hal
from hal.arrays import dtype_name, from_numpy, torch_dtype
from hal_torch.table import eager

pytestmark = pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")

QRANGE = {"int8": (-128, 127), "uint8": (0, 255)}
TORCH_QTYPE = {"int8": torch.qint8, "uint8": torch.quint8}
FLOATS = ["float64", "float32", "float16", "bfloat16"]


def _qparams(rng, x_shape: tuple[int, ...], axis: Optional[int], qdtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Random positive float32 scales and in-range int32 zero points: one, or one per channel."""
    n = 1 if axis is None else x_shape[axis]
    middle = sum(QRANGE[qdtype]) // 2 + 1
    scale = torch.from_numpy(rng.uniform(0.005, 0.05, n)).float()
    zero_point = torch.from_numpy(middle + rng.integers(-16, 16, n)).int()
    return (scale[0], zero_point[0]) if axis is None else (scale, zero_point)


def _torch_quantized(x32: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: Optional[int], qdtype: str):
    """torch's quantized tensor (qint8 / quint8) of float32 x."""
    if axis is None:
        return torch.quantize_per_tensor(x32, float(scale), int(zero_point), TORCH_QTYPE[qdtype])
    return torch.quantize_per_channel(x32, scale.double(), zero_point.long(), axis % x32.ndim, TORCH_QTYPE[qdtype])


def _onnx_quantize(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: Optional[int], qdtype: str) -> torch.Tensor:
    """ONNX QuantizeLinear written out: float32 division, round half to even, saturate."""
    shape = [1] * x.ndim
    if axis is not None:
        shape[axis] = -1
    q = torch.round(x.float() / scale.float().reshape(shape)) + zero_point.reshape(shape)
    lo, hi = QRANGE[qdtype]
    return q.clamp(lo, hi).to(torch_dtype(qdtype))


def _x(rng, shape: tuple[int, ...], transposed: bool, dtype: str = "float64") -> torch.Tensor:
    """Random values, the first and last one far out of any quantisation range (for the edge of
    the clamp); a transposed (non-contiguous) view when asked."""
    if transposed:
        x = randn(rng, *reversed(shape)).permute(*reversed(range(len(shape))))
        assert not x.is_contiguous()
    else:
        x = randn(rng, *shape)
    if shape:
        x[(0,) * len(shape)], x[(-1,) * len(shape)] = 1e3, -1e3
    return x.to(torch_dtype(dtype))


#: (id, x shape, axis, quantised dtype, non-contiguous x)
QCASES = [
    ("per_tensor_int8", (5, 7), None, "int8", False),
    ("per_tensor_uint8", (3, 4, 5), None, "uint8", False),
    ("per_tensor_0d", (), None, "int8", False),
    ("per_channel_axis0", (6, 5), 0, "int8", False),
    ("per_channel_axis1_uint8", (2, 7, 3), 1, "uint8", False),
    ("per_channel_last_negative_axis", (4, 3, 5), -1, "int8", False),
    ("per_channel_non_contiguous", (5, 9), 1, "uint8", True),
]
QIDS = [c[0] for c in QCASES]


# --- quantize / dequantize -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("case", QCASES, ids=QIDS)
def test_quantize(case, dtype, rng):
    _, shape, axis, qdtype, transposed = case
    x = _x(rng, shape, transposed, dtype)
    scale, zp = _qparams(rng, shape, axis, qdtype)
    want = _onnx_quantize(x, scale, zp, axis, qdtype)
    got = hal.ops.quantize(x, scale, zp, axis, qdtype)
    assert got.dtype == torch_dtype(qdtype) and torch.equal(got, want)
    # torch's quantizers (and the eager twin built on them) divide in float64 per channel or
    # multiply by 1/scale: one step away from ONNX's float32 division where x / scale is a near-tie
    theirs = [_torch_quantized(x.float(), scale, zp, axis, qdtype).int_repr(), eager("quantize")(*canonical(hal.ops.quantize, x, scale, zp, axis, qdtype))]
    for other in theirs:
        assert other.dtype == want.dtype and (other.int() - want.int()).abs().max() <= 1


@pytest.mark.parametrize("qdtype", list(QRANGE))
@pytest.mark.parametrize("axis", [None, 1])
def test_quantize_ties_round_half_to_even(axis, qdtype, rng):
    """x / scale exactly k + 0.5 (power-of-two scales): rounds to the even neighbour."""
    halves = torch.arange(-6, 6, dtype=torch.float64) + 0.5
    scale = torch.tensor([0.25, 0.125], dtype=torch.float32)
    zp = torch.tensor([40, 41], dtype=torch.int32)
    if axis is None:
        scale, zp = scale[0], zp[0]
    x = halves[:, None] * scale.double()  # (12, 1) per tensor, (12, 2) per channel along axis 1
    want = torch.tensor([[round(float(h)) for _ in range(x.shape[1])] for h in halves]) + zp
    for impl in (hal.ops.quantize, eager("quantize")):
        got = impl(x, scale, zp, axis, qdtype)
        assert torch.equal(got.long(), want.long()), f"{impl}: {got.tolist()} != {want.tolist()}"


@pytest.mark.parametrize("qdtype", list(QRANGE))
def test_quantize_saturates(qdtype, rng):
    lo, hi = QRANGE[qdtype]
    big = torch.from_numpy(rng.uniform(1e3, 1e6, 6))
    x = torch.cat([big, -big, torch.tensor([torch.inf, -torch.inf], dtype=torch.float64)])
    got = hal.ops.quantize(x, 0.1, (lo + hi + 1) // 2, dtype=qdtype)
    assert got.tolist() == [hi] * 6 + [lo] * 6 + [hi, lo]


#: every case with a scale of every float dtype, per-tensor ones also with a Python number
DQ_CASES = [(c, t) for c in QCASES for t in (["number"] if c[2] is None else []) + FLOATS]


@pytest.mark.parametrize("case, scale_dtype", DQ_CASES, ids=[f"{c[0]}-{t}" for c, t in DQ_CASES])
def test_dequantize(case, scale_dtype, rng):
    _, shape, axis, qdtype, transposed = case
    scale, zp = _qparams(rng, shape, axis, qdtype)
    scale = float(scale) if scale_dtype == "number" else scale.to(torch_dtype(scale_dtype))
    qx = _torch_quantized(_x(rng, shape, transposed).float(), torch.as_tensor(scale).float(), zp, axis, qdtype)
    q = qx.int_repr()
    want = qx.dequantize()  # (q - zero_point) * float32 scale, in float32
    want = want.to(scale.dtype) if isinstance(scale, torch.Tensor) else want
    for impl in (hal.ops.dequantize, eager("dequantize")):
        got = impl(*canonical(hal.ops.dequantize, q, scale, zp, axis))
        assert got.dtype == want.dtype and torch.equal(got, want)


# --- fake_quantize ---------------------------------------------------------------------------------

#: (id, x shape, axis, quant_min, quant_max)
FCASES = [
    ("per_tensor_int8", (5, 7), None, -128, 127),
    ("per_tensor_uint8", (2, 3, 11), None, 0, 255),
    ("per_tensor_4bit", (13,), None, -8, 7),
    ("per_channel_axis0", (6, 5), 0, -128, 127),
    ("per_channel_last_uint8", (2, 3, 7), -1, 0, 255),
    ("per_channel_axis1_4bit", (3, 4, 5), 1, -8, 7),
]
FIDS = [c[0] for c in FCASES]


def _fake_args(rng, shape, axis, qmin, qmax, dtype):
    x = _x(rng, shape, False, dtype)
    n = 1 if axis is None else shape[axis]
    scale = torch.from_numpy(rng.uniform(0.01, 0.1 if qmax > 7 else 0.5, n)).float()
    zp = torch.from_numpy(rng.integers(qmin, qmax + 1, n)).int()
    return x, (scale[0] if axis is None else scale), (zp[0] if axis is None else zp)


def _torch_fake(x, scale, zp, qmin, qmax, axis):
    if axis is None:
        return torch.fake_quantize_per_tensor_affine(x, float(scale), int(zp), qmin, qmax)
    return torch.fake_quantize_per_channel_affine(x, scale, zp, axis % x.ndim, qmin, qmax)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("case", FCASES, ids=FIDS)
def test_fake_quantize_bit_exact(case, dtype, rng):
    _, shape, axis, qmin, qmax = case
    x, scale, zp = _fake_args(rng, shape, axis, qmin, qmax, dtype)
    want = _torch_fake(x, scale, zp, qmin, qmax, axis)
    got = hal.ops.fake_quantize(x, scale, zp, qmin, qmax, axis)
    assert got.dtype == x.dtype and torch.equal(got, want), f"max diff {(got.double() - want.double()).abs().max()}"
    assert torch.equal(eager("fake_quantize")(*canonical(hal.ops.fake_quantize, x, scale, zp, qmin, qmax, axis)), want)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("case", FCASES, ids=FIDS)
def test_fake_quantize_backward(case, dtype, rng):
    _, shape, axis, qmin, qmax = case
    for _ in range(20):  # a draw of a few values may land entirely on one side of the range: draw again
        x, scale, zp = _fake_args(rng, shape, axis, qmin, qmax, dtype)
        g = randn(rng, *shape, dtype=x.dtype)
        (want,) = vjp(lambda t: _torch_fake(t, scale, zp, qmin, qmax, axis), (x,), g)
        if 0 < int((want == 0).sum()) < want.numel():
            break
    assert 0 < int((want == 0).sum()) < want.numel(), "the case should have values inside and outside the range"
    entry = hal.ops.fake_quantize_backward
    assert torch.equal(entry(g, x, scale, zp, qmin, qmax, axis), want)
    assert torch.equal(eager(entry.op.name)(*canonical(entry, g, x, scale, zp, qmin, qmax, axis)), want)


def test_fake_quantize_python_numbers(rng):
    x = _x(rng, (4, 6), False, "float32")
    want = torch.fake_quantize_per_tensor_affine(x, 0.03, -5, -128, 127)
    assert torch.equal(hal.ops.fake_quantize(x, 0.03, -5), want)


# --- int8_linear -----------------------------------------------------------------------------------

#: (id, x_q shape, N, w_scale kind, bias dtype or None)
LCASES = [
    ("2d_per_channel", (5, 16), 8, "per_channel", "float32"),
    ("3d_odd_sizes", (2, 3, 7), 5, "per_channel", None),
    ("k_one", (4, 1), 3, "number", "float16"),
    ("w_scale_one_element", (3, 9), 4, "one_element", "float64"),
    ("bfloat16_bias", (6, 11), 7, "per_channel", "bfloat16"),
]
LIDS = [c[0] for c in LCASES]


def _int8(rng, *shape: int) -> torch.Tensor:
    return torch.from_numpy(rng.integers(-128, 128, shape)).to(torch.int8)


def _linear_args(rng, x_shape, n, w_kind, bias_dtype):
    x_q, w_q = _int8(rng, *x_shape), _int8(rng, n, x_shape[-1])
    x_scale = torch.tensor(rng.uniform(1e-3, 1e-2), dtype=torch.float32)
    w_scale = {
        "number": float(rng.uniform(1e-3, 1e-2)),
        "one_element": torch.from_numpy(rng.uniform(1e-3, 1e-2, 1)).float(),
        "per_channel": torch.from_numpy(rng.uniform(1e-3, 1e-2, n)).float(),
    }[w_kind]
    bias = None if bias_dtype is None else randn(rng, n, dtype=torch_dtype(bias_dtype))
    return x_q, w_q, x_scale, w_scale, bias


def _linear_reference(x_q, w_q, x_scale, w_scale, bias, out_dtype):
    """Exact int64 accumulation, then the scales and bias in float64, rounded once to out_dtype."""
    acc = (x_q.long() @ w_q.long().T).double()
    out = acc * torch.as_tensor(x_scale, dtype=torch.float64) * torch.as_tensor(w_scale, dtype=torch.float64).reshape(-1)
    if bias is not None:
        out = out + bias.double()
    return out.to(torch_dtype(out_dtype))


@pytest.mark.parametrize("out_dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("case", LCASES, ids=LIDS)
def test_int8_linear(case, out_dtype, rng):
    args = _linear_args(rng, *case[1:])
    want = _linear_reference(*args, out_dtype)
    got = hal.ops.int8_linear(*args, out_dtype)
    assert got.dtype == want.dtype and got.shape == want.shape
    if out_dtype in ("bfloat16", "float16"):
        # float64 results that differ in their last bits (order of the scale products) can round to
        # neighbouring half-precision values at a rounding boundary: allow one unit in the last place
        torch.testing.assert_close(got, want, rtol=2**-7 if out_dtype == "bfloat16" else 2**-10, atol=0)
    else:
        assert torch.equal(got, want)
    entry = hal.ops.int8_linear
    got_eager = eager("int8_linear")(*canonical(entry, *args, out_dtype))
    assert_within_tolerance(entry, (*args, out_dtype), got_eager, want, "torch", out_dtype)


def test_int8_linear_long_reduction_is_exact(rng):
    """K = 4099 of extreme values: sums near 2**26, beyond float32's exact integers."""
    x_q = torch.full((2, 4099), -128, dtype=torch.int8)
    x_q[1, ::3] = 127
    w_q = _int8(rng, 3, 4099)
    w_q[0] = -128
    want = _linear_reference(x_q, w_q, 1.0, 1.0, None, "float32")
    assert torch.equal(hal.ops.int8_linear(x_q, w_q, 1.0, 1.0, out_dtype="float32"), want)
    assert int(want[0, 0]) == 4099 * 128 * 128


# --- NumPy arrays, dtypes, 0-d results -------------------------------------------------------------


def _numpy_call(entry, args: tuple) -> tuple[Any, Any]:
    """(result with torch tensors, result with NumPy arrays as a tensor) of one call."""
    got_np = entry(*as_numpy(args))
    assert isinstance(got_np, np.ndarray), f"{entry.op.name} returned {type(got_np).__name__} for NumPy inputs"
    return entry(*args), from_numpy(got_np)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_numpy_inputs_give_numpy_outputs(dtype, rng):
    x, scale, zp = _fake_args(rng, (3, 5), 1, -128, 127, dtype)
    q = hal.ops.quantize(x, scale, zp, 1)
    calls = [
        (hal.ops.quantize, (x, scale, zp, 1, "int8")),
        (hal.ops.dequantize, (q, scale, zp, 1)),
        (hal.ops.fake_quantize, (x, scale, zp, -128, 127, 1)),
        (hal.ops.fake_quantize_backward, (randn(rng, 3, 5, dtype=x.dtype), x, scale, zp, -128, 127, 1)),
        (hal.ops.int8_linear, (*_linear_args(rng, (4, 5), 3, "per_channel", dtype), dtype)),
    ]
    for entry, args in calls:
        want, got = _numpy_call(entry, args)
        assert dtype_name(got) == dtype_name(want) and torch.equal(got, want), entry.op.name


def test_0d_input_gives_0d_results(rng):
    x = randn(rng)
    q = hal.ops.quantize(x, 0.01, 3)
    assert isinstance(q, torch.Tensor) and q.shape == ()
    q_np = hal.ops.quantize(x.numpy(), 0.01, 3)
    assert isinstance(q_np, np.ndarray) and q_np.shape == () and q_np.dtype == np.int8
    assert hal.ops.dequantize(q, 0.01, 3).shape == ()
    assert hal.ops.fake_quantize(x, 0.01, 3).shape == ()
