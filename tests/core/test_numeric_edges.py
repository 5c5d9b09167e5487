"""Numerics at the edges, the same on every CPU backend (cpu_ref, eager, cpu) and as torch defines
them (issue 41, items 11 and 13): quantize of NaN and infinities, attention on a query whose rows
share memory, conv -> batch norm -> ReLU where eps = 0 meets a zero variance, and batch norm's
empty 1-D input."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import hal

BACKENDS = ("cpu_ref", "eager", "cpu")
QTYPES = {"int8": (torch.qint8, -128, 127), "uint8": (torch.quint8, 0, 255)}


def _torch_quantized(x: torch.Tensor, scale: float, zero_point: int, qtype: str) -> torch.Tensor:
    """torch.quantize_per_tensor's codes (its deprecation warning silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(x.float(), scale, zero_point, QTYPES[qtype][0]).int_repr()


def _with_specials(rng: np.random.Generator, n: int, scale: float) -> np.ndarray:
    """Random values with NaN, +inf and -inf scattered among them (and at both ends)."""
    x = rng.standard_normal(n) * scale * 100
    where = rng.choice(n - 2, size=12, replace=False) + 1
    x[where[:4]], x[where[4:8]], x[where[8:]] = np.nan, np.inf, -np.inf
    x[0], x[-1] = np.nan, -np.inf
    return x


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qtype", sorted(QTYPES))
@pytest.mark.parametrize("as_numpy", [False, True])
def test_quantize_of_nan_and_infinities_is_torchs_per_tensor_rule(rng, backend, qtype, as_numpy):
    """NaN gives the top code and infinities saturate, as torch.quantize_per_tensor (NaN gave 0)."""
    _, lo, hi = QTYPES[qtype]
    scale = float(rng.uniform(0.01, 0.5))
    zero_point = int(rng.integers(lo + 10, hi - 10))
    x = torch.from_numpy(_with_specials(rng, 301, scale)).float()
    want = _torch_quantized(x, scale, zero_point, qtype)
    arg = x.numpy() if as_numpy else x
    with hal.use(backend=backend):
        got = torch.as_tensor(hal.ops.quantize(arg, scale, zero_point, None, qtype))
    assert torch.equal(got, want), f"{backend}: {got[x.isnan() | x.isinf()].tolist()} against torch's {want[x.isnan() | x.isinf()].tolist()}"
    assert want[x.isnan()].eq(hi).all() and want[x == np.inf].eq(hi).all() and want[x == -np.inf].eq(lo).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qtype", sorted(QTYPES))
def test_quantize_per_channel_of_nan_follows_the_per_tensor_rule(rng, backend, qtype):
    """Per channel (array scales and zero points, torch's kernel on the cpu backend) as per tensor."""
    _, lo, hi = QTYPES[qtype]
    x = torch.from_numpy(_with_specials(rng, 6 * 50, 0.1)).float().reshape(6, 50)
    scale = torch.from_numpy(rng.uniform(0.01, 0.5, size=6)).float()
    zero_point = torch.from_numpy(rng.integers(lo + 10, hi - 10, size=6)).int()
    want = torch.stack([_torch_quantized(x[c], float(scale[c]), int(zero_point[c]), qtype) for c in range(6)])
    with hal.use(backend=backend):
        got = hal.ops.quantize(x, scale, zero_point, 0, qtype)
    assert torch.equal(got, want), f"{backend}: {got[x.isnan()].tolist()} for NaN"


# --- attention on a query whose rows share memory -------------------------------------------------

#: (B, H, L, E) = (2, 2, 16, 8) strides whose batch or head step overlaps the features: torch's flash
#: CPU kernel returned garbage (up to 1e37) for these where the same values made contiguous are right
OVERLAPPING = [(0, 1, 1, 1), (1, 0, 1, 1), (1, 1, 8, 1), (0, 1, 8, 1), (1, 0, 16, 1)]


