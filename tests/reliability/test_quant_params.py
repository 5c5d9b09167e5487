"""Tensor-valued quantisation parameters, property-based: every value is checked on every call.

Scales and zero points given as arrays (NumPy or torch, 0-d or 1-d, per tensor or per channel, of
each accepted dtype) with values drawn valid or not: scales of 0, below 0, NaN, infinite;
zero points out of the quantised range, fractional (float32), huge (int64 2**33, which int32 math
would wrap to 0). Every op taking them (quantize, dequantize, fake_quantize and its backward,
int8_linear) must raise ``hal.InvalidArgumentError`` naming the first bad argument, or, with valid
values, return what torch returns. The decision cache keys arrays by shape and dtype only, so each
call is made twice: once with valid values (filling the cache), then with the drawn ones.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hal
from hal.arrays import to_numpy

from .calls import outcome

QRANGE = {"int8": (-128, 127), "uint8": (0, 255)}
BAD_SCALES = [0.0, -0.02, math.nan, math.inf, -math.inf]
ZP_DTYPES = [torch.int8, torch.uint8, torch.int32, torch.int64, torch.float32]


@st.composite
def qparam_calls(draw: st.DrawFn) -> dict[str, Any]:
    op = draw(st.sampled_from(["quantize", "dequantize", "fake_quantize", "fake_quantize_backward", "int8_linear"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    channels = draw(st.integers(1, 5))
    per_channel = op != "int8_linear" and draw(st.booleans())
    n = channels if per_channel else 1
    qtype = draw(st.sampled_from(["int8", "uint8"])) if op in ("quantize", "dequantize") else "int8"
    qmin, qmax = QRANGE[qtype] if op != "int8_linear" else (-128, 127)
    if op.startswith("fake"):
        qmin = draw(st.integers(-128, 0))
        qmax = draw(st.integers(qmin + 1, 127))

    scale = rng.uniform(0.01, 0.1, n)
    bad_scale = draw(st.sampled_from([None] * 3 + BAD_SCALES))
    if bad_scale is not None:
        scale[draw(st.integers(0, n - 1))] = bad_scale
    zp_dtype = draw(st.sampled_from(ZP_DTYPES))
    lo, hi = max(qmin, _lowest(zp_dtype)), min(qmax, _highest(zp_dtype))
    zp = rng.integers(lo, hi, n, endpoint=True).astype(np.float64) if lo <= hi else np.zeros(n)
    bad_zp: Optional[float] = None
    if lo <= hi:
        bad_zp = draw(st.sampled_from([None, None, qmax + 1.0, qmin - 1.0, 300.0, -200.0, 2.0**33, 2.5]))
        if bad_zp is not None and not _fits(bad_zp, zp_dtype):
            bad_zp = None  # e.g. 2.5 in an integer dtype, 300 in int8: not a value of that dtype
        if bad_zp is not None:
            zp[draw(st.integers(0, n - 1))] = bad_zp
    zp_valid = lo <= hi and (bad_zp is None or qmin <= bad_zp <= qmax and float(bad_zp).is_integer())
    shape_0d = not per_channel and draw(st.booleans())
    return {
        "op": op, "rng": rng, "channels": channels, "per_channel": per_channel, "qtype": qtype, "qmin": qmin, "qmax": qmax,
        "scale": scale.reshape(()) if shape_0d else scale, "zp": zp.reshape(()) if shape_0d else zp, "zp_dtype": zp_dtype,
        "numpy": draw(st.booleans()), "scale_valid": bad_scale is None, "zp_valid": zp_valid,
    }


def _lowest(dtype: torch.dtype) -> int:
    return -(2**31) if dtype == torch.float32 else int(torch.iinfo(dtype).min)


def _highest(dtype: torch.dtype) -> int:
    return 2**31 - 1 if dtype == torch.float32 else int(torch.iinfo(dtype).max)


def _fits(v: float, dtype: torch.dtype) -> bool:
    if dtype == torch.float32:
        return True
    return float(v).is_integer() and _lowest(dtype) <= v <= _highest(dtype)


def _arrays(c: dict[str, Any], scale: np.ndarray, zp: np.ndarray) -> dict[str, Any]:
    """The op's arguments (torch, or NumPy when drawn so)."""
    rng, ch = c["rng"], c["channels"]
    s = torch.tensor(scale, dtype=torch.float32)
    z = torch.tensor(zp).to(c["zp_dtype"])
    axis = 1 if c["per_channel"] else None
    x = torch.from_numpy(rng.standard_normal((3, ch))).float()
    op = c["op"]
    if op == "quantize":
        args = dict(x=x, scale=s, zero_point=z, axis=axis, dtype=c["qtype"])
    elif op == "dequantize":
        q = torch.from_numpy(rng.integers(*QRANGE[c["qtype"]], (3, ch), endpoint=True)).to(getattr(torch, c["qtype"]))
        args = dict(q=q, scale=s, zero_point=z, axis=axis)
    elif op == "fake_quantize":
        args = dict(x=x, scale=s, zero_point=z, quant_min=c["qmin"], quant_max=c["qmax"], axis=axis)
    elif op == "fake_quantize_backward":
        args = dict(grad_out=torch.randn_like(x), x=x, scale=s, zero_point=z, quant_min=c["qmin"], quant_max=c["qmax"], axis=axis)
    else:
        xq = torch.from_numpy(rng.integers(-127, 127, (4, 8))).to(torch.int8)
        wq = torch.from_numpy(rng.integers(-127, 127, (ch, 8))).to(torch.int8)
        args = dict(x_q=xq, w_q=wq, x_scale=s.reshape(-1)[:1].reshape(()), w_scale=s, bias=None, out_dtype="float32")
    if c["numpy"]:
        args = {k: to_numpy(v).copy() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    return args


def _torch_result(op: str, args: dict[str, Any]) -> Optional[torch.Tensor]:
    """torch's own result where torch has the op (fake_quantize), else None."""
    if op != "fake_quantize":
        return None
    t = {k: torch.as_tensor(v) if isinstance(v, np.ndarray) else v for k, v in args.items()}
    if t["axis"] is None:
        return torch.fake_quantize_per_tensor_affine(t["x"], t["scale"].reshape(()), t["zero_point"].reshape(()).int(), t["quant_min"], t["quant_max"])
    return torch.fake_quantize_per_channel_affine(t["x"], t["scale"], t["zero_point"].int(), 1, t["quant_min"], t["quant_max"])


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(c=qparam_calls())
def test_tensor_qparams_are_validated_on_every_call(c: dict[str, Any]) -> None:
    fn = getattr(hal.ops, c["op"])
    good_scale = np.full(np.shape(c["scale"]), 0.05)
    lo = max(c["qmin"], _lowest(c["zp_dtype"]))
    good_zp = np.full(np.shape(c["zp"]), float(lo if lo <= min(c["qmax"], _highest(c["zp_dtype"])) else 0))
    if c["op"] == "int8_linear" or lo <= min(c["qmax"], _highest(c["zp_dtype"])):
        how, _ = outcome(lambda: fn(**_arrays(c, good_scale, good_zp)))
        assert how == "result"  # the same signature is now in the decision cache
    args = _arrays(c, c["scale"], c["zp"])
    how, value = outcome(lambda: fn(**args))
    uses_zp = c["op"] != "int8_linear"
    if not c["scale_valid"]:
        assert how == "hal_error" and isinstance(value, hal.InvalidArgumentError), value
        assert value.arg in ("scale", "w_scale", "x_scale"), value
    elif uses_zp and not c["zp_valid"]:
        assert how == "hal_error" and isinstance(value, hal.InvalidArgumentError) and value.arg == "zero_point", value
    else:
        assert how == "result", value
        want = _torch_result(c["op"], args)
        if want is not None:
            torch.testing.assert_close(torch.as_tensor(value), want, rtol=0, atol=0)


@pytest.mark.parametrize("per_channel", [False, True])
def test_issue_examples(per_channel: bool) -> None:
    """The examples of issue 12: scale 0, NaN, below 0; zero points 300 and 2.5 for int8; an int64
    zero point of 2**33 (which wrapped to 0)."""
    x = torch.randn(4, 3)
    axis, n = (1, 3) if per_channel else (None, 1)
    shape = (n,) if per_channel else ()
    for scale, zp, bad in [
        (0.0, 0, "scale"), (math.nan, 0, "scale"), (-0.1, 0, "scale"),
        (0.1, 300, "zero_point"), (0.1, 2.5, "zero_point"), (0.1, 2**33, "zero_point"),
    ]:
        s = torch.full(shape, scale)
        z = torch.full(shape, zp, dtype=torch.float32 if zp == 2.5 else torch.int64)
        for op in ("quantize", "fake_quantize"):
            with pytest.raises(hal.InvalidArgumentError, match=f"argument '{bad}'"):
                getattr(hal.ops, op)(x, s, z, axis=axis)


@pytest.mark.parametrize("axis", [None, 1])
def test_fake_quantize_of_nan_matches_torch(axis: Optional[int]) -> None:
    x = torch.randn(4, 6)
    x[0, ::2] = math.nan
    if axis is None:
        got, want = hal.ops.fake_quantize(x, 0.1, 3, -20, 20), torch.fake_quantize_per_tensor_affine(x, 0.1, 3, -20, 20)
        x[1, 0], x[1, 1] = math.inf, -math.inf  # per tensor, torch saturates infinities
        got, want = hal.ops.fake_quantize(x, 0.1, 3, -20, 20), torch.fake_quantize_per_tensor_affine(x, 0.1, 3, -20, 20)
    else:
        s, z = torch.full((6,), 0.1), torch.full((6,), 3, dtype=torch.int32)
        got, want = hal.ops.fake_quantize(x, s, z, -20, 20, 1), torch.fake_quantize_per_channel_affine(x, s, z, 1, -20, 20)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.isfinite(got).all()
