"""The CPU backend's numba kernels for small calls (issue 41 item 13): softmax of a NumPy caller's
small array (no torch tensor made), and linear + GELU as MKL's GEMM followed by numba's vectorised
GELU. Each is checked on fresh random data with NaN and infinities against the float64 reference
(cpu_ref) and torch, and where it is chosen and where it declines, with the reasons ``hal.explain``
prints. The suite runs with HAL_TUNE=off: the choice is by priority, as without a tune cache."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hal_backend_cpu import _numba
from hal_backend_cpu.attention import NUMBA_SOFTMAX_ELEMENTS
from hal_backend_cpu.gemm import NUMBA_GELU_ELEMENTS

import hal

pytestmark = pytest.mark.skipif(_numba.unavailable_reason() is not None, reason="numba is not usable here")

SPECIALS = np.array([math.inf, -math.inf, math.nan, 0.0, -0.0, 60.0, -60.0, 1e30, -1e30])


def _with_specials(rng: np.random.Generator, shape: tuple[int, ...], dtype: type, share: float = 0.15) -> np.ndarray:
    x = rng.standard_normal(shape) * 3
    hit = rng.random(shape) < share
    x[hit] = rng.choice(SPECIALS, size=int(hit.sum()))
    return x.astype(dtype)


def _shape_and_dim(rng: np.random.Generator) -> tuple[tuple[int, ...], int]:
    while True:
        ndim = int(rng.integers(1, 5))
        shape = tuple(int(s) for s in rng.integers(1, 7, size=ndim))
        if int(np.prod(shape)) <= NUMBA_SOFTMAX_ELEMENTS:
            return shape, int(rng.integers(-ndim, ndim))


# --- softmax ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_numpy_callers_small_softmax_is_numbas_and_matches_torch_and_cpu_ref(dtype: type, rng: np.random.Generator) -> None:
    for _ in range(40):
        shape, dim = _shape_and_dim(rng)
        x = _with_specials(rng, shape, dtype)
        before = x.copy()
        d = hal.explain("softmax", x, dim)
        assert (d.backend, d.kernel) == ("cpu", "numba"), d
        out = hal.ops.softmax(x, dim)
        assert type(out) is np.ndarray and out.dtype == x.dtype and out.shape == x.shape and out.flags.c_contiguous
        assert not np.shares_memory(out, x) and np.array_equal(x, before, equal_nan=True)
        theirs = torch.softmax(torch.from_numpy(x), dim).numpy()
        with hal.use(backend="cpu_ref"):
            want = hal.ops.softmax(x, dim)
        for ref in (theirs, want):  # NaN exactly where torch and the reference have it, the rest within float32's softmax tolerance
            np.testing.assert_array_equal(np.isnan(out), np.isnan(ref), err_msg=f"{shape} dim {dim}\n{x}")
            np.testing.assert_allclose(out, ref, rtol=2e-5, atol=1e-5 * math.sqrt(shape[dim]), equal_nan=True)
    assert hal.stats()[("softmax", "cpu", "numba")]["calls"] >= 40


def test_every_element_of_the_softmax_is_written(rng: np.random.Generator) -> None:
    """The lines kernel on a poisoned output: no element keeps the poison (the kernel allocates its
    own result, so its inner function is called here on a filled one)."""
    lines = _numba.family("softmax")._lines
    for outer, n, inner in ((1, 1, 1), (3, 5, 2), (2, 1, 7), (4, 16, 1)):
        x = _with_specials(rng, (outer, n, inner), np.float32)
        out = np.full_like(x, 12345.0)
        lines(x, out)
        assert not (out == 12345.0).any()
        want = torch.softmax(torch.from_numpy(x), 1).numpy()
        np.testing.assert_allclose(out, want, rtol=2e-5, atol=1e-5 * math.sqrt(n), equal_nan=True)


def test_torch_callers_large_strided_and_0d_arrays_keep_torchs_softmax(rng: np.random.Generator) -> None:
    x = rng.standard_normal((4, 8)).astype(np.float32)
    d = hal.explain("softmax", torch.from_numpy(x), 1)
    assert d.kernel == "torch", d
    (numba,) = [c for c in d.candidates if (c.backend, c.kernel) == ("cpu", "numba")]
    assert numba.reasons == ["torch tensors: torch's kernel runs them without converting (this kernel is NumPy's own, for NumPy callers)"]
    big = rng.standard_normal((2, NUMBA_SOFTMAX_ELEMENTS // 2 + 1)).astype(np.float32)
    d = hal.explain("softmax", big, 1)
    assert d.kernel == "torch" and any(f"beyond {NUMBA_SOFTMAX_ELEMENTS}" in r for c in d.candidates for r in c.reasons), d
    strided = rng.standard_normal((8, 4)).astype(np.float32).T
    assert hal.explain("softmax", strided, 0).kernel == "torch"
    np.testing.assert_allclose(hal.ops.softmax(strided, 0), torch.softmax(torch.from_numpy(strided), 0).numpy(), rtol=1e-6)
    assert hal.explain("softmax", np.array(2.0, np.float32), 0).kernel == "torch"
    assert hal.explain("softmax", x.astype(np.float16), 1).kernel == "torch"  # numba has no float16 arithmetic


# --- linear + GELU ------------------------------------------------------------------------------


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh"])
def test_a_small_float32_linear_with_gelu_is_numbas_and_matches_cpu_ref(act: str, rng: np.random.Generator) -> None:
    for trial in range(12):
        m, k, n = (int(v) for v in rng.integers(1, 130, size=3))
        lead = (m,) if trial % 3 else (2, (m + 1) // 2)
        x = torch.from_numpy(_with_specials(rng, (*lead, k), np.float32, share=0.002))
        w = torch.from_numpy((rng.standard_normal((n, k)) / math.sqrt(k)).astype(np.float32))
        b = None if trial % 4 == 1 else torch.from_numpy(rng.standard_normal(n).astype(np.float32))
        d = hal.explain("linear", x, w, b, act)
        assert (d.backend, d.kernel) == ("cpu", "numba"), d
        out = hal.ops.linear(x, w, b, act)
        with hal.use(backend="cpu_ref"):
            want = hal.ops.linear(x.double(), w.double(), None if b is None else b.double(), act)
        assert out.dtype == torch.float32 and out.shape == (*lead, n)
        np.testing.assert_array_equal(out.isnan().numpy(), want.isnan().numpy())
        torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=1e-5 * math.sqrt(k), equal_nan=True)
    assert hal.stats()[("linear", "cpu", "numba")]["calls"] >= 12


@pytest.mark.parametrize("name,approximate", [("gelu_erf_", "none"), ("gelu_tanh_", "tanh")])
def test_numbas_gelu_against_float64_over_the_whole_range(name: str, approximate: str, rng: np.random.Generator) -> None:
    """Every element written in place, within 2e-6 of the float64 GELU (torch's own float32 GELU is
    1.1e-6 off near -3.5); +inf gives +inf, -inf and NaN give NaN, as the float64 function."""
    x = np.concatenate([rng.uniform(-12, 12, 200_000), rng.standard_normal(100_000) * 4, rng.uniform(-1e-3, 1e-3, 1000),
                        [math.inf, -math.inf, math.nan, 0.0, -0.0, 3e38, -3e38, 1e-40]]).astype(np.float32)
    y = x.copy()
    getattr(_numba.family("gelu"), name)(y)
    want = F.gelu(torch.from_numpy(x).double(), approximate=approximate).numpy()
    np.testing.assert_array_equal(np.isnan(y), np.isnan(want))
    np.testing.assert_allclose(y.astype(np.float64), want, rtol=1e-5, atol=2e-6, equal_nan=True)
    assert y[-8] == math.inf and np.isnan(y[-7]) and np.isnan(y[-6])


def test_linear_with_gelu_trains_through_the_numba_forward(rng: np.random.Generator) -> None:
    x = torch.from_numpy(rng.standard_normal((16, 24)).astype(np.float32)).requires_grad_(True)
    w = torch.from_numpy((rng.standard_normal((8, 24)) / 5).astype(np.float32)).requires_grad_(True)
    b = torch.from_numpy(rng.standard_normal(8).astype(np.float32)).requires_grad_(True)
    g = torch.from_numpy(rng.standard_normal((16, 8)).astype(np.float32))
    ours = torch.autograd.grad(hal.ops.linear(x, w, b, "gelu"), (x, w, b), g)
    theirs = torch.autograd.grad(F.gelu(F.linear(x, w, b)), (x, w, b), g)
    for a, t in zip(ours, theirs):
        torch.testing.assert_close(a, t, rtol=1e-4, atol=1e-5)


def test_other_linears_keep_their_kernels(rng: np.random.Generator) -> None:
    x = torch.from_numpy(rng.standard_normal((16, 32)).astype(np.float32))
    w = torch.from_numpy(rng.standard_normal((8, 32)).astype(np.float32))
    for act in ("none", "relu", "silu", "tanh"):
        d = hal.explain("linear", x, w, None, act)
        assert d.kernel != "numba", d
    assert hal.explain("linear", x.double(), w.double(), None, "gelu").kernel != "numba"
    rows = NUMBA_GELU_ELEMENTS // 8 + 1
    big = torch.from_numpy(rng.standard_normal((rows, 32)).astype(np.float32))
    d = hal.explain("linear", big, w, None, "gelu")
    assert d.kernel != "numba" and any(f"beyond {NUMBA_GELU_ELEMENTS}" in r for c in d.candidates for r in c.reasons), d
