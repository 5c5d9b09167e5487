"""cpu_ref's scale_shift_act and its backward against PyTorch in float64 (and hal_torch's versions)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hal.ops import ACTIVATIONS
from refcheck import (
    LOW_PRECISION,
    TORCH_ACT,
    assert_all_close64,
    canonical,
    check_in_dtype,
    randn,
    vjp,
)

import hal
from hal_torch.table import eager

#: (id, x shape, scale, shift): a number, or the shape of a tensor broadcast against x.
AFFINE_CASES = [
    ("numbers_1d", (7,), 1.7, -0.3),
    ("per_channel", (2, 3, 5, 4), (3, 1, 1), (3, 1, 1)),
    ("full_and_row", (3, 5), (3, 5), (5,)),
    ("0d_tensors_batch1", (1, 6, 3), (), ()),
    ("scalar_x", (), 0.8, 0.25),
]


def _value(rng, spec):
    return spec if isinstance(spec, float) else randn(rng, *spec)


def _affine_args(rng, x_shape, scale, shift):
    # x spread to +-6 so that the activations' tails (sigmoid saturating, gelu's erf) are exercised
    return 3.0 * randn(rng, *x_shape), _value(rng, scale), _value(rng, shift)


def _reference(x, scale, shift, act):
    return TORCH_ACT[act](x * scale + shift)


def _reference_grads(grad_out, x, scale, shift, act):
    """(grad_x, grad_scale, grad_shift) by autograd, numbers becoming 0-d tensors."""
    s, b = (v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=x.dtype) for v in (scale, shift))
    return vjp(lambda x_, s_, b_: _reference(x_, s_, b_, act), (x, s, b), grad_out)


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("case", AFFINE_CASES, ids=[c[0] for c in AFFINE_CASES])
def test_scale_shift_act(case, act, rng):
    x, scale, shift = _affine_args(rng, *case[1:])
    want = _reference(x, scale, shift, act)
    assert_all_close64(hal.ops.scale_shift_act(x, scale, shift, act), want, rtol=1e-12, atol=1e-12)
    assert_all_close64(eager("scale_shift_act")(*canonical(hal.ops.scale_shift_act, x, scale, shift, act)), want)


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("case", AFFINE_CASES, ids=[c[0] for c in AFFINE_CASES])
def test_scale_shift_act_backward(case, act, rng):
    x, scale, shift = _affine_args(rng, *case[1:])
    g = randn(rng, *x.shape)
    want = _reference_grads(g, x, scale, shift, act)
    assert_all_close64(hal.ops.scale_shift_act_backward(g, x, scale, shift, act), want, rtol=1e-12, atol=1e-12)
    args = canonical(hal.ops.scale_shift_act_backward, g, x, scale, shift, act)
    assert_all_close64(eager("scale_shift_act_backward")(*args), want)


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_activation_tails_and_zero(act):
    """Far into the tails (|z| up to 40) and at exactly +-0 (relu's derivative there is 0, as in
    torch), values and derivatives agree with torch to 1e-12 relative, 1e-13 absolute: gelu_tanh's
    ``1 + tanh(u)`` cancels for z < -5 in torch's formula as in ours, so one ulp of tanh there moves
    the result by ~1e-15."""
    z = torch.cat([torch.linspace(-40.0, 40.0, 2001, dtype=torch.float64), torch.tensor([0.0, -0.0], dtype=torch.float64)])
    assert_all_close64(hal.ops.scale_shift_act(z, 1.0, 0.0, act), TORCH_ACT[act](z), rtol=1e-12, atol=1e-13)
    g = torch.ones_like(z)
    got = hal.ops.scale_shift_act_backward(g, z, 1.0, 0.0, act)[0]
    assert_all_close64(got, vjp(TORCH_ACT[act], (z,), g)[0], rtol=1e-12, atol=1e-13)


def test_non_contiguous_input(rng):
    x = randn(rng, 6, 10).T[::2]  # (5, 6), strided both ways
    scale = randn(rng, 6)
    assert not x.is_contiguous()
    assert_all_close64(hal.ops.scale_shift_act(x, scale, 0.5, "silu"), F.silu(x * scale + 0.5))
    g = randn(rng, 10, 6)[::2]  # non-contiguous grad_out too
    assert_all_close64(hal.ops.scale_shift_act_backward(g, x, scale, 0.5, "silu"), _reference_grads(g, x, scale, 0.5, "silu"))


def test_result_is_fresh(rng):
    """act="none" with scale 1 and shift 0 still returns a new array, never a view of x."""
    x = randn(rng, 4, 3).numpy()
    y = hal.ops.scale_shift_act(x, 1.0, 0.0, "none")
    assert not np.shares_memory(x, y)
    np.testing.assert_array_equal(y, x)


def test_scalar_input_gives_0d(rng):
    x = randn(rng).numpy()
    y = hal.ops.scale_shift_act(x, 2.0, 1.0, "tanh")
    assert isinstance(y, np.ndarray) and y.shape == ()
    grads = hal.ops.scale_shift_act_backward(randn(rng).numpy(), x, 2.0, 1.0, "tanh")
    assert all(isinstance(g, np.ndarray) and g.shape == () for g in grads)


# --- every op of the family in every dtype, with torch and NumPy arrays ---------------------------


def _sample_forward(rng):
    x, scale, shift = _affine_args(rng, (2, 3, 5), (3, 1), (5,))
    return hal.ops.scale_shift_act, (x, scale, shift, "gelu"), _reference


def _sample_backward(rng):
    x, scale, shift = _affine_args(rng, (2, 3, 5), (3, 1), 0.5)
    return hal.ops.scale_shift_act_backward, (randn(rng, 2, 3, 5), x, scale, shift, "gelu_tanh"), _reference_grads


SAMPLES = {"scale_shift_act": _sample_forward, "scale_shift_act_backward": _sample_backward}


@pytest.mark.parametrize("array", ["torch", "numpy"])
@pytest.mark.parametrize("dtype", ["float64", *LOW_PRECISION])
@pytest.mark.parametrize("op", sorted(SAMPLES))
def test_dtypes_and_array_types(op, dtype, array, rng):
    check_in_dtype(SAMPLES[op], dtype, array, rng)
