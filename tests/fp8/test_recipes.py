"""hal.fp8 recipes and Linear: delayed scaling's history and scale against hand computation (amax 0
and NaN included), current scaling against the op, hal.fp8.Linear's forward and gradients within
bounds derived from the formats' precision, convert, a few FP8 SGD steps tracking float32, autocast."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import hal
from hal.ops import fp8_quantize
from hal.ops.fp8 import FORMATS

E4M3 = FORMATS["e4m3fn"].max_finite  # 448
E5M2 = FORMATS["e5m2"].max_finite  # 57344
RECIPES = {
    "tensor": lambda: hal.fp8.CurrentScaling(),
    "delayed": lambda: hal.fp8.DelayedScaling(history=4),
    "row": lambda: hal.fp8.RowwiseScaling(),
    "block": lambda: hal.fp8.BlockwiseScaling(block_size=8),
}


def planted(seed: int, amax: float, shape=(6, 10)) -> torch.Tensor:
    """Random values in (-1/8, 1/8) with one element set to -amax: the amax is known by hand."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(shape, generator=g) * 2 - 1) / 8
    x[2, 3] = -amax
    return x


def f32(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


# ---- delayed scaling --------------------------------------------------------------------------

def test_delayed_history_and_scale_by_hand():
    s = hal.fp8.DelayedScaling(history=3).scaler("e4m3fn")
    amaxes = [3.0, 1.5, 2.25, 0.75, 0.5]
    # the scale each call uses: 1 before anything is seen, then max(history) / 448 of earlier calls
    used = [f32(1.0), f32(3.0) / E4M3, f32(3.0) / E4M3, f32(3.0) / E4M3, f32(2.25) / E4M3]
    hist = [[3.0, 0, 0], [1.5, 3.0, 0], [2.25, 1.5, 3.0], [0.75, 2.25, 1.5], [0.5, 0.75, 2.25]]
    for i, a in enumerate(amaxes):
        x = planted(i, a)
        q, scale = s.quantize(x)
        assert torch.equal(scale, used[i]), (i, scale, used[i])
        q_ref, _ = fp8_quantize(x, "e4m3fn", "tensor", used[i])
        assert torch.equal(q, q_ref)
        assert torch.equal(s.amax_history, torch.tensor(hist[i]))
        assert torch.equal(s.scale, f32(max(hist[i])) / E4M3)  # 3.0 left the window at the 4th call


def test_delayed_most_recent_and_margin_and_e5m2():
    s = hal.fp8.DelayedScaling(history=4, margin=2, amax_compute="most_recent").scaler("e5m2")
    for i, a in enumerate([3.0, 0.75]):
        s.quantize(planted(10 + i, a))
        assert torch.equal(s.scale, f32(a) * 4 / E5M2)  # 2**margin headroom


def test_delayed_zero_amax_keeps_the_scale():
    """An amax of 0 (nothing seen, or an all-zero tensor) would give scale 0, which quantises nothing:
    the previous scale is kept (1 initially), as Transformer Engine does; the 0 is still recorded."""
    s = hal.fp8.DelayedScaling(history=2, amax_compute="most_recent").scaler("e4m3fn")
    s.quantize(torch.zeros(4, 4))
    assert torch.equal(s.scale, f32(1.0)) and torch.equal(s.amax_history, torch.zeros(2))
    s.quantize(planted(1, 2.0))
    s.quantize(torch.zeros(4, 4))
    assert torch.equal(s.amax_history, torch.tensor([0.0, 2.0]))
    assert torch.equal(s.scale, f32(2.0) / E4M3)


def test_delayed_nan_amax_freezes_the_scale_until_it_leaves_the_history():
    """A NaN in the tensor makes its amax NaN (torch.amax propagates NaN); the history's max is then
    NaN, not a usable scale, so the previous scale is kept until the NaN leaves the window."""
    s = hal.fp8.DelayedScaling(history=2).scaler("e4m3fn")
    s.quantize(planted(0, 3.0))
    bad = planted(1, 1.0)
    bad[0, 0] = float("nan")
    q, scale = s.quantize(bad)
    assert torch.equal(scale, f32(3.0) / E4M3)
    assert q[0, 0].item() == 0x7F  # the canonical NaN of e4m3fn, the rest quantised normally
    assert torch.isnan(s.amax_history[0]) and torch.equal(s.scale, f32(3.0) / E4M3)
    s.quantize(planted(2, 0.5))  # history [0.5, NaN]: still NaN, scale kept
    assert torch.equal(s.scale, f32(3.0) / E4M3)
    s.quantize(planted(3, 0.25))  # history [0.25, 0.5]: the NaN is gone
    assert torch.equal(s.scale, f32(0.5) / E4M3)


@pytest.mark.parametrize("transpose", [False, True], ids=["plain", "transposed"])
def test_delayed_scaling_is_one_cast_that_reduces_the_amax(transpose: bool):
    """Each call is one fp8_quantize_amax (fp8_quantize_transpose_amax) and nothing else: the amax
    comes from the cast's own pass over x, not from a second read; codes as fp8_quantize's."""
    s = hal.fp8.DelayedScaling(history=2).scaler("e4m3fn")
    s.quantize(planted(0, 3.0))
    x = planted(1, 1.25, shape=(3, 5, 7))
    hal.reset_stats()
    out = s.quantize_with_transpose(x) if transpose else s.quantize(x)
    ops = {op for (op, _, _), counts in hal.stats().items() if counts.get("calls")}
    assert ops == {"fp8_quantize_transpose_amax" if transpose else "fp8_quantize_amax"}, hal.stats()
    assert torch.equal(s.amax_history, torch.tensor([1.25, 3.0]))
    q_ref, _ = fp8_quantize(x, "e4m3fn", "tensor", f32(3.0) / E4M3)
    assert torch.equal(out[0], q_ref) and torch.equal(out[1], f32(3.0) / E4M3)
    if transpose:
        assert torch.equal(out[2], fp8_quantize(x.mT, "e4m3fn", "tensor", f32(3.0) / E4M3)[0])
        assert torch.equal(out[3], out[1])


def test_recipe_arguments_are_checked():
    with pytest.raises(ValueError, match="format"):
        hal.fp8.DelayedScaling(format="e3m4")
    with pytest.raises(ValueError, match="amax_compute"):
        hal.fp8.DelayedScaling(amax_compute="mean")
    with pytest.raises(ValueError, match="granularity"):
        hal.fp8.CurrentScaling(granularity="column")


# ---- current scaling --------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2", "e4m3fnuz"])
@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
def test_current_scaling_is_the_op(fmt, granularity):
    x = torch.randn(20, 24, generator=torch.Generator().manual_seed(3)) * 5
    s = hal.fp8.CurrentScaling(fmt, granularity, block_size=8).scaler(fmt)
    q, scale = s.quantize(x)
    q_ref, scale_ref = fp8_quantize(x, fmt, granularity, None, 8)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)
    if granularity == "tensor":
        assert torch.equal(scale, x.abs().amax() / f32(FORMATS[fmt].max_finite))


