"""hal.fp8 given the amax of a linear layer's input (issue 40, FP8: the producer of x reduces it):
per-tensor current scaling casts with it (``fp8_quantize_from_amax``: no amax pass) and gives the
codes and scales of the cast that reduces it, bit for bit; ``hal.fp8.Linear.forward(x, x_amax)``
gives the output and gradients of ``forward(x)`` bit for bit; the other recipes ignore it. Random
data from a fresh seed, on the CPU (the cpu backend's torch kernels and cpu_ref's emulation)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import hal
import hal.fp8
from hal.fp8.recipes import CurrentScaler, DelayedScaler, Scaler

FORMATS = ("e4m3fn", "e5m2", "e4m3fnuz", "e5m2fnuz")


def _calls(op: str) -> int:
    return sum(c["calls"] for (o, _, _), c in hal.stats().items() if o == op)


def _x(seed: int, *shape: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * torch.exp(2 * torch.randn(shape, generator=gen, dtype=torch.float64))).float()


def _assert_bits(a: tuple, b: tuple) -> None:
    assert len(a) == len(b)
    for u, v in zip(a, b):
        assert u.dtype == v.dtype and u.shape == v.shape
        assert torch.equal(u.view(torch.int32) if u.dtype == torch.float32 else u, v.view(torch.int32) if v.dtype == torch.float32 else v)


@pytest.mark.parametrize("backend", ["cpu", "cpu_ref"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_current_scaling_given_the_amax_casts_as_reducing_it(backend: str, fmt: str, seed: int) -> None:
    scaler = CurrentScaler(fmt, "tensor", 128)
    assert scaler.uses_amax
    x = _x(seed, 24, 40)
    amax = x.abs().amax()
    with hal.use(backend=backend):
        hal.reset_stats()
        _assert_bits(scaler.quantize(x, amax), scaler.quantize(x))
        _assert_bits(scaler.quantize_with_transpose(x, amax), scaler.quantize_with_transpose(x))
        assert _calls("fp8_quantize_from_amax") == 1 and _calls("fp8_quantize_transpose_from_amax") == 1
        q, s, qt, st = scaler.quantize_with_transpose(x, amax)
        assert st is s  # one scale for both layouts
        # another amax: the scale follows it (amax / largest finite), the codes that scale's
        q, s = scaler.quantize(x, 4 * amax)
        want = hal.ops.fp8_quantize(x, fmt, "tensor", (4 * amax / torch.tensor(hal.ops.fp8.FORMATS[fmt].max_finite)).reshape(()))
        _assert_bits((q, s), want)


def test_a_zero_amax_gives_scale_one_and_a_nan_amax_a_nan_scale(seed: int) -> None:
    scaler = CurrentScaler("e4m3fn", "tensor", 128)
    x = _x(seed, 6, 8)
    q, s = scaler.quantize(torch.zeros_like(x), torch.zeros(()))
    assert float(s) == 1.0 and not q.any()
    q, s = scaler.quantize(x, torch.tensor(math.nan))
    assert bool(s.isnan()) and bool((q == 0x7F).all())  # every code the canonical NaN, as current scaling of a NaN x


@pytest.mark.parametrize("granularity", ["row", "block"])
def test_row_and_block_scales_ignore_a_per_tensor_amax(granularity: str, seed: int) -> None:
    scaler = CurrentScaler("e4m3fn", granularity, 16)
    assert not scaler.uses_amax
    x = _x(seed, 20, 32)
    _assert_bits(scaler.quantize(x, torch.tensor(1.0)), scaler.quantize(x))
    _assert_bits(scaler.quantize_with_transpose(x, torch.tensor(1.0)), scaler.quantize_with_transpose(x))


def test_delayed_scaling_ignores_the_amax_and_reduces_its_own(seed: int) -> None:
    a, b = DelayedScaler("e4m3fn", 4, 0.0, "max"), DelayedScaler("e4m3fn", 4, 0.0, "max")
    assert not a.uses_amax
    for i in range(3):
        x = _x(seed + i, 8, 16)
        _assert_bits(a.quantize_with_transpose(x, torch.tensor(123.0)), b.quantize_with_transpose(x))
        _assert_bits(a.quantize(x, torch.tensor(0.5)), b.quantize(x))
    assert torch.equal(a.amax_history, b.amax_history) and torch.equal(a.scale, b.scale)


@pytest.mark.parametrize("recipe", [hal.fp8.CurrentScaling(), hal.fp8.CurrentScaling("e4m3fnuz"), hal.fp8.DelayedScaling(),
                                    hal.fp8.RowwiseScaling()], ids=["tensor", "tensor_fnuz", "delayed", "rowwise"])
def test_linear_given_its_inputs_amax_computes_the_same_output_and_gradients(recipe, seed: int) -> None:
    torch.manual_seed(seed)
    lin = nn.Linear(48, 24)
    layer = hal.fp8.Linear.from_linear(lin, recipe)
    twin = hal.fp8.Linear.from_linear(nn.Linear(48, 24), recipe)
    twin.load_state_dict(layer.state_dict())
    assert layer.takes_input_amax == (recipe.granularity == "tensor" if isinstance(recipe, hal.fp8.CurrentScaling) else False)
    x = _x(seed, 2, 5, 48)
    g = _x(seed + 1, 2, 5, 24)
    outs = []
    for m, given in ((layer, True), (twin, False)):
        xi = x.clone().requires_grad_(True)
        hal.reset_stats()
        y = m(xi, x_amax=x.abs().amax()) if given else m(xi)
        y.backward(g)
        outs.append((y.detach(), xi.grad, m.weight.grad, m.bias.grad))
        if given:
            assert _calls("fp8_quantize_transpose_from_amax") == (1 if layer.takes_input_amax else 0)
    for u, v in zip(*outs):
        assert torch.equal(u, v)
    if isinstance(recipe, hal.fp8.DelayedScaling):
        assert torch.equal(layer.input_scaler.amax_history, twin.input_scaler.amax_history)


def test_linear_without_grad_casts_with_the_amax_too(seed: int) -> None:
    layer = hal.fp8.Linear(32, 16)
    x = _x(seed, 7, 32)
    with torch.no_grad():
        hal.reset_stats()
        y = layer(x, x_amax=x.abs().amax())
        assert _calls("fp8_quantize_from_amax") + _calls("fp8_quantize_transpose_from_amax") == 1
        assert torch.equal(y, layer(x))


def test_a_nan_input_is_refused_by_the_gemm_either_way_on_the_host(seed: int) -> None:
    """Current scaling of a NaN input makes the scale NaN; host scales are checked by the GEMM, which
    refuses it, whether the amax was reduced by the cast or given."""
    layer = hal.fp8.Linear(16, 8)
    x = _x(seed, 4, 16)
    x[1, 2] = math.nan
    for kwargs in ({}, {"x_amax": torch.tensor(math.nan)}):
        with pytest.raises(hal.InvalidArgumentError, match="fp8_scaled_mm"):
            layer(x, **kwargs)


def test_a_scaler_written_before_the_amax_argument_still_serves(seed: int) -> None:
    """A user's Scaler subclass with quantize(x) only (the earlier interface): never given an amax."""

    class Old(Scaler):
        def quantize(self, x):  # type: ignore[override]
            return hal.ops.fp8_quantize(x, self.format)

        def quantize_with_transpose(self, x):  # type: ignore[override]
            return hal.ops.fp8_quantize_transpose(x, self.format)

    layer = hal.fp8.Linear(16, 8)
    layer.input_scaler = Old("e4m3fn")
    assert not layer.takes_input_amax
    x = _x(seed, 4, 16).requires_grad_(True)
    layer(x, x_amax=x.detach().abs().amax()).sum().backward()
    assert x.grad is not None
