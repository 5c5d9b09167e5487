"""The CPU backend's numba rotary embedding (issue 40, eager host time): one pass instead of the torch
kernel's eleven ops. Checked on fresh random data with NaN and infinities, in every dtype, strided
x as hal.nn.patch's attention passes it, both pair layouts and the ways cos and sin broadcast:
forward and backward equal to the torch kernel bit for bit (the same float32 products and sums,
one rounding), and within tolerance of cpu_ref's float64; chosen by the dispatcher for small calls
(the suite runs with HAL_TUNE=off: by priority), declining with its reasons beyond its bound, in
more than 4 dimensions and inside torch.compile graphs; and through hal's autograd node."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hal_backend_cpu import _numba
from hal_backend_cpu.rotary import NUMBA_ROTARY_ELEMENTS, rotary_embedding_backward_numba, rotary_embedding_numba
from hal_torch import transformer as eager

import hal

pytestmark = pytest.mark.skipif(_numba.unavailable_reason() is not None, reason="numba is not usable here")

SPECIALS = torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0, 60.0, -60.0, 1e30, -1e30])
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _with_specials(gen: torch.Generator, shape: tuple[int, ...], share: float = 0.1) -> torch.Tensor:
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 3
    hit = torch.rand(shape, generator=gen) < share
    x[hit] = SPECIALS[torch.randint(len(SPECIALS), (int(hit.sum()),), generator=gen)].double()
    return x


def _case(gen: torch.Generator, dtype: torch.dtype, cos_shape: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (B, H, T, D) as a transposed view of a (B, T, H * D) projection; cos and sin in x's dtype
    (or float32 beside half precision) broadcasting as named."""
    b, h, t = (int(v) for v in torch.randint(1, 5, (3,), generator=gen))
    d = 2 * int(torch.randint(1, 9, (1,), generator=gen))
    x = _with_specials(gen, (b, t, h * d)).to(dtype).view(b, t, h, d).transpose(1, 2)
    angle = dtype if dtype in (torch.float32, torch.float64) else (torch.float32 if torch.rand(1, generator=gen) < 0.5 else dtype)
    shape = {"b1t": (b, 1, t, d // 2), "11t": (1, 1, t, d // 2), "t": (t, d // 2), "bht": (b, h, t, d // 2)}[cos_shape]
    theta = torch.rand(shape, generator=gen, dtype=torch.float64) * 10
    return x, theta.cos().to(angle), theta.sin().to(angle)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cos_shape", ["b1t", "11t", "t", "bht"])
def test_forward_and_backward_equal_the_torch_kernel_and_match_cpu_ref(dtype: torch.dtype, cos_shape: str, rng: np.random.Generator) -> None:
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    for _ in range(6):
        x, cos, sin = _case(gen, dtype, cos_shape)
        for interleaved in (False, True):
            for ours, theirs, name in ((rotary_embedding_numba, eager.rotary_embedding, "rotary_embedding"),
                                       (rotary_embedding_backward_numba, eager.rotary_embedding_backward, "rotary_embedding_backward")):
                out = ours(x, cos, sin, interleaved)
                want = theirs(x, cos, sin, interleaved)
                assert out.dtype == x.dtype and out.shape == x.shape and out.is_contiguous()
                assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out.nan_to_num(), want.nan_to_num()), (name, interleaved)
                with hal.use(backend="cpu_ref"):
                    ref = getattr(hal.ops, name)(x, cos, sin, interleaved)
                finite = ref.isfinite() & out.isfinite()
                tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-6, torch.float64: 1e-12}[dtype]
                torch.testing.assert_close(out[finite].double(), ref[finite].double(), rtol=tol, atol=tol * 10)


def test_small_calls_take_it_through_hals_node_and_its_gradient_is_the_torch_kernels() -> None:
    gen = torch.Generator().manual_seed(0)
    x, cos, sin = _case(gen, torch.bfloat16, "b1t")
    d = hal.explain("rotary_embedding", x, cos, sin, False)
    assert (d.backend, d.kernel) == ("cpu", "numba"), d
    xg = x.detach().clone().requires_grad_()
    y = hal.ops.rotary_embedding(xg, cos, sin, False)
    assert type(y.grad_fn).__name__ == "HalRotaryEmbeddingBackward"
    g = torch.randn(y.shape, generator=gen).to(y.dtype)
    y.backward(g)
    assert torch.equal(xg.grad, eager.rotary_embedding_backward(g, cos, sin, False))
    assert torch.equal(y, eager.rotary_embedding(x, cos, sin, False))
    assert (hal.explain("rotary_embedding_backward", g, cos, sin, False).kernel) == "numba"


def test_it_declines_large_arrays_five_dimensions_and_compiled_graphs() -> None:
    big = torch.randn(2, 8, NUMBA_ROTARY_ELEMENTS // 64 + 1, 32)
    c = torch.randn(big.shape[-2], 16)
    d = hal.explain("rotary_embedding", big, c, c, False)
    assert d.kernel == "torch" and "vectorised ops are as fast" in str(d)
    five = torch.randn(1, 2, 2, 4, 8)
    d = hal.explain("rotary_embedding", five, torch.randn(4, 4), torch.randn(4, 4), False)
    assert d.kernel == "torch" and "5 dimensions" in str(d)
    small = torch.randn(2, 4, 8, 16)
    c = torch.randn(8, 8)

    @torch.compile(backend="eager", fullgraph=True)
    def f(x: torch.Tensor) -> torch.Tensor:
        return hal.ops.rotary_embedding(x, c, c, False)

    torch.testing.assert_close(f(small), eager.rotary_embedding(small, c, c, False))