# ---- Linear ----------------------------------------------------------------------------------

def bound(a: torch.Tensor, b: torch.Tensor, rel_a: float, rel_b: float, sub_a: float, sub_b: float) -> torch.Tensor:
    """Elementwise bound of |fp8(a) @ fp8(b).T - a @ b.T|: each quantised element is off by at most
    rel |v| + sub (rel: half an ulp, 2^-(mantissa bits + 1); sub: half the subnormal step times the
    largest scale, covering values in the subnormal range), plus float32 accumulation slack."""
    a, b = a.double(), b.double()
    da, db = rel_a * a.abs() + sub_a, rel_b * b.abs() + sub_b
    return da @ b.abs().T + a.abs() @ db.T + da @ db.T + 1e-5 * (a.abs() @ b.abs().T) + 1e-30


E4M3_REL, E5M2_REL = 2.0**-4, 2.0**-3  # 3 and 2 mantissa bits


def sub(t: torch.Tensor, fmt: str) -> float:
    half_step = {"e4m3fn": 2.0**-10, "e5m2": 2.0**-17}[fmt]
    return half_step * t.abs().max().item() / FORMATS[fmt].max_finite


@pytest.mark.parametrize("name", list(RECIPES))
def test_linear_forward_and_gradients_within_fp8_bounds(name):
    torch.manual_seed(7)
    ref = nn.Linear(40, 24)
    m = hal.fp8.Linear.from_linear(ref, RECIPES[name]())
    assert m.weight is ref.weight and m.bias is ref.bias
    for step in range(3):  # delayed scaling: its first call uses scale 1, later ones the history
        x = torch.randn(5, 3, 40) * 4
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        y = m(x1)
        y_ref = ref(x2)
        x2d, w = x.reshape(-1, 40), ref.weight.detach()
        assert y.shape == y_ref.shape and y.dtype == torch.float32
        err = (y - y_ref).detach().double().reshape(-1, 24).abs()
        assert (err <= bound(x2d, w, E4M3_REL, E4M3_REL, sub(x2d, "e4m3fn"), sub(w, "e4m3fn"))).all()
        assert err.max() > 0  # it did quantise

        g = torch.randn_like(y_ref)
        ref.weight.grad = ref.bias.grad = None
        y.backward(g)
        gw, gb = ref.weight.grad.clone(), ref.bias.grad.clone()
        ref.weight.grad = ref.bias.grad = None
        y_ref.backward(g)
        g2d = g.reshape(-1, 24)
        # grad_input = g @ W: g in e5m2, W (as W^T) in e4m3
        err_x = (x1.grad - x2.grad).double().reshape(-1, 40).abs()
        assert (err_x <= bound(g2d, w.T, E5M2_REL, E4M3_REL, sub(g2d, "e5m2"), sub(w, "e4m3fn"))).all()
        # grad_weight = g^T @ x: g^T in e5m2, x^T in e4m3
        err_w = (gw - ref.weight.grad).double().abs()
        assert (err_w <= bound(g2d.T, x2d.T, E5M2_REL, E4M3_REL, sub(g2d, "e5m2"), sub(x2d, "e4m3fn"))).all()
        assert torch.allclose(gb, ref.bias.grad, rtol=1e-5, atol=1e-5)  # the bias gradient is not quantised


