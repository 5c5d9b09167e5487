"""cpu_ref's layer_norm and rms_norm, and their backwards, against PyTorch in float64 (and
hal_torch's versions)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from refcheck import (
    LOW_PRECISION,
    assert_all_close64,
    canonical,
    check_in_dtype,
    randn,
    vjp,
)

import hal
from hal_torch.table import eager

#: (id, x shape, normalized_shape, affine parameters, non-contiguous x)
CASES = [
    ("last_dim", (8, 17), (17,), True, False),
    ("prime_3d", (3, 7, 13), (13,), True, False),
    ("two_dims", (2, 5, 7, 11), (7, 11), True, False),
    ("whole_tensor", (6, 10), (6, 10), True, False),
    ("long_reduction", (2, 4099), (4099,), True, False),
    ("size_one", (5, 1), (1,), True, False),
    ("no_affine", (4, 9), (9,), False, False),
    ("non_contiguous", (4, 13), (13,), True, True),
]
IDS = [c[0] for c in CASES]


def _x(rng, shape, transposed):
    """x of ``shape``; a transposed (non-contiguous) view when asked."""
    if transposed:
        x = randn(rng, *reversed(shape)).T
        assert not x.is_contiguous()
        return x
    return randn(rng, *shape)


def _layer_args(rng, shape, normalized_shape, affine, transposed):
    x = _x(rng, shape, transposed)
    w = randn(rng, *normalized_shape) if affine else None
    b = randn(rng, *normalized_shape) if affine else None
    return x, w, b


def _layer_grads(grad_out, x, normalized_shape, weight, eps):
    """(grad_x, grad_weight, grad_bias) by autograd; a missing weight is ones, a missing bias zeros."""
    w = torch.ones(normalized_shape, dtype=x.dtype) if weight is None else weight
    b = torch.zeros(normalized_shape, dtype=x.dtype)
    return vjp(lambda x_, w_, b_: F.layer_norm(x_, normalized_shape, w_, b_, eps), (x, w, b), grad_out)


def _rms_grads(grad_out, x, normalized_shape, weight, eps):
    """(grad_x, grad_weight) by autograd; a missing weight is ones."""
    w = torch.ones(normalized_shape, dtype=x.dtype) if weight is None else weight
    return vjp(lambda x_, w_: F.rms_norm(x_, normalized_shape, w_, eps), (x, w), grad_out)


@pytest.mark.parametrize("eps", [1e-5, 0.1])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_layer_norm(case, eps, rng):
    _, shape, ns, affine, transposed = case
    x, w, b = _layer_args(rng, shape, ns, affine, transposed)
    want = F.layer_norm(x, ns, w, b, eps)
    assert_all_close64(hal.ops.layer_norm(x, list(ns), w, b, eps), want)
    assert_all_close64(eager("layer_norm")(*canonical(hal.ops.layer_norm, x, ns, w, b, eps)), want)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_layer_norm_backward(case, rng):
    _, shape, ns, affine, transposed = case
    x, w, _ = _layer_args(rng, shape, ns, affine, transposed)
    g = randn(rng, *shape)
    want = _layer_grads(g, x, ns, w, 1e-5)
    assert_all_close64(hal.ops.layer_norm_backward(g, x, ns, w), want)
    assert_all_close64(eager("layer_norm_backward")(*canonical(hal.ops.layer_norm_backward, g, x, ns, w)), want)


@pytest.mark.parametrize("eps", [None, 1e-3])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_rms_norm(case, eps, rng):
    _, shape, ns, affine, transposed = case
    x, w, _ = _layer_args(rng, shape, ns, affine, transposed)
    want = F.rms_norm(x, ns, w, eps)
    assert_all_close64(hal.ops.rms_norm(x, ns, w, eps), want)
    assert_all_close64(eager("rms_norm")(*canonical(hal.ops.rms_norm, x, ns, w, eps)), want)


@pytest.mark.parametrize("eps", [None, 1e-3])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_rms_norm_backward(case, eps, rng):
    _, shape, ns, affine, transposed = case
    x, w, _ = _layer_args(rng, shape, ns, affine, transposed)
    g = randn(rng, *shape)
    want = _rms_grads(g, x, ns, w, torch.finfo(x.dtype).eps if eps is None else eps)
    assert_all_close64(hal.ops.rms_norm_backward(g, x, ns, w, eps), want)
    assert_all_close64(eager("rms_norm_backward")(*canonical(hal.ops.rms_norm_backward, g, x, ns, w, eps)), want)


def test_rms_norm_default_eps_is_torchs(rng):
    """eps None is the machine epsilon of the dtype torch computes in: float64's for float64,
    float32's for float32 and for half precision (upcast to float32 first)."""
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        x = randn(rng, 3, 4, dtype=dtype)
        want = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
        assert canonical(hal.ops.rms_norm, x, 4)[-1] == want


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rms_norm_default_eps_matches_torch_on_small_half_inputs(dtype, rng):
    """Inputs of magnitude 1e-3 have mean(x^2) ~ 1e-6: an eps of float16's epsilon (9.8e-4) would
    shrink the result ~30-fold; torch's (float32's) leaves it unit scale."""
    x = (randn(rng, 8, 64) * 1e-3).to(dtype)
    got, want = hal.ops.rms_norm(x, (64,)), F.rms_norm(x, (64,))
    assert want.float().abs().mean() > 0.5  # unit scale: the eps does not dominate
    torch.testing.assert_close(got.float(), want.float(), atol=0.0, rtol=2 * torch.finfo(dtype).eps)


