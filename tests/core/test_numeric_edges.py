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
    from hal_backend_eager.overlap import dense, may_overlap

    x = torch.randn(4, 6, 8)
    apart = [x, x.transpose(0, 2), x[:, ::2], x.permute(1, 2, 0)[1:], x[..., :1].expand(4, 6, 1), torch.empty(0, 3).expand(5, 0, 3)]
    assert not any(may_overlap(t) for t in apart)
    shared = [x[:, :1].expand(4, 6, 8), x.reshape(-1).as_strided((5, 8), (4, 1)), x.reshape(-1).as_strided((2, 2, 3), (1, 1, 2))]
    assert all(may_overlap(t) for t in shared)
    copy = dense(shared[1])
    assert copy.is_contiguous() and torch.equal(copy, shared[1]) and dense(x.transpose(0, 2)).data_ptr() == x.data_ptr()
