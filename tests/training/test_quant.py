"""hal.quant: observers against hand-computed values (and torch.ao's observers), a calibrated int8
linear within its quantisation error bound, QAT's straight-through gradient."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import hal
from hal import quant
from hal.quant.observers import best_kl_bins


def test_minmax_per_tensor_by_hand() -> None:
    o = quant.MinMaxObserver()  # int8 [-128, 127], asymmetric
    o.observe(torch.tensor([-1.0, 0.5]))
    o.observe(np.array([3.0, 2.0], dtype=np.float32))  # numpy too; the range accumulates
    scale, zp = o.qparams()
    assert scale.shape == () and scale.dtype == torch.float32 and zp.dtype == torch.int32
    assert math.isclose(float(scale), 4.0 / 255.0, rel_tol=1e-6)
    assert int(zp) == -128 - round(-1.0 / (4.0 / 255.0))  # = -64
    s = quant.MinMaxObserver(symmetric=True)
    s.observe(torch.tensor([-1.0, 3.0]))
    scale, zp = s.qparams()
    assert math.isclose(float(scale), 3.0 / 127.5, rel_tol=1e-6) and int(zp) == 0
    u = quant.MinMaxObserver("uint8")
    u.observe(torch.tensor([0.5, 2.0]))  # range widened to include 0: [0, 2]
    scale, zp = u.qparams()
    assert math.isclose(float(scale), 2.0 / 255.0, rel_tol=1e-6) and int(zp) == 0


@pytest.mark.parametrize("symmetric", [False, True])
def test_minmax_per_channel_matches_torch_ao(symmetric: bool, seed: int) -> None:
    x = torch.randn(6, 5, 4) * torch.arange(1, 7).reshape(6, 1, 1)
    ours = quant.MinMaxObserver("int8", symmetric=symmetric, axis=0)
    qscheme = torch.per_channel_symmetric if symmetric else torch.per_channel_affine
    ref = torch.ao.quantization.PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=qscheme)
    for part in x.split(2, dim=1):
        ours.observe(part)
        ref(part)
    scale, zp = ours.qparams()
    ref_scale, ref_zp = ref.calculate_qparams()
    assert scale.shape == (6,)
    torch.testing.assert_close(scale, ref_scale.float(), rtol=1e-6, atol=0)
    assert torch.equal(zp, ref_zp.to(torch.int32))
    by_hand = (x.amax(dim=(1, 2)).clamp(min=0) - x.amin(dim=(1, 2)).clamp(max=0)) / 255.0
    if not symmetric:
        torch.testing.assert_close(scale, by_hand, rtol=1e-6, atol=0)


def test_percentile_by_hand() -> None:
    o = quant.PercentileObserver(90.0)
    o.observe(torch.arange(0.0, 6.0))
    o.observe(torch.arange(6.0, 11.0))  # values 0..10: 10th percentile 1, 90th percentile 9
    lo, hi = o._range()
    assert float(lo) == pytest.approx(1.0) and float(hi) == pytest.approx(9.0)
    scale, zp = o.qparams()  # range [0, 9] after including 0
    assert math.isclose(float(scale), 9.0 / 255.0, rel_tol=1e-6) and int(zp) == -128
    s = quant.PercentileObserver(75.0, symmetric=True)
    s.observe(torch.tensor([-8.0, 1.0, -2.0, 4.0, 3.0]))  # |x| = 1 2 3 4 8: 75th percentile 4
    assert math.isclose(float(s.qparams()[0]), 4.0 / 127.5, rel_tol=1e-6)


def test_percentile_reservoir_keeps_a_fair_sample(seed: int) -> None:
    o = quant.PercentileObserver(99.0, max_samples=4000, seed=seed)
    for _ in range(10):
        o.observe(torch.rand(2000))  # uniform [0, 1): 99th percentile ~ 0.99
    assert o._samples.shape == (1, 4000)
    assert abs(float(o._range()[1]) - 0.99) < 0.01


def _kl_by_hand(hist: list[float], i: int, levels: int) -> float:
    """KL(P || Q) for clipping at bin i, written out loop by loop (independent of best_kl_bins)."""
    p = hist[:i]
    p[-1] += sum(hist[i:])
    per = i // levels
    q = [0.0] * i
    for g in range(levels):
        lo, hi = g * per, (i if g == levels - 1 else (g + 1) * per)
        members = [j for j in range(lo, hi) if hist[j] != 0]
        for j in members:
            q[j] = sum(hist[lo:hi]) / len(members)
    sp, sq = sum(p), sum(q)
    total = 0.0
    for pj, qj in zip(p, q):
        if pj:
            if not qj:
                return math.inf
            total += pj / sp * math.log((pj / sp) / (qj / sq))
    return total


def test_entropy_threshold_by_hand() -> None:
    hist = [9.0, 7.0, 0.0, 5.0, 3.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 2.0]
    levels = 3
    kls = {i: _kl_by_hand(list(hist), i, levels) for i in range(levels, len(hist) + 1)}
    best = min(kls, key=lambda i: (kls[i], i))
    assert best_kl_bins(np.array(hist), levels) == best


def test_entropy_observer_clips_outliers_and_merges_bins_exactly(seed: int) -> None:
    x = torch.randn(20000)
    x[:4] = torch.tensor([40.0, -35.0, 38.0, 30.0])  # rare outliers: min/max would waste the range on them
    e = quant.EntropyObserver(symmetric=True)
    # a smaller first batch (its peak 5, an eighth of the last one's): the range doubles three times later,
    # merging bins in groups of eight. Halved, the outliers (15-20) made the threshold land just past one
    # of them for 12 of 301 seeds (CI, seed 528650862: 19.0); scaled by 1/8 they fall inside the bulk
    # (no seed of 401 outside 2.5-8)
    e.observe(x[:10000] * 0.125)
    e.observe(x[10000:])
    e.observe(x[:10000])
    threshold = float(e.thresholds()[0])
    assert 2.5 < threshold < 8.0, threshold
    scale, zp = e.qparams()
    assert math.isclose(float(scale), threshold / 127.5, rel_tol=1e-6) and int(zp) == 0
    one_pass = quant.EntropyObserver(symmetric=True)  # same data, range known from the start
    one_pass.observe(torch.cat([x[:10000], x[:10000] * 0.125, x[10000:]]))
    np.testing.assert_array_equal(one_pass.amax, e.amax)
    assert np.abs(one_pass.hist - e.hist).sum() <= 2 * 3  # values on a merged bin edge may move by one bin


def test_int8_linear_within_quantisation_error(seed: int) -> None:
    """Calibrated on sample batches, Int8Linear's error against the float layer stays within the
    bound of its rounding: sum_k |x_k| s_w[n] / 2 + |w_nk| s_x / 2 (+ float32 rounding)."""
    linear = nn.Linear(32, 16)
    batches = [torch.randn(8, 32) for _ in range(4)]
    int8 = quant.convert(linear, batches)
    assert isinstance(int8, quant.Int8Linear)
    x = torch.randn(10, 32).clamp(-2.5, 2.5)
    x_scale = float(int8.x_scale)
    x = x.clamp(-127 * x_scale, 127 * x_scale)  # inside the calibrated range: no clipping error
    got = int8(x)
    want = linear(x).detach()
    w_scale = int8.w_scale
    bound = (x.abs() @ (w_scale.reshape(-1, 1) / 2).expand(16, 32).T) + (linear.weight.abs().sum(dim=1) * x_scale / 2)
    err = (got - want).abs()
    assert torch.all(err <= bound.detach() + 1e-5), float((err - bound).max())
    assert float(err.pow(2).mean().sqrt()) < 0.05 * float(want.pow(2).mean().sqrt())
    ran = {op for (op, _, _), c in hal.stats().items() if c["calls"]}
    assert {"quantize", "int8_linear"} <= ran
    with pytest.raises(ValueError, match="symmetric"):
        asym = quant.MinMaxObserver()
        asym.observe(torch.rand(3, 32) + 1.0)
        quant.Int8Linear.from_float(linear, asym)


def test_qat_gradient_is_straight_through(seed: int) -> None:
    """fake_quantize passes the gradient unchanged inside the clamping range and blocks it outside;
    a QAT linear trains (gradients reach its weight) and converts to Int8Linear with its observers."""
    obs = quant.MinMaxObserver(symmetric=True)
    obs.observe(torch.tensor([-1.0, 1.0]))
    fq = quant.FakeQuantize(lambda: obs)
    fq.eval()  # keep the range [-1, 1]
    x = torch.tensor([-3.0, -0.7, 0.2, 0.9, 2.5], requires_grad=True)
    y = fq(x)
    g = torch.randn(5)
    (grad,) = torch.autograd.grad(y, x, g)
    inside = torch.tensor([False, True, True, True, False])
    assert torch.equal(grad, torch.where(inside, g, torch.zeros(5)))
    scale = float(obs.qparams()[0])
    assert torch.allclose(y[inside], torch.round(x[inside] / scale) * scale)

    model = quant.prepare_qat(nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 2)))
    assert isinstance(model[0], quant.QATLinear)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(64, 6)).square().mean().backward()  # enough rows that some ReLU unit is alive
        assert model[0].weight.grad is not None and model[0].weight.grad.abs().sum() > 0
        opt.step()
    converted = quant.convert(model, [])
    assert isinstance(converted[0], quant.Int8Linear) and isinstance(converted[2], quant.Int8Linear)
    x = torch.randn(4, 6)
    model.eval()
    torch.testing.assert_close(converted(x), model(x).detach(), rtol=0.1, atol=0.1)
