"""The NumPy <-> torch views of hal.arrays and the array conversion around kernels (hal.dispatch.adapt).

Their hot paths skip the checks of the common case (a plain writeable array, a tensor torch can
view as NumPy): these tests pin what the uncommon cases still do, and that op calls with NumPy
arrays give what the same calls on tensors give.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import hal
from hal.arrays import BFLOAT16, from_numpy, to_numpy


def _rand(*shape: int) -> np.ndarray:
    return np.random.default_rng().standard_normal(shape).astype(np.float32)


def test_to_numpy_views_plain_and_grad_tensors_without_copying() -> None:
    t = torch.from_numpy(_rand(3, 4))
    assert np.shares_memory(to_numpy(t), t.numpy())
    g = t.clone().requires_grad_(True)
    out = to_numpy(g)
    assert np.array_equal(out, t.numpy())
    assert out.ctypes.data == g.data_ptr()


def test_to_numpy_resolves_lazy_conjugate_and_negative_views() -> None:
    c = torch.randn(5, dtype=torch.complex64)
    assert np.array_equal(to_numpy(c.conj()), np.conj(c.numpy()))
    x = torch.randn(5)
    assert np.array_equal(to_numpy(torch._neg_view(x)), -x.numpy())


def test_to_numpy_gives_bfloat16_as_ml_dtypes_without_copying() -> None:
    t = torch.randn(6).to(torch.bfloat16)
    out = to_numpy(t)
    assert out.dtype == BFLOAT16 and out.ctypes.data == t.data_ptr()
    assert np.array_equal(out.astype(np.float32), t.float().numpy())


def test_to_numpy_of_a_meta_tensor_keeps_torchs_error() -> None:
    with pytest.raises(TypeError, match="meta"):
        to_numpy(torch.empty(2, device="meta"))


def test_from_numpy_views_a_writeable_array() -> None:
    a = _rand(4, 3)
    t = from_numpy(a)
    t[0, 0] = 7.0
    assert a[0, 0] == 7.0


def test_from_numpy_copies_read_only_arrays_without_a_warning() -> None:
    a = _rand(4, 3)
    a.setflags(write=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it views a read-only array
        t = from_numpy(a)
    assert np.array_equal(t.numpy(), a) and t.data_ptr() != a.ctypes.data


def test_from_numpy_copies_reversed_views() -> None:
    a = _rand(4, 3)
    for view in (a[::-1], a[:, ::-1], a[::-2, ::-1]):
        t = from_numpy(view)
        assert np.array_equal(t.numpy(), view)
        assert all(s > 0 for s in t.stride())


def test_from_numpy_keeps_torchs_error_for_byte_strided_fields() -> None:
    records = np.zeros(3, dtype=[("a", "f4"), ("b", "i1")])
    with pytest.raises(ValueError, match="strides not a multiple of the element byte size"):
        from_numpy(records["a"])


def test_from_numpy_takes_numpy_scalars_and_bfloat16() -> None:
    assert from_numpy(np.float32(2.5)).item() == 2.5
    b = _rand(5).astype(BFLOAT16)
    t = from_numpy(b)
    assert t.dtype == torch.bfloat16 and np.array_equal(t.float().numpy(), b.astype(np.float32))


@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_numpy_calls_match_tensor_calls(act: str) -> None:
    x, scale, shift = _rand(8, 16), _rand(16), _rand(16)
    out = hal.ops.scale_shift_act(x, scale, shift, act)
    want = hal.ops.scale_shift_act(*(torch.from_numpy(v) for v in (x, scale, shift)), act)
    assert type(out) is np.ndarray
    np.testing.assert_array_equal(out, want.numpy())
    number = hal.ops.scale_shift_act(x, 0.5, -0.25, act)  # numbers in the array parameters
    np.testing.assert_array_equal(number, hal.ops.scale_shift_act(torch.from_numpy(x), 0.5, -0.25, act).numpy())


def test_numpy_call_without_an_optional_array() -> None:
    x, w = _rand(4, 8), _rand(6, 8)
    out = hal.ops.linear(x, w, None, "none")
    assert type(out) is np.ndarray
    np.testing.assert_allclose(out, x @ w.T, rtol=1e-5, atol=1e-5)


def test_numpy_in_place_op_writes_the_callers_arrays() -> None:
    grads = [_rand(5), _rand(2, 3)]
    before = [g.copy() for g in grads]
    found = hal.ops.amp_unscale_(grads, 0.5)
    for g, b in zip(grads, before):
        np.testing.assert_array_equal(g, b * np.float32(0.5))
    assert float(found) == 0.0