def _overlapping_query(strides: tuple[int, ...], dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(base, q): a random leaf and the (2, 2, 16, 8) view of it with ``strides``."""
    base = torch.randn(512, dtype=dtype, requires_grad=True)
    return base, base.as_strided((2, 2, 16, 8), strides)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("strides", OVERLAPPING)
@pytest.mark.parametrize("is_causal", [False, True])
def test_attention_of_a_query_whose_rows_share_memory(seed, backend, strides, is_causal):
    """Forward and gradients equal those of the same values made contiguous (float64 torch)."""
    base, q = _overlapping_query(strides)
    k, v, g = (torch.randn(2, 2, 16, 8) for _ in range(3))
    want = F.scaled_dot_product_attention(q.detach().contiguous().double(), k.double(), v.double(), is_causal=is_causal)
    with hal.use(backend=backend):
        got = hal.ops.scaled_dot_product_attention(q, k, v, None, is_causal)
        (grad,) = torch.autograd.grad(got, base, g)
        with torch.no_grad():
            got_np = hal.ops.scaled_dot_product_attention(q.detach().numpy(), k.numpy(), v.numpy(), None, is_causal)
    base64 = base.detach().double().requires_grad_(True)
    out64 = F.scaled_dot_product_attention(base64.as_strided(q.shape, strides).contiguous(), k.double(), v.double(), is_causal=is_causal)
    (want_grad,) = torch.autograd.grad(out64, base64, g.double())
    torch.testing.assert_close(got.detach().double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.from_numpy(got_np).double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad.double(), want_grad, atol=1e-4, rtol=1e-4)


def test_may_overlap_reads_strides_only():
    from hal_torch.overlap import dense, may_overlap

    x = torch.randn(4, 6, 8)
    apart = [x, x.transpose(0, 2), x[:, ::2], x.permute(1, 2, 0)[1:], x[..., :1].expand(4, 6, 1), torch.empty(0, 3).expand(5, 0, 3)]
    assert not any(may_overlap(t) for t in apart)
    shared = [x[:, :1].expand(4, 6, 8), x.reshape(-1).as_strided((5, 8), (4, 1)), x.reshape(-1).as_strided((2, 2, 3), (1, 1, 2))]
    assert all(may_overlap(t) for t in shared)
    copy = dense(shared[1])
    assert copy.is_contiguous() and torch.equal(copy, shared[1]) and dense(x.transpose(0, 2)).data_ptr() == x.data_ptr()


# --- batch norm at eps = 0 -------------------------------------------------------------------------


def assert_same_nonfinite(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """NaN, +inf and -inf at the same places, the finite values close."""
    got, want = got.detach().double(), want.detach().double()
    for name, mask in (("NaN", torch.isnan), ("+inf", lambda t: t == np.inf), ("-inf", lambda t: t == -np.inf)):
        assert torch.equal(mask(got), mask(want)), f"{what}: {name} at {int(mask(got).sum())} places, torch's at {int(mask(want).sum())}"
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], atol=1e-4, rtol=1e-4)


def _conv_bn_args(zero_var_channel: int) -> tuple:
    """Random conv -> batch norm arguments, one channel's running variance 0, all else drawn; that
    channel's weight positive and mean negative, so its scale is +inf and its shift bias - mean *
    scale is +inf: +inf where the convolution output is positive, NaN where it is negative."""
    x, w, cb = torch.randn(2, 3, 7, 7), torch.randn(4, 3, 3, 3), torch.randn(4)
    bw, bb, rm, rv = torch.randn(4), torch.randn(4), torch.randn(4), torch.rand(4) + 0.5
    rv[zero_var_channel], bw[zero_var_channel], rm[zero_var_channel] = 0.0, bw[zero_var_channel].abs(), -rm[zero_var_channel].abs()
    return x, w, cb, bw, bb, rm, rv


FUSED_KERNELS = [("cpu_ref", None), ("eager", None), ("cpu", None), ("cpu", "torch"), ("cpu", "unfused")]


@pytest.mark.parametrize("backend,kernel", FUSED_KERNELS)
@pytest.mark.parametrize("residual", [False, True])
def test_conv_bn_relu_at_eps_zero_and_zero_variance_is_torchs_composite(seed, backend, kernel, residual):
    """eval, eps = 0, a zero running variance: as relu(F.batch_norm(F.conv2d(...)) (+ residual)) on
    the CPU, NaN and infinities alike (cpu_ref gave +inf where torch gives NaN, the folded oneDNN
    kernel NaN over the whole channel)."""
    x, w, cb, bw, bb, rm, rv = _conv_bn_args(int(torch.randint(0, 4, ())))
    res = torch.randn(2, 4, 7, 7)
    z = F.batch_norm(F.conv2d(x, w, cb, 1, 1), rm, rv, bw, bb, False, 0.1, 0.0)
    want = F.relu(z + res if residual else z)
    op = "fused_conv_bn_add_relu" if residual else "fused_conv_bn_relu"
    args = (x, w, cb, bw, bb, rm, rv) + ((res,) if residual else ()) + (1, 1, 1, 1, 0.0, 0.1, False)
    with hal.use(backend=backend, kernel={op: kernel} if kernel else None):
        got = getattr(hal.ops, op)(*args)
    assert want.isnan().any() and (want == np.inf).any(), "the case must reach the division by zero"
    assert_same_nonfinite(got, want, f"{op} on {backend}/{kernel or hal.explain(op, *args).kernel}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_norm_at_eps_zero_and_zero_variance_is_torchs(seed, backend):
    x, _, _, bw, bb, rm, rv = _conv_bn_args(1)
    rm, rv, bw, bb = rm[:3], rv[:3], bw[:3], bb[:3]
    want = F.batch_norm(x, rm, rv, bw, bb, False, 0.1, 0.0)
    with hal.use(backend=backend):
        got = hal.ops.batch_norm(x, rm, rv, bw, bb, False, 0.1, 0.0)
        got_np = hal.ops.batch_norm(x.numpy(), rm.numpy(), rv.numpy(), bw.numpy(), bb.numpy(), False, 0.1, 0.0)
    assert_same_nonfinite(got, want, f"batch_norm on {backend}")
    assert_same_nonfinite(torch.from_numpy(got_np), want, f"batch_norm of NumPy arrays on {backend}")


@pytest.mark.parametrize("op", ["batch_norm", "fused_conv_bn_relu"])
def test_eps_zero_in_training_is_refused_as_torch_refuses_it(op):
    x, w, cb, bw, bb, rm, rv = _conv_bn_args(0)
    args = (x, rm[:3], rv[:3], None, None, True, 0.1, 0.0) if op == "batch_norm" else (x, w, cb, bw, bb, rm, rv, 1, 1, 1, 1, 0.0, 0.1, True)
    with pytest.raises(ValueError, match="eps must be positive during training"):
        F.batch_norm(x, rm[:3], rv[:3], training=True, eps=0.0)
    with pytest.raises(hal.InvalidArgumentError, match=f"{op}: argument 'eps' must be a number > 0 when training"):
        getattr(hal.ops, op)(*args)


# --- batch norm of an empty 1-D input --------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("stats", [0, 3])
def test_batch_norm_of_an_empty_1d_input_is_torchs(seed, backend, training, stats):
    """torch's OpInfo samples for F.batch_norm include x of shape (0,) with running statistics of
    length 0, training or not (hal refused them: "at least 2 dimensions"): an empty result, the
    statistics untouched, an empty gradient."""
    rm, rv = torch.randn(stats), torch.rand(stats) + 0.5
    x = torch.randn(0, requires_grad=True)
    want = F.batch_norm(x, rm.clone(), rv.clone(), None, None, training)
    with hal.use(backend=backend):
        got = hal.ops.batch_norm(x, rm_h := rm.clone(), rv_h := rv.clone(), None, None, training)
        (grad,) = torch.autograd.grad(got.sum(), x)
        got_np = hal.ops.batch_norm(x.detach().numpy(), rm.numpy().copy(), rv.numpy().copy(), None, None, training)
    assert got.shape == want.shape == grad.shape == (0,) and got.dtype == want.dtype
    assert got_np.shape == (0,) and isinstance(got_np, np.ndarray)
    assert torch.equal(rm_h, rm) and torch.equal(rv_h, rv)


def test_batch_norm_refuses_a_non_empty_1d_input_as_torch():
    with pytest.raises(hal.InvalidArgumentError, match=r"batch_norm: argument 'x' must be an array of at least 2 dimensions \(N, C, \.\.\.\), or an empty 1-D array"):
        hal.ops.batch_norm(torch.randn(3), torch.zeros(3), torch.ones(3))
