"""What the CPU backend's calls become inside torch.compile graphs where their eager route is hal's
own node: torch's ops, which Inductor compiles with their neighbours, where those measured faster.

- rotary_embedding: eagerly hal's node (its backward op is one rotation, faster than torch's
  recorded ops there; for small arrays the numba pass, ``hal_backend_cpu.rotary``); in graphs torch's
  ops (an opaque node cost about twice the host time of Inductor's code).
- linear_cross_entropy: eagerly the blocked kernel (the whole logits only where they are one block
  of it); in graphs the LM head and loss as torch's ops while the logits fit
  ``hal_torch.loss.GRAPH_LOGITS_LIMIT``, beyond it the blocked kernel's opaque node.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hal
from tests.compiled import compiled_with_graphs


def test_rotary_is_hals_node_eagerly_and_torchs_ops_in_compiled_graphs(rng: np.random.Generator) -> None:
    x = torch.from_numpy(rng.standard_normal((2, 8, 4, 16))).requires_grad_(True)
    cos, sin = (torch.from_numpy(rng.standard_normal((8, 1, 8))) for _ in range(2))
    d = hal.explain("rotary_embedding", x, cos, sin)
    assert (d.backend, d.kernel, d.autograd_by) == ("cpu", "numba", "hal"), d  # small: the numba pass
    assert d.compiled is not None and d.compiled.traceable, d
    compiled, graphs = compiled_with_graphs(lambda t: hal.ops.rotary_embedding(t, cos, sin))
    g = torch.from_numpy(rng.standard_normal(x.shape))
    y = compiled(x)
    y.backward(g)
    assert len(graphs) == 2 and all("hal.rotary_embedding" not in code for code in graphs), graphs
    xr = x.detach().requires_grad_(True)
    ref = hal.ops.rotary_embedding(xr, cos, sin)  # eagerly: hal's node and backward op
    ref.backward(g)
    torch.testing.assert_close((y, x.grad), (ref, xr.grad))


@pytest.mark.parametrize("fits", [True, False], ids=["logits-fit", "logits-exceed"])
def test_lm_head_and_loss_join_compiled_graphs_while_the_logits_fit(fits: bool, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    from hal_torch import loss

    rows, dim, classes = 24, 16, 40
    if not fits:
        monkeypatch.setattr(loss, "GRAPH_LOGITS_LIMIT", rows * classes - 1)  # torch.compile's caches are not used: a fresh graph
    x = torch.from_numpy(rng.standard_normal((rows, dim), dtype=np.float32)).requires_grad_(True)
    w = torch.from_numpy(rng.standard_normal((classes, dim), dtype=np.float32) / 4).requires_grad_(True)
    t = torch.from_numpy(rng.integers(0, classes, rows))
    t[3] = -100
    d = hal.explain("linear_cross_entropy", x, w, t)
    assert (d.backend, d.kernel, d.autograd_by) == ("cpu", "blocked", "hal"), d
    assert (d.compiled is not None and d.compiled.traceable) == fits, d
    torch._dynamo.reset()
    compiled, graphs = compiled_with_graphs(lambda a, b: hal.ops.linear_cross_entropy(a, b, t) * 3)
    got = compiled(x, w)
    got.backward()
    assert len(graphs) == 2 and all(("hal.linear_cross_entropy" in code) != fits for code in graphs), graphs
    xr, wr = (a.detach().requires_grad_(True) for a in (x, w))
    want = hal.ops.linear_cross_entropy(xr, wr, t) * 3  # eagerly: the blocked kernel
    want.backward()
    torch.testing.assert_close((got, x.grad, w.grad), (want, xr.grad, wr.grad), rtol=1e-5, atol=1e-6)


def test_eager_lm_head_never_holds_more_logits_than_one_block() -> None:
    """The op's contract: no whole logits. torch's LM head and loss may run an eager call only where
    the blocked kernel would hold them as one block; a graph, up to GRAPH_LOGITS_LIMIT."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hal.plugin import Inputs
    from hal.registry import get_op
    from hal_backend_cpu import plugin
    from hal_backend_cpu.loss import BLOCK_ELEMENTS
    from hal_torch.loss import GRAPH_LOGITS_LIMIT

    decl = get_op("linear_cross_entropy")
    torch_lce = next(k for k in plugin.kernels if k.op == "linear_cross_entropy" and k.name == "torch")

    def reasons(rows: int, classes: int, fake: bool) -> list[str]:
        x, w = torch.empty(rows, 64, device="meta"), torch.empty(classes, 64, device="meta")
        t = torch.empty(rows, dtype=torch.int64, device="meta")
        with FakeTensorMode() as mode:
            if fake:
                x, w, t = (mode.from_tensor(a) for a in (x, w, t))
            return torch_lce.not_supported_reasons(Inputs(decl, (x, w, t, None, -100, 0.0, "mean"), "cpu", torch.device("cpu"), "float32", "torch", None))

    assert reasons(BLOCK_ELEMENTS // 1024, 1024, fake=False) == []
    assert reasons(BLOCK_ELEMENTS // 1024 + 1, 1024, fake=False) == [
        f"would hold the whole logits ({BLOCK_ELEMENTS // 1024 + 1} x 1024), more than {BLOCK_ELEMENTS} elements (one block of the blocked kernel)"]
    assert reasons(4096, 32000, fake=True) == []
    assert reasons(16384, 128256, fake=True) == [
        f"the whole logits (16384 x 128256) exceed {GRAPH_LOGITS_LIMIT} elements (hal_torch.loss.GRAPH_LOGITS_LIMIT)"]


def test_half_precision_attention_joins_compiled_graphs_and_stays_hals_node_eagerly(rng: np.random.Generator) -> None:
    """bfloat16 attention, which torch's flash CPU kernels do not take here: eagerly hal's node
    (its GEMM backward was faster at small sizes); in a graph torch's ops, whose backward is torch's
    own attention kernel (the opaque node's GEMM backward took 162 ms against 38 in a bf16 Llama step
    at (4, 8, 512, 64))."""
    q, k, v = (torch.from_numpy(rng.standard_normal((2, 4, 16, 8), dtype=np.float32)).to(torch.bfloat16).requires_grad_(True) for _ in range(3))
    d = hal.explain("scaled_dot_product_attention", q, k, v, is_causal=True)
    assert (d.backend, d.kernel, d.autograd_by) == ("cpu", "torch", "hal"), d
    assert d.compiled is not None and d.compiled.traceable, d
    torch._dynamo.reset()
    compiled, graphs = compiled_with_graphs(lambda a, b, c: hal.ops.scaled_dot_product_attention(a, b, c, is_causal=True))
    g = torch.from_numpy(rng.standard_normal(q.shape, dtype=np.float32)).to(torch.bfloat16)
    y = compiled(q, k, v)
    y.backward(g)
    assert len(graphs) == 2 and all("hal.scaled_dot_product_attention" not in code for code in graphs), graphs
    refs = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(*refs, is_causal=True)
    want.backward(g.float())
    for got, ref in zip((y, q.grad, k.grad, v.grad), (want, *(t.grad for t in refs))):
        torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)


