"""On a CUDA device: calls with autograd whose kernel is torch's own op take torch's autograd
(``autograd_by == "torch"``: torch's C++ nodes, no hal node) and give eager PyTorch's results and
gradients; the kernels that must not (float32 convolutions, whose recorded backward would run
outside the IEEE float32 guard; rms_norm above the host-bound size) keep hal's node.

Skipped without a CUDA device (CI); run on the device machine (benchmarks/h200.sh).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hal
from tests.cuda._support import fresh_seed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _leaves(gen: torch.Generator, *shapes, dtype=torch.bfloat16, fmt=None) -> list[torch.Tensor]:
    out = []
    for shape in shapes:
        t = torch.randn(*shape, generator=gen).to("cuda", dtype)
        out.append((t.contiguous(memory_format=fmt) if fmt is not None else t).requires_grad_(True))
    return out


def _twins(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_(True) for t in ts]


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("kernel", ["cudnn", "flash", "efficient"])
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
def test_sdpa_is_recorded_by_torch_and_matches_it(kernel: str, layout: str) -> None:
    gen = torch.Generator().manual_seed(fresh_seed())
    b, h, n, e = 2, 4, 96, 64
    if layout == "bhld":
        q, k, v = _leaves(gen, (b, h, n, e), (b, h, n, e), (b, h, n, e))
        view = lambda t: t  # noqa: E731
    else:  # (B, L, H, E) projections seen as (B, H, L, E): rows contiguous, heads strided
        q, k, v = _leaves(gen, (b, n, h, e), (b, n, h, e), (b, n, h, e))
        view = lambda t: t.transpose(1, 2)  # noqa: E731
    with hal.use(kernel={"scaled_dot_product_attention": kernel}):
        d = hal.explain("scaled_dot_product_attention", view(q), view(k), view(v), None, True)
        assert (d.route, d.autograd_by, d.kernel) == ("autograd", "torch", kernel), d
        out = hal.ops.scaled_dot_product_attention(view(q), view(k), view(v), None, True)
    assert "Hal" not in type(out.grad_fn).__name__
    q2, k2, v2 = _twins([q, k, v])
    want = F.scaled_dot_product_attention(view(q2), view(k2), view(v2), is_causal=True)
    _close(out, want, 2e-2)
    g = torch.randn(out.shape, generator=gen).to("cuda", out.dtype)
    out.backward(g)
    want.backward(g)
    for got, ref in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        _close(got, ref, 5e-2)


@pytest.mark.parametrize("kernel", ["cudnn", "flash", "efficient"])
@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_grouped_queries_match_torch(kernel: str, causal: bool) -> None:
    """hal.nn.patch's grouped-query call, q (B, Hkv, G, L, E) over k, v (B, Hkv, 1, S, E): cuDNN and
    FlashAttention take the key/value heads as they are (no repeat), efficient attention through the
    broadcast; results and gradients equal torch's SDPA with enable_gqa on the (B, H, L, E) views."""
    gen = torch.Generator().manual_seed(fresh_seed())
    b, hkv, g, n, e = 2, 2, 4, 80, 64
    # projections laid out as a model's: (B, L, H, E), seen as (B, H, L, E), the heads then grouped
    qp, kp, vp = _leaves(gen, (b, n, hkv * g, e), (b, n, hkv, e), (b, n, hkv, e))
    q = qp.transpose(1, 2).reshape(b, hkv, g, n, e)
    k, v = kp.transpose(1, 2).unsqueeze(2), vp.transpose(1, 2).unsqueeze(2)
    with hal.use(kernel={"scaled_dot_product_attention": kernel}):
        d = hal.explain("scaled_dot_product_attention", q, k, v, None, causal)
        assert (d.route, d.kernel) == ("autograd", kernel), d
        out = hal.ops.scaled_dot_product_attention(q, k, v, None, causal)
    assert out.shape == (b, hkv, g, n, e)
    q2, k2, v2 = _twins([qp, kp, vp])
    want = F.scaled_dot_product_attention(q2.transpose(1, 2), k2.transpose(1, 2), v2.transpose(1, 2), is_causal=causal,
                                          enable_gqa=True)
    _close(out.reshape(b, hkv * g, n, e), want, 2e-2)
    grad = torch.randn(want.shape, generator=gen).to("cuda", want.dtype)
    out.backward(grad.reshape(out.shape))
    want.backward(grad)
    for got, ref in ((qp.grad, q2.grad), (kp.grad, k2.grad), (vp.grad, v2.grad)):
        _close(got, ref, 5e-2)


