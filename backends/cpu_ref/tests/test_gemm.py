"""cpu_ref's linear, matmul and grouped_gemm, and their backwards, against PyTorch in float64 (and
hal_torch's versions)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hal.ops import ACTIVATIONS
from refcheck import (
    LOW_PRECISION,
    TORCH_ACT,
    as_numpy,
    assert_all_close64,
    canonical,
    check_in_dtype,
    randn,
    vjp,
)

import hal
from hal_torch.table import eager

# --- linear ----------------------------------------------------------------------------------------

#: (id, x shape, out_features, with bias)
LINEAR_CASES = [
    ("vector_x", (5,), 3, True),
    ("batch1", (1, 7), 4, False),
    ("3d_prime", (2, 3, 7), 5, True),
    ("4d_k1", (2, 1, 3, 1), 6, True),
]


def _linear_reference(x, weight, bias, act):
    return TORCH_ACT[act](F.linear(x, weight, bias))


def _linear_grads(grad_out, x, weight, bias, act):
    """(grad_x, grad_weight, grad_bias); a missing bias is a zero one, whose gradient is returned."""
    b = torch.zeros(weight.shape[0], dtype=x.dtype) if bias is None else bias
    return vjp(lambda x_, w_, b_: _linear_reference(x_, w_, b_, act), (x, weight, b), grad_out)


def _linear_args(rng, x_shape, n_out, with_bias):
    k = x_shape[-1]
    return randn(rng, *x_shape), randn(rng, n_out, k), randn(rng, n_out) if with_bias else None


@pytest.mark.parametrize("act", ["none", "relu", "gelu"])
@pytest.mark.parametrize("case", LINEAR_CASES, ids=[c[0] for c in LINEAR_CASES])
def test_linear(case, act, rng):
    x, w, b = _linear_args(rng, *case[1:])
    want = _linear_reference(x, w, b, act)
    assert_all_close64(hal.ops.linear(x, w, b, act), want)
    assert_all_close64(eager("linear")(*canonical(hal.ops.linear, x, w, b, act)), want)


@pytest.mark.parametrize("act", ["none", "relu", "gelu"])
@pytest.mark.parametrize("case", LINEAR_CASES, ids=[c[0] for c in LINEAR_CASES])
def test_linear_backward(case, act, rng):
    x, w, b = _linear_args(rng, *case[1:])
    g = randn(rng, *x.shape[:-1], w.shape[0])
    want = _linear_grads(g, x, w, b, act)
    assert_all_close64(hal.ops.linear_backward(g, x, w, b, act), want)
    assert_all_close64(eager("linear_backward")(*canonical(hal.ops.linear_backward, g, x, w, b, act)), want)


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_linear_every_activation_non_contiguous(act, rng):
    """Every epilogue, with a transposed (column-major) weight and a strided x."""
    x = randn(rng, 3, 12)[:, ::2]
    w = randn(rng, 6, 4).T
    b = randn(rng, 4)
    assert not (x.is_contiguous() or w.is_contiguous())
    assert_all_close64(hal.ops.linear(x, w, b, act), _linear_reference(x, w, b, act))
    g = randn(rng, 3, 4)
    assert_all_close64(hal.ops.linear_backward(g, x, w, b, act), _linear_grads(g, x, w, b, act))


# --- matmul ----------------------------------------------------------------------------------------

#: (id, a shape, b shape): torch.matmul's cases.
MATMUL_CASES = [
    ("dot_1d_1d", (7,), (7,)),
    ("vec_mat", (5,), (5, 3)),
    ("mat_vec", (4, 5), (5,)),
    ("mat_mat_prime", (3, 7), (7, 2)),
    ("batched", (2, 3, 4), (2, 4, 5)),
    ("broadcast_batch", (2, 1, 3, 4), (5, 4, 2)),
    ("vec_batched", (4,), (3, 4, 5)),
    ("batched_vec", (3, 5, 4), (4,)),
    ("broadcast_both", (1, 3, 4), (2, 1, 4, 5)),
]


@pytest.mark.parametrize("case", MATMUL_CASES, ids=[c[0] for c in MATMUL_CASES])
def test_matmul(case, rng):
    a, b = randn(rng, *case[1]), randn(rng, *case[2])
    want = torch.matmul(a, b)
    assert_all_close64(hal.ops.matmul(a, b), want)
    assert_all_close64(eager("matmul")(a, b), want)


@pytest.mark.parametrize("case", MATMUL_CASES, ids=[c[0] for c in MATMUL_CASES])
def test_matmul_backward(case, rng):
    a, b = randn(rng, *case[1]), randn(rng, *case[2])
    g = randn(rng, *torch.matmul(a, b).shape)
    want = vjp(torch.matmul, (a, b), g)
    assert_all_close64(hal.ops.matmul_backward(g, a, b), want)
    assert_all_close64(eager("matmul_backward")(g, a, b), want)


def test_matmul_non_contiguous(rng):
    a = randn(rng, 2, 5, 3).transpose(1, 2)  # (2, 3, 5)
    b = randn(rng, 4, 10)[:, ::2].T  # (5, 4)
    assert_all_close64(hal.ops.matmul(a, b), torch.matmul(a, b))
    g = randn(rng, 2, 4, 3).transpose(1, 2)
    assert_all_close64(hal.ops.matmul_backward(g, a, b), vjp(torch.matmul, (a, b), g))


@pytest.mark.parametrize("array", ["torch", "numpy"])
def test_dot_is_0d(array, rng):
    a, b = randn(rng, 6), randn(rng, 6)
    out = hal.ops.matmul(*(as_numpy([a, b]) if array == "numpy" else (a, b)))
    assert isinstance(out, np.ndarray if array == "numpy" else torch.Tensor)
    assert out.shape == () and out.dtype == (np.float64 if array == "numpy" else torch.float64)
    np.testing.assert_allclose(np.asarray(out), float(a @ b), rtol=1e-12)


# --- grouped_gemm ----------------------------------------------------------------------------------

#: (id, group sizes, K, N)
GROUPED_CASES = [
    ("one_group", [5], 3, 4),
    ("empty_middle", [3, 0, 4, 1], 5, 2),
    ("empty_first_last", [0, 2, 0, 3, 0], 4, 3),
    ("prime_rows", [7, 11, 13], 3, 5),
]


def _grouped_reference(x, weight, group_sizes):
    rows = torch.split(x, group_sizes.tolist())
    return torch.cat([r @ weight[g] for g, r in enumerate(rows)])


def _grouped_args(rng, sizes, k, n, index_dtype=torch.int64):
    return randn(rng, sum(sizes), k), randn(rng, len(sizes), k, n), torch.tensor(sizes, dtype=index_dtype)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("case", GROUPED_CASES, ids=[c[0] for c in GROUPED_CASES])
def test_grouped_gemm(case, index_dtype, rng):
    x, w, sizes = _grouped_args(rng, *case[1:], index_dtype)
    want = _grouped_reference(x, w, sizes)
    assert_all_close64(hal.ops.grouped_gemm(x, w, sizes), want)
    assert_all_close64(eager("grouped_gemm")(x, w, sizes), want)


@pytest.mark.parametrize("case", GROUPED_CASES, ids=[c[0] for c in GROUPED_CASES])
def test_grouped_gemm_backward(case, rng):
    x, w, sizes = _grouped_args(rng, *case[1:])
    g = randn(rng, x.shape[0], w.shape[2])
    want = vjp(lambda x_, w_: _grouped_reference(x_, w_, sizes), (x, w), g)
    got = hal.ops.grouped_gemm_backward(g, x, w, sizes)
    assert_all_close64(got, want)
    assert_all_close64(eager("grouped_gemm_backward")(g, x, w, sizes), want)
    for gi, size in enumerate(case[1]):
        if size == 0:
            assert torch.count_nonzero(got[1][gi]) == 0, f"empty group {gi} has a non-zero grad_weight"


@pytest.mark.parametrize("op", ["grouped_gemm", "grouped_gemm_backward"])
@pytest.mark.parametrize("sizes", [[2, 2], [3, 3], [4, 2, -1]], ids=["sum_short", "sum_long", "negative"])
def test_grouped_gemm_bad_group_sizes(op, sizes, rng):
    """Sizes that do not sum to x's 5 rows, or a negative size, name group_sizes in the error."""
    x, w = randn(rng, 5, 3), randn(rng, len(sizes), 3, 2)
    args = (x, w, torch.tensor(sizes)) if op == "grouped_gemm" else (randn(rng, 5, 2), x, w, torch.tensor(sizes))
    with pytest.raises(hal.InvalidArgumentError, match=r"group_sizes.*5 rows"):
        getattr(hal.ops, op)(*args)


