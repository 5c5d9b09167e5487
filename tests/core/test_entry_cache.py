"""The entry's hot-path cache (:mod:`hal.dispatch.entry`) never serves a call the plan of another
signature: calls alternate between signatures that differ in one thing each (dtype, strides,
requires_grad, grad mode, device, autocast on or off, the autocast dtype, autocast on for another
device type only), so that a key missing that thing would hand the second call the first one's
cached plan. A probe plugin records which kernel ran on what, and whether autocast was on inside
it; each call is checked against what its own signature takes, after the cache is warm for the
others.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hal
from hal.plugin import Plugin
from hal.plugin_sdk.kept import armed

#: (kernel, dtype of x, device type of x, x contiguous, autocast on for the CPU inside the kernel,
#: run by hal's autograd node)
SEEN: list[tuple[str, torch.dtype, str, bool, bool, bool]] = []


def _record(kernel: str, x: torch.Tensor) -> None:
    SEEN.append((kernel, x.dtype, x.device.type, x.is_contiguous(), torch.is_autocast_enabled("cpu"), armed()))


def _contiguous_only(inputs: Any) -> list[str]:
    return [] if inputs["x"].is_contiguous() else ["x not contiguous"]


def _float32_only(inputs: Any) -> list[str]:
    return [] if inputs["x"].dtype == torch.float32 else ["x not float32"]


def _plugin() -> Plugin:
    p = Plugin("entry_cache_probe", "1.0")
    p.define_backend(priority=1000, device_types=("cpu",), array_api="torch")

    @p.kernel("softmax", name="contiguous_f32", priority=20, check=lambda i: _contiguous_only(i) + _float32_only(i))
    def softmax_contiguous(x, dim):
        _record("contiguous_f32", x)
        with torch.no_grad():  # nothing recorded here: a result with a grad_fn came from hal's node
            return torch.softmax(x, dim)

    @p.kernel("softmax", name="any", priority=10)
    def softmax_any(x, dim):
        _record("any", x)
        with torch.no_grad():
            return torch.softmax(x, dim)

    @p.kernel("softmax_backward", name="probe")
    def softmax_backward(grad_out, out, dim):
        return out * (grad_out - (grad_out * out).sum(dim, keepdim=True))

    @p.kernel("linear", name="probe")
    def linear(x, weight, bias, act):
        _record("linear", x)
        assert weight.dtype == x.dtype, "the rule casts x and weight alike"
        return x @ weight.t()

    return p


@pytest.fixture
def probe(install_plugins):
    install_plugins([_plugin()])
    SEEN.clear()


def _softmax(x: torch.Tensor) -> tuple[tuple, bool]:
    """One call: what the kernel saw, and whether it ran in hal's autograd node (the route)."""
    SEEN.clear()
    out = hal.ops.softmax(x, -1)
    assert len(SEEN) == 1
    *seen, node = SEEN[0]
    assert (out.grad_fn is not None) == (node and torch.is_grad_enabled())
    assert out.grad_fn is None or type(out.grad_fn).__name__ == "HalSoftmaxBackward"
    return tuple(seen), node


def test_dtype_strides_requires_grad_and_grad_mode_each_get_their_own_plan(probe: None) -> None:
    x = torch.randn(4, 6)
    x64 = x.double()
    xt = torch.randn(6, 4).t()  # x's shape and dtype, other strides
    xg = x.clone().requires_grad_()
    for _ in range(3):  # every signature's plan is cached after the first round: the later rounds are hits
        assert _softmax(x) == (("contiguous_f32", torch.float32, "cpu", True, False), False)
        assert _softmax(x64) == (("any", torch.float64, "cpu", True, False), False)
        assert _softmax(xt) == (("any", torch.float32, "cpu", False, False), False)
        assert _softmax(xg) == (("contiguous_f32", torch.float32, "cpu", True, False), True)
        with torch.no_grad():
            assert _softmax(xg) == (("contiguous_f32", torch.float32, "cpu", True, False), False)