def test_training_layer_in_bf16_is_recorded_and_matches_eager() -> None:
    gen = torch.Generator().manual_seed(fresh_seed())
    cl = torch.channels_last
    x, w = _leaves(gen, (4, 16, 12, 12), (32, 16, 3, 3), fmt=cl)
    gamma = (torch.rand(32, generator=gen) + 0.5).cuda().requires_grad_(True)
    beta = torch.randn(32, generator=gen).cuda().requires_grad_(True)
    rm, rv = torch.randn(32, generator=gen).cuda(), torch.rand(32, generator=gen).cuda() + 0.5
    rm2, rv2 = rm.clone(), rv.clone()
    d = hal.explain("fused_conv_bn_relu", x, w, None, gamma, beta, rm, rv, 1, 1, 1, 1, 1e-5, 0.1, True)
    # the CUDA plugin's ``torch`` kernel: torch's convolution, batch norm and ReLU in one hal entry,
    # recorded by torch's autograd (the decomposition's three steps each cost hal's host time)
    assert (d.route, d.kernel, d.autograd_by) == ("autograd", "torch", "torch"), d
    out = hal.ops.fused_conv_bn_relu(x, w, None, gamma, beta, rm, rv, 1, 1, 1, 1, 1e-5, 0.1, True)
    assert "Hal" not in type(out.grad_fn).__name__
    x2, w2, gamma2, beta2 = _twins([x, w, gamma, beta])
    want = F.relu(F.batch_norm(F.conv2d(x2, w2, None, 1, 1), rm2, rv2, gamma2, beta2, True, 0.1, 1e-5))
    _close(out, want, 2e-2)
    _close(rm, rm2, 1e-3)
    g = torch.randn(out.shape, generator=gen).to("cuda", out.dtype).contiguous(memory_format=cl)
    out.backward(g)
    want.backward(g)
    for got, ref in ((x.grad, x2.grad), (w.grad, w2.grad), (gamma.grad, gamma2.grad), (beta.grad, beta2.grad)):
        _close(got, ref, 5e-2)


def test_float32_convolutions_and_large_rms_norms_keep_hals_node() -> None:
    gen = torch.Generator().manual_seed(fresh_seed())
    x, w = _leaves(gen, (2, 8, 10, 10), (8, 8, 3, 3), dtype=torch.float32)
    d = hal.explain("conv2d", x, w, None, 1, 1)
    assert (d.kernel, d.autograd_by) == ("cudnn", "hal"), d
    big = torch.empty(4097, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    d = hal.explain("rms_norm", big, (4096,), None, 1e-6)
    assert (d.kernel, d.autograd_by) == ("triton", "hal"), d
    small = torch.randn(64, 256, generator=gen).to("cuda", torch.bfloat16).requires_grad_(True)
    d = hal.explain("rms_norm", small, (256,), None, 1e-6)
    assert (d.kernel, d.autograd_by) == ("torch", "torch"), d
    gate, up = _leaves(gen, (64, 512), (64, 512))
    d = hal.explain("swiglu", gate, up)
    assert (d.kernel, d.autograd_by) == ("torch", "torch"), d


def test_compiled_lm_head_and_loss_join_the_graph_where_the_logits_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torch.compile, linear_cross_entropy in bfloat16 whose logits fit the limit becomes
    torch's ops in the graph (Inductor's LM head and loss, no opaque hal node; eager calls keep the
    blocked kernel); above the limit the opaque node stays. Both match eager PyTorch's loss and
    gradients."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    from hal_torch import loss as eager_loss

    gen = torch.Generator().manual_seed(fresh_seed())
    x, w = _leaves(gen, (512, 256), (3000, 256))
    with torch.no_grad():
        w.mul_(0.05)
    t = torch.randint(0, 3000, (512,), generator=gen).to("cuda")
    t[7] = -100
    eager_route = hal.explain("linear_cross_entropy", x, w, t)
    assert eager_route.kernel != "torch" and eager_route.compiled is not None and eager_route.compiled.kernel == "torch", eager_route
    xr, wr = _twins([x, w])
    ref = F.cross_entropy(F.linear(xr, wr).float(), t)
    ref.backward()
    for limit, joins in ((eager_loss.GRAPH_LOGITS_LIMIT, True), (512 * 3000 - 1, False)):
        monkeypatch.setattr(eager_loss, "GRAPH_LOGITS_LIMIT", limit)  # not in the compile caches' keys: they are off
        torch._dynamo.reset()
        hal.dispatch.reset()  # decisions cached under the old limit
        compiled = torch.compile(lambda a, b: hal.ops.linear_cross_entropy(a, b, t), fullgraph=True)
        x.grad = w.grad = None
        hal.reset_stats()
        with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
            loss = compiled(x, w)
            loss.backward()
        ran = {op for (op, _, _), counts in hal.stats().items() if counts["calls"]}
        assert ("linear_cross_entropy" not in ran) is joins, ran  # an opaque node counts its call
        _close(loss, ref, 2e-2)
        _close(x.grad, xr.grad, 2e-2 * float(xr.grad.abs().max()))
        _close(w.grad, wr.grad, 2e-2 * float(wr.grad.abs().max()))