# --- every op of the family in every dtype, with torch and NumPy arrays ---------------------------


def _sample_linear(rng):
    return hal.ops.linear, (*_linear_args(rng, (2, 3, 9), 4, True), "silu"), _linear_reference


def _sample_linear_backward(rng):
    x, w, b = _linear_args(rng, (3, 9), 4, False)
    return hal.ops.linear_backward, (randn(rng, 3, 4), x, w, b, "gelu_tanh"), _linear_grads


def _sample_matmul(rng):
    return hal.ops.matmul, (randn(rng, 2, 3, 8), randn(rng, 8, 5)), torch.matmul


def _sample_matmul_backward(rng):
    args = (randn(rng, 2, 3, 5), randn(rng, 3, 8), randn(rng, 2, 8, 5))
    return hal.ops.matmul_backward, args, lambda g, a, b: vjp(torch.matmul, (a, b), g)


def _sample_grouped(rng):
    return hal.ops.grouped_gemm, _grouped_args(rng, [2, 0, 3], 6, 4), _grouped_reference


def _sample_grouped_backward(rng):
    x, w, sizes = _grouped_args(rng, [2, 0, 3], 6, 4, torch.int32)
    reference = lambda g, x_, w_, s: vjp(lambda a, b: _grouped_reference(a, b, s), (x_, w_), g)  # noqa: E731
    return hal.ops.grouped_gemm_backward, (randn(rng, 5, 4), x, w, sizes), reference


SAMPLES = {
    "linear": _sample_linear,
    "linear_backward": _sample_linear_backward,
    "matmul": _sample_matmul,
    "matmul_backward": _sample_matmul_backward,
    "grouped_gemm": _sample_grouped,
    "grouped_gemm_backward": _sample_grouped_backward,
}


@pytest.mark.parametrize("array", ["torch", "numpy"])
@pytest.mark.parametrize("dtype", ["float64", *LOW_PRECISION])
@pytest.mark.parametrize("op", list(SAMPLES))
def test_dtypes_and_array_types(op, dtype, array, rng):
    check_in_dtype(SAMPLES[op], dtype, array, rng)