@pytest.mark.parametrize("name", list(RECIPES))
def test_linear_gradients_are_the_gemms_of_the_quantised_operands(name):
    """The backward's two GEMMs read the FP8 transposes the forward made (x^T and W^T with the
    forward's scales, or their own current row/block scales) and g's quantisation: each gradient
    equals the float64 product of the dequantised operands to float32 rounding. The error bounds
    above would pass an operand scaled 1% off; this would not."""
    from hal.ops import fp8_dequantize, fp8_quantize_transpose

    torch.manual_seed(11)
    ref = nn.Linear(64, 48, bias=False)
    recipe = RECIPES[name]()
    m = hal.fp8.Linear.from_linear(ref, recipe)
    bs = getattr(recipe, "block_size", 128)
    for _ in range(2):
        scale_x = m.input_scaler.scale.clone() if hasattr(m.input_scaler, "scale") else None
        scale_w = m.weight_scaler.scale.clone() if hasattr(m.weight_scaler, "scale") else None
        scale_g = m.grad_scaler.scale.clone() if hasattr(m.grad_scaler, "scale") else None
        x = (torch.randn(32, 64) * 3).requires_grad_()
        m.weight.grad = None
        y = m(x)
        g = torch.randn_like(y)
        y.backward(g)
        gran = getattr(m.input_scaler, "granularity", "tensor")

        def deq_t(t, fmt, scale):  # t^T as the backward's GEMM reads it, dequantised, float64
            _, _, q_t, s_t = fp8_quantize_transpose(t.detach(), fmt, gran, scale, bs)
            return fp8_dequantize(q_t, s_t, fmt, bs).double()

        def deq(t, fmt, scale):
            q, s, _, _ = fp8_quantize_transpose(t.detach(), fmt, gran, scale, bs)
            return fp8_dequantize(q, s, fmt, bs).double()

        fmt, gfmt = recipe.format, recipe.backward_format
        if gran == "tensor" and scale_x is None:  # current per-tensor scales: this call's amax
            scale_x = scale_w = scale_g = None
        want_x = deq(g, gfmt, scale_g) @ deq_t(m.weight, fmt, scale_w).T
        want_w = deq_t(g, gfmt, scale_g) @ deq_t(x, fmt, scale_x).T
        torch.testing.assert_close(x.grad.double(), want_x, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(m.weight.grad.double(), want_w, rtol=1e-5, atol=1e-5)


def test_linear_under_autocast_bfloat16():
    torch.manual_seed(11)
    ref = nn.Linear(32, 16)
    m = hal.fp8.Linear.from_linear(ref)
    x = (torch.randn(8, 32) * 2).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16
    w = ref.weight.detach()
    exact = x.detach().double() @ w.double().T + ref.bias.detach().double()
    b = bound(x.detach(), w, E4M3_REL, E4M3_REL, sub(x, "e4m3fn"), sub(w, "e4m3fn")) + 2.0**-8 * exact.abs()
    assert ((y.double() - exact).abs() <= b).all()
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and ref.weight.grad.dtype == torch.float32  # master weights stay float32
    assert torch.isfinite(x.grad).all() and torch.isfinite(ref.weight.grad).all()


def test_linear_nan_input():
    """Delayed scaling: a NaN gives NaN in its output row only, as nn.Linear. Current scaling: the
    NaN amax makes a NaN scale, which fp8_scaled_mm refuses for host tensors, saying why."""
    torch.manual_seed(5)
    x = torch.randn(3, 8)
    x[1, 2] = float("nan")
    y = hal.fp8.Linear(8, 4, recipe=hal.fp8.DelayedScaling())(x)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2]]).all()
    with pytest.raises(hal.InvalidArgumentError, match="NaN"):
        hal.fp8.Linear(8, 4)(x)