def test_requires_grad_toggled_on_the_same_tensor(probe: None) -> None:
    x = torch.randn(4, 6)
    for _ in range(3):
        x.requires_grad_(False)
        assert _softmax(x)[1] is False
        x.requires_grad_(True)
        assert _softmax(x)[1] is True
        hal.ops.softmax(x, -1).sum().backward()  # the node's backward op runs too
        assert x.grad is not None
        x.grad = None


def test_a_tensor_on_another_device_is_not_given_the_cpu_plan(probe: None) -> None:
    x = torch.randn(4, 6)
    for _ in range(2):
        assert _softmax(x)[0][0] == "contiguous_f32"
        SEEN.clear()
        with pytest.raises(Exception) as failure:  # the probe backend serves the CPU only
            hal.ops.softmax(torch.empty(4, 6, device="meta"), -1)
        assert "meta" in str(failure.value)
        assert SEEN == [], "no kernel of the CPU's plan ran on the meta tensor"


def _linear(x: torch.Tensor, w: torch.Tensor) -> tuple:
    SEEN.clear()
    out = hal.ops.linear(x, w, None)
    assert len(SEEN) == 1
    return SEEN[0][1], SEEN[0][4], out.dtype


def test_autocast_on_off_and_its_dtype_each_get_their_own_plan(probe: None) -> None:
    x, w = torch.randn(2, 3), torch.randn(4, 3)
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    for _ in range(3):
        assert _linear(x, w) == (f32, False, f32)
        with torch.autocast("cpu", dtype=bf16):
            assert _linear(x, w) == (bf16, False, bf16)  # cast, and the kernel runs with autocast off
            assert torch.is_autocast_enabled("cpu")
            with torch.autocast("cpu", enabled=False):
                assert _linear(x, w) == (f32, False, f32)
            with torch.autocast("cpu", dtype=f16):
                assert _linear(x, w) == (f16, False, f16)
            assert _linear(x.double(), w.double()) == (torch.float64, False, torch.float64)  # float64 stays
            assert _linear(x.to(bf16), w.to(bf16)) == (bf16, False, bf16)  # nothing to cast
        assert _linear(x, w) == (f32, False, f32)


def test_autocast_on_for_another_device_type_leaves_a_cpu_call_alone(probe: None) -> None:
    x, w = torch.randn(2, 3), torch.randn(4, 3)
    previous = torch.is_autocast_enabled("cuda")
    for _ in range(2):
        assert _linear(x, w) == (torch.float32, False, torch.float32)
        torch.set_autocast_enabled("cuda", True)  # autocast on somewhere (one C flag says), off for the CPU
        try:
            assert _linear(x, w) == (torch.float32, False, torch.float32)
        finally:
            torch.set_autocast_enabled("cuda", previous)


def test_a_softmax_under_autocast_runs_with_autocast_off_and_keeps_its_route(probe: None) -> None:
    x = torch.randn(4, 6)
    xt = torch.randn(6, 4).t()
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):  # softmax has no CPU rule: no cast, autocast off inside
            assert _softmax(x) == (("contiguous_f32", torch.float32, "cpu", True, False), False)
            assert _softmax(xt) == (("any", torch.float32, "cpu", False, False), False)
        assert _softmax(x) == (("contiguous_f32", torch.float32, "cpu", True, False), False)


def test_a_plan_cached_under_autocast_counts_its_calls(probe: None) -> None:
    x, w = torch.randn(2, 3), torch.randn(4, 3)
    hal.reset_stats()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(3):
            hal.ops.linear(x, w, None)
    hal.ops.linear(x, w, None)
    assert hal.stats()[("linear", "entry_cache_probe", "probe")]["calls"] == 4


def test_a_static_plain_value_is_keyed_as_argkey_keys_it() -> None:
    """The entry keys an optional number (rms_norm's eps), None or an int inline: as
    :func:`hal.dispatch.entry.argkey` does, by type and value, so 1, 1.0 and True are three keys."""
    from hal.dispatch.entry import argkey

    key_of = hal.ops.rms_norm.__globals__["_key_of"]
    x = torch.randn(2, 4)
    for eps in (1e-5, 1e-6, None, 1, True, 2**70):
        assert key_of(x, (4,), None, eps)[-1] == argkey(eps)
    assert len({key_of(x, (4,), None, eps) for eps in (1, 1.0, True)}) == 3