@pytest.mark.parametrize(
    "normalized_shape, weight, match",
    [
        ((5,), (4, torch.float64), r"argument 'x' must be .*normalized_shape \(5,\)"),
        ((4,), (3, torch.float64), r"argument 'weight' must be of shape \(4,\)"),
        ((4,), (4, torch.float32), r"argument 'weight' must be of the same dtype as 'x'"),
    ],
    ids=["shape_mismatch", "weight_shape", "weight_dtype"],
)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_bad_arguments_name_the_argument(op, normalized_shape, weight, match, rng):
    x, w = randn(rng, 2, 3, 4), randn(rng, weight[0], dtype=weight[1])
    with pytest.raises(hal.InvalidArgumentError, match=match):
        getattr(hal.ops, op)(x, normalized_shape, w)


# --- every op of the family in every dtype, with torch and NumPy arrays ---------------------------


def _sample_layer_norm(rng):
    x, w, b = _layer_args(rng, (3, 2, 33), (2, 33), True, False)
    return hal.ops.layer_norm, (x, (2, 33), w, b), F.layer_norm


def _sample_layer_norm_backward(rng):
    x, w, _ = _layer_args(rng, (5, 33), (33,), True, False)
    return hal.ops.layer_norm_backward, (randn(rng, 5, 33), x, (33,), w, 1e-5), _layer_grads


def _sample_rms_norm(rng):
    x, w, _ = _layer_args(rng, (4, 3, 33), (33,), True, False)
    return hal.ops.rms_norm, (x, (33,), w, 1e-6), F.rms_norm


def _sample_rms_norm_backward(rng):
    x, _, _ = _layer_args(rng, (5, 2, 9), (2, 9), False, False)
    return hal.ops.rms_norm_backward, (randn(rng, 5, 2, 9), x, (2, 9), None, 1e-6), _rms_grads


SAMPLES = {
    "layer_norm": _sample_layer_norm,
    "layer_norm_backward": _sample_layer_norm_backward,
    "rms_norm": _sample_rms_norm,
    "rms_norm_backward": _sample_rms_norm_backward,
}


@pytest.mark.parametrize("array", ["torch", "numpy"])
@pytest.mark.parametrize("dtype", ["float64", *LOW_PRECISION])
@pytest.mark.parametrize("op", list(SAMPLES))
def test_dtypes_and_array_types(op, dtype, array, rng):
    check_in_dtype(SAMPLES[op], dtype, array, rng)
