"""The NumPy <-> torch views of hal.arrays and the array conversion around kernels (hal.dispatch.adapt).

Their hot paths skip the checks of the common case (a plain writeable array, a tensor torch can
view as NumPy): these tests pin what the uncommon cases still do, and that op calls with NumPy
arrays give what the same calls on tensors give.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch

import hal
from hal.arrays import BFLOAT16, from_numpy, to_numpy
from hal.plugin import Plugin


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


# --- the runner a cached plan uses for NumPy arrays into a torch kernel (hal.dispatch.adapt) -----------


def _recording_plugin(seen: list, result: Any = None, array_api: str = "torch") -> Plugin:
    """A CPU backend whose kernel of scale_shift_act (taking ``array_api``'s arrays) records what it
    receives and returns ``result(x)`` (default ``x * 2``)."""
    p = Plugin("rec" if array_api == "torch" else f"rec_{array_api}", "1.0")
    p.define_backend(priority=1000, device_types=("cpu",), array_api=array_api)

    @p.kernel("scale_shift_act", name="rec")
    def rec(x, scale, shift, act):
        seen.append((x, scale, shift, act))
        return x * 2 if result is None else result(x)

    return p


def _ptr(v: Any) -> Any:
    return v.data_ptr() if isinstance(v, torch.Tensor) else v.ctypes.data if isinstance(v, np.ndarray) else v


def test_a_cached_numpy_call_converts_exactly_its_array_slots(install_plugins) -> None:
    seen: list = []
    install_plugins([_recording_plugin(seen)])
    x, shift = _rand(3, 4), _rand(4)
    for _ in range(2):  # decided, then the cached plan
        out = hal.ops.scale_shift_act(x, 0.5, shift, "relu")
        assert type(out) is np.ndarray and np.array_equal(out, x * 2)
        got = seen.pop()
        assert [type(v) for v in got] == [torch.Tensor, float, torch.Tensor, str]
        assert (_ptr(got[0]), got[1], _ptr(got[2]), got[3]) == (x.ctypes.data, 0.5, shift.ctypes.data, "relu")  # views, no copies
    only_x = hal.ops.scale_shift_act(x, 1.0, 0.0, "none")  # numbers in the array parameters stay numbers
    assert np.array_equal(only_x, x * 2)
    assert [type(v) for v in seen.pop()] == [torch.Tensor, float, float, str]


def test_a_cached_numpy_call_copies_a_read_only_array_without_a_warning(install_plugins) -> None:
    seen: list = []
    install_plugins([_recording_plugin(seen, result=lambda x: x.add_(1))])  # a kernel writing its input
    x = _rand(3, 4)
    hal.ops.scale_shift_act(x.copy(), 1.0, 0.0, "none")  # the key's plan, decided on a writeable array
    locked = x.copy()
    locked.setflags(write=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it views a read-only array
        out = hal.ops.scale_shift_act(locked, 1.0, 0.0, "none")
    assert np.array_equal(locked, x) and np.array_equal(out, x + 1)
    assert _ptr(seen[-1][0]) != locked.ctypes.data


@pytest.mark.parametrize("result", ["bfloat16", "requires_grad", "tuple", "0-d"])
def test_results_torch_cannot_view_as_numpy_still_come_back_as_arrays(install_plugins, result: str) -> None:
    make = {
        "bfloat16": lambda x: x.to(torch.bfloat16),
        "requires_grad": lambda x: x.clone().requires_grad_(),
        "tuple": lambda x: (x + 1, x.sum()),
        "0-d": lambda x: x.sum(),
    }[result]
    install_plugins([_recording_plugin([], result=make)])
    x = _rand(3, 4)
    out = hal.ops.scale_shift_act(x, 1.0, 0.0, "none")
    want = make(torch.from_numpy(x))
    for o, w in zip(out, want) if result == "tuple" else ((out, want),):
        assert type(o) is np.ndarray and o.shape == tuple(w.shape)
        np.testing.assert_array_equal(o.astype(np.float32), w.detach().float().numpy())
    if result == "bfloat16":
        assert out.dtype == BFLOAT16


def test_the_slot_runner_leaves_uncommon_arguments_to_the_general_one() -> None:
    from hal.dispatch import adapt
    from hal.registry import get_op

    ssa, unscale = get_op("scale_shift_act"), get_op("amp_unscale_")
    kernel = lambda *a: a[0]  # noqa: E731
    x = _rand(2, 3)
    assert adapt._numpy_into_torch(ssa, kernel, (x, 1.0, 0.0, "relu")) is not None
    assert adapt._numpy_into_torch(ssa, kernel, (x, x[0], None, "relu")) is not None
    class Sub(np.ndarray):
        pass

    for uncommon in (x.astype(BFLOAT16), x[::-1], x.view(Sub)):
        assert adapt._numpy_into_torch(ssa, kernel, (uncommon, 1.0, 0.0, "relu")) is None
    assert adapt._numpy_into_torch(unscale, kernel, ([x], 0.5)) is None  # a list of arrays, an op writing them
    run = adapt._numpy_into_torch(ssa, lambda x, scale, shift, act: scale * 3, (1.0, x, 0.0, "relu"))  # one array, not first
    out = run(1.0, x, 0.0, "relu")
    assert type(out) is np.ndarray and np.array_equal(out, x * 3)


def test_a_cached_tensor_call_of_a_numpy_kernel_converts_exactly_its_tensor_slots(install_plugins) -> None:
    seen: list = []
    install_plugins([_recording_plugin(seen, array_api="numpy")])
    x, shift = torch.randn(3, 4), torch.nn.Parameter(torch.randn(4))
    with torch.no_grad():
        for _ in range(2):  # decided, then the cached plan
            out = hal.ops.scale_shift_act(x, 0.5, shift, "relu")
            assert type(out) is torch.Tensor and torch.equal(out, x * 2)
            got = seen.pop()
            assert [type(v) for v in got] == [np.ndarray, float, np.ndarray, str]
            assert (_ptr(got[0]), got[1], _ptr(got[2]), got[3]) == (x.data_ptr(), 0.5, shift.data_ptr(), "relu")  # views
        assert [type(v) for v in (hal.ops.scale_shift_act(x, 1.0, 0.0, "none"), *seen.pop())] == [torch.Tensor, np.ndarray, float, float, str]


@pytest.mark.parametrize("case", ["bfloat16", "requires_grad", "tuple", "0-d"])
def test_the_tensor_slot_runner_gives_what_the_general_runner_gives(case: str) -> None:
    from hal.dispatch import adapt
    from hal.registry import get_op

    ssa = get_op("scale_shift_act")
    kernel = {
        "bfloat16": lambda x, *_: x * 2,  # a bfloat16 tensor torch cannot view: hal.arrays.to_numpy's view
        "requires_grad": lambda x, *_: x * 2,  # grad mode on: Tensor.numpy refuses it
        "tuple": lambda x, *_: (x + 1, None, x.sum()),
        "0-d": lambda x, *_: x.sum(),
    }[case]
    x = torch.randn(3, 4, dtype=torch.bfloat16 if case == "bfloat16" else torch.float32, requires_grad=case == "requires_grad")
    args = (x, 1.0, 0.0, "none")
    run = adapt._torch_into_numpy(ssa, kernel, args)
    assert run is not None
    got, want = run(*args), adapt._array_api(ssa, kernel, "numpy", "torch")(*args)
    for g, w in zip(got, want) if case == "tuple" else ((got, want),):
        assert type(g) is type(w)
        if w is not None:
            assert g.dtype == w.dtype and torch.equal(g, w)


def test_the_tensor_slot_runner_leaves_uncommon_arguments_to_the_general_one() -> None:
    from hal.dispatch import adapt
    from hal.registry import get_op

    ssa, unscale = get_op("scale_shift_act"), get_op("amp_unscale_")
    kernel = lambda *a: a[0]  # noqa: E731
    x = torch.randn(2, 3)
    assert adapt._torch_into_numpy(ssa, kernel, (1.0, 2.0, 0.0, "relu")) is None  # no tensor to convert
    assert adapt._torch_into_numpy(ssa, kernel, (x.as_subclass(torch.nn.Buffer), 1.0, 0.0, "relu")) is None
    assert adapt._torch_into_numpy(unscale, kernel, ([x], 0.5)) is None  # a list of tensors, an op writing them


def test_uncommon_numpy_arrays_give_what_tensors_give() -> None:
    x = _rand(6, 5)
    for view in (x[::-1], x.astype(BFLOAT16), x.T):
        out = hal.ops.softmax(view, -1)
        want = hal.ops.softmax(from_numpy(view), -1)
        assert type(out) is np.ndarray and out.dtype == view.dtype
        np.testing.assert_array_equal(out.astype(np.float32), want.float().numpy())