def test_linear_rejects_float64():
    m = hal.fp8.Linear(4, 3)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        m(torch.randn(2, 4, dtype=torch.float64))


# ---- convert and training ----------------------------------------------------------------------

def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def test_convert_keeps_first_and_last_and_state_dict_keys():
    torch.manual_seed(0)
    model = mlp()
    before = model.state_dict()
    ptrs = {k: v.data_ptr() for k, v in before.items()}
    hal.fp8.convert(model, hal.fp8.DelayedScaling())
    assert [type(model[i]) for i in (0, 2, 4, 6)] == [nn.Linear, hal.fp8.Linear, hal.fp8.Linear, nn.Linear]
    after = model.state_dict()
    assert list(after) == list(before) and {k: v.data_ptr() for k, v in after.items()} == ptrs
    model2 = hal.fp8.convert(mlp(), keep=("2",))
    assert [type(model2[i]) is hal.fp8.Linear for i in (0, 2, 4, 6)] == [True, False, True, True]
    assert all(type(m) is hal.fp8.Linear for m in hal.fp8.convert(mlp(), keep=())[::2])
    with pytest.raises(ValueError, match="keep names no nn.Linear"):
        hal.fp8.convert(mlp(), keep=("head",))


@pytest.mark.parametrize("name", ["tensor", "delayed"])
def test_fp8_sgd_tracks_float32(name):
    """30 SGD steps of a 4-layer MLP, every layer in FP8 (keep=()), against the float32 run from the
    same seed and batch: each step's loss within 5% of float32's (each GEMM is off by about 2^-4
    relative per operand, far below the loss's own decrease), and the loss decreases."""
    torch.manual_seed(1)
    base = mlp()
    fp8 = mlp()
    fp8.load_state_dict(base.state_dict())
    hal.fp8.convert(fp8, RECIPES[name](), keep=())
    teacher = torch.randn(16, 4)
    opts = [torch.optim.SGD(m.parameters(), lr=0.3) for m in (base, fp8)]
    losses = {0: [], 1: []}
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 16, generator=gen)
    t = torch.tanh(x @ teacher)
    for _ in range(30):
        for i, (m, opt) in enumerate(zip((base, fp8), opts)):
            opt.zero_grad()
            loss = nn.functional.mse_loss(m(x), t)
            loss.backward()
            opt.step()
            losses[i].append(loss.item())
    for a, b in zip(losses[0], losses[1]):
        assert abs(a - b) <= 0.05 * a, (losses[0], losses[1])
    assert losses[1][-1] < 0.85 * losses[1][0], losses[1]


def test_linear_quantises_its_weight_copy_inside_the_step_and_grads_the_weight(seed: int):
    """Inside ``WeightCopies.active`` under bfloat16 autocast, ``hal.fp8.Linear`` quantises the
    half-precision copy of its weight (the copy's values reach the output), and the gradient goes to
    the float32 weight, in float32, equal to the one computed from the weight itself where the copy
    is the weight rounded; outside the step, or under another autocast dtype, the copy is not read."""
    from hal.nn.weight_copies import WeightCopies

    gen = torch.Generator().manual_seed(seed)
    layer = hal.fp8.Linear(32, 16, bias=False)  # no bias: doubling the weight doubles the output exactly
    with torch.no_grad():  # a weight that bfloat16 holds exactly: the copy is then the weight's values
        layer.weight.copy_(torch.randn(16, 32, generator=gen).bfloat16().float())
    x = torch.randn(8, 32, generator=gen)
    copies = WeightCopies(layer, torch.bfloat16)
    assert len(copies) == 1 and copies.readers == {"Linear": 1}

    def run(*, active: bool, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
        layer.weight.grad = None
        with (copies.active() if active else contextlib.nullcontext()), torch.autocast("cpu", dtype=dtype):
            y = layer(x)
        y.float().pow(2).sum().backward()
        return y.detach(), layer.weight.grad

    y_weight, g_weight = run(active=False)
    y_copy, g_copy = run(active=True)
    assert g_copy.dtype == torch.float32
    assert torch.equal(y_copy, y_weight) and torch.equal(g_copy, g_weight)
    # the copy's values are what is quantised: a copy of twice the weight doubles the output (a power
    # of two: the same FP8 codes, a scale twice as large); refresh() would rewrite it from the weight,
    # so the copy is changed where the step's entry check does not look (its version is the weight's)
    copy = layer.__dict__["weight_copy"]
    with torch.no_grad():
        copy.mul_(2)
    y_doubled = run(active=True)[0]
    assert torch.equal(y_doubled.float(), 2 * y_weight.float())
    assert torch.equal(run(active=False)[0], y_weight)  # outside the step: the weight
    assert torch.equal(run(active=True, dtype=torch.float16)[0], run(active=False, dtype=torch.float16)[0])