def test_half_precision_block_tail_inference_joins_compiled_graphs(rng: np.random.Generator) -> None:
    """A bfloat16 eval fused_conv_bn_add_relu (a ResNet block's tail): eagerly oneDNN's fused call (the
    torch kernel on CPUs without oneDNN's bfloat16);
    in an inference graph torch's ops in bfloat16, the batch norm, add and ReLU left to Inductor
    (before, an opaque node each: the CPU-size ResNet inference under torch.compile ran at 0.78x of
    torch.compile alone, 0.95x after, 2026-12-03); with autograd, the training decomposition."""

    def arr(*shape: int) -> torch.Tensor:
        return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32))

    x = arr(2, 8, 6, 6).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    residual = arr(2, 8, 6, 6).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    w = (arr(8, 8, 3, 3) / 8).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    gamma, beta, mean = (arr(8).to(torch.bfloat16) for _ in range(3))
    var = (arr(8).abs() + 0.5).to(torch.bfloat16)

    def tail(a: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return hal.ops.fused_conv_bn_add_relu(a, w, None, gamma, beta, mean, var, r, padding=1, training=False)

    from hal_backend_cpu._device import onednn_dtype_reason

    d = hal.explain("fused_conv_bn_add_relu", x, w, None, gamma, beta, mean, var, residual, padding=1, training=False)
    # oneDNN's fused call where its bfloat16 primitives run on this CPU (AVX-512 or AVX-NE-CONVERT),
    # else the torch kernel (an AVX2-only EPYC)
    eager = "onednn" if onednn_dtype_reason("bfloat16") is None else "torch"
    assert (d.backend, d.kernel) == ("cpu", eager), d
    assert d.compiled is not None and d.compiled.kernel == "graph" and d.compiled.traceable, d
    torch._dynamo.reset()
    compiled, graphs = compiled_with_graphs(tail)
    with torch.no_grad():
        got, want = compiled(x, residual), tail(x, residual)
    assert graphs and all("hal.fused_conv_bn_add_relu" not in code for code in graphs), graphs
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    trained = hal.explain("fused_conv_bn_add_relu", x, w.detach().requires_grad_(True), None, gamma, beta, mean, var, residual, padding=1, training=False)
    assert trained.compiled is None or trained.compiled.kernel != "graph", trained
