"""The CPU backend's NumPy kernel of scale_shift_act: a bare relu (or copy) of a NumPy caller's small
array runs NumPy's own ufunc, with no torch tensor made on the way in or out; torch callers, larger
arrays and real affines keep torch's kernels. The conformance suite draws torch tensors, which this
kernel declines, so its values are checked here against cpu_ref on the suite's kind of data."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hal_backend_cpu.elementwise import NUMPY_ELEMENTS

import hal
from hal.arrays import numpy_dtype

SPECIALS = [math.inf, -math.inf, math.nan, -0.0, 0.0, 1e-40, -1e-40, 3.5, -2.0, 65504.0]


@pytest.mark.parametrize("act", ["relu", "none"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_a_bare_activation_of_a_small_numpy_array_is_numpys_and_matches_cpu_ref(act: str, dtype: str, rng: np.random.Generator) -> None:
    x = np.concatenate([np.array(SPECIALS), rng.standard_normal(90) * 4]).astype(numpy_dtype(dtype)).reshape(4, 25)
    before = x.copy()
    d = hal.explain("scale_shift_act", x, 1.0, 0.0, act)
    assert (d.backend, d.kernel) == ("cpu", "numpy"), d
    out = hal.ops.scale_shift_act(x, 1.0, 0.0, act)
    with hal.use(backend="cpu_ref"):
        want = hal.ops.scale_shift_act(x, 1.0, 0.0, act)
    assert type(out) is np.ndarray and out.dtype == x.dtype and out.shape == x.shape
    assert not np.shares_memory(out, x) and np.array_equal(x, before, equal_nan=True)
    # exact: NaN where the reference has NaN, every other element equal (zeros of either sign, as NumPy's maximum gives them)
    np.testing.assert_array_equal(out.astype(np.float64), want.astype(np.float64))
    assert hal.stats()[("scale_shift_act", "cpu", "numpy")]["calls"] >= 1


def test_layouts_and_zero_dimensions_are_kept(rng: np.random.Generator) -> None:
    x = rng.standard_normal((6, 8)).astype(np.float32).T  # Fortran order
    for act in ("relu", "none"):
        out = hal.ops.scale_shift_act(x, 1, 0, act)  # ints are numbers too
        assert out.strides == x.strides, act
        np.testing.assert_array_equal(out, np.maximum(x, 0) if act == "relu" else x)
    scalar = hal.ops.scale_shift_act(np.array(-3.0, dtype=np.float32), 1.0, 0.0, "relu")
    assert type(scalar) is np.ndarray and scalar.shape == () and scalar == 0.0
    assert hal.explain("scale_shift_act", np.array(-3.0, dtype=np.float32), 1.0, 0.0, "relu").kernel == "numpy"


def test_torch_callers_large_arrays_and_real_affines_keep_torchs_kernels(rng: np.random.Generator) -> None:
    x = rng.standard_normal((4, 16)).astype(np.float32)
    d = hal.explain("scale_shift_act", torch.from_numpy(x), 1.0, 0.0, "relu")
    assert d.kernel == "torch", d
    (numpy,) = [c for c in d.candidates if (c.backend, c.kernel) == ("cpu", "numpy")]
    assert numpy.reasons == ["torch tensors: torch's kernel runs them without converting (this kernel is NumPy's own, for NumPy callers)"]
    big = rng.standard_normal(NUMPY_ELEMENTS + 1).astype(np.float32)
    d = hal.explain("scale_shift_act", big, 1.0, 0.0, "relu")
    assert d.kernel == "torch" and any(f"beyond {NUMPY_ELEMENTS}" in r for c in d.candidates for r in c.reasons), d
    for scale, shift, act in ((2.0, 0.0, "relu"), (1.0, 0.5, "relu"), (1.0, 0.0, "gelu"), (np.ones(16, np.float32), 0.0, "relu")):
        assert hal.explain("scale_shift_act", x, scale, shift, act).kernel != "numpy", (scale, shift, act)
    with pytest.raises(hal.UnsupportedError, match="torch tensors: torch's kernel runs them without converting"):
        with hal.use(backend="cpu", kernel={"scale_shift_act": "numpy"}):
            hal.ops.scale_shift_act(torch.from_numpy(x), 1.0, 0.0, "relu")
