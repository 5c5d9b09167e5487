"""A small CNN and a transformer block written with hal.ops train like their plain PyTorch twins:
same forward, same gradients, same running statistics; and they compile with
``torch.compile(fullgraph=True)`` without graph breaks, matching eager."""

from __future__ import annotations

import time
from typing import Callable, Optional

import pytest
import torch

import hal

from .models import LlamaBlock, SmallCNN, TransformerBlock, twins


def _inputs(cls: type, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A random input of the model and a random gradient of its output."""
    if cls is SmallCNN:
        return torch.randn(3, 3, 6, 6, dtype=dtype), torch.randn(3, 3, dtype=dtype)
    if cls is LlamaBlock:
        return torch.randn(2, 5, 8, dtype=dtype), torch.randn((), dtype=dtype)
    return torch.randn(2, 5, 8, dtype=dtype), torch.randn(2, 1, 8, dtype=dtype)


def _forward_backward(
    model: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, run: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """Output, parameter gradients by name and input gradient of ``run`` (default: the model)."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = (model if run is None else run)(x)
    y.backward(grad)
    return y.detach(), {n: p.grad for n, p in model.named_parameters()}, x.grad


def _twins_match(cls: type, train: bool, seed: int) -> set[str]:
    """Two steps of the hal model and its PyTorch twin on the same inputs: outputs, gradients and
    buffers equal; returns the hal ops whose kernels ran."""
    hal_model, torch_model = twins(cls, seed)
    hal_model.train(train)
    torch_model.train(train)
    for _ in range(2):  # twice: the running statistics of the first step feed the second
        x, grad = _inputs(cls, torch.float64)
        got_y, got_g, got_gx = _forward_backward(hal_model, x, grad)
        want_y, want_g, want_gx = _forward_backward(torch_model, x, grad)
        torch.testing.assert_close(got_y, want_y, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(got_gx, want_gx, rtol=1e-8, atol=1e-9)
        for name, g in want_g.items():
            torch.testing.assert_close(got_g[name], g, rtol=1e-8, atol=1e-9, msg=lambda m, n=name: f"grad of {n}: {m}")
        for (name, a), b in zip(hal_model.named_buffers(), torch_model.buffers()):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"buffer {n}: {m}")
    return {op for (op, _, _), c in hal.stats().items() if c["calls"]}


@pytest.mark.parametrize("cls", [SmallCNN, TransformerBlock, LlamaBlock], ids=["cnn", "transformer", "llama"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_forward_and_gradients_match_pytorch(cls: type, train: bool, seed: int) -> None:
    ran = _twins_match(cls, train, seed)
    # hal's kernels ran, forward and, where hal's node differentiates them, backward (torch's own
    # kernels, the CNN's all, SDPA, rotary and swiglu here, are recorded by torch's autograd)
    want = {SmallCNN: {"conv2d", "batch_norm", "scale_shift_act"},
            TransformerBlock: {"scaled_dot_product_attention", "rms_norm_backward"},
            LlamaBlock: {"rotary_embedding", "swiglu", "linear_cross_entropy_backward"}}[cls]
    assert want <= ran, ran


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_the_cnn_matches_pytorch_through_hal_nodes(hal_nodes: None, train: bool, seed: int) -> None:
    """The CNN again with hal's own nodes (HAL_TORCH_AUTOGRAD=0): its backward ops run."""
    ran = _twins_match(SmallCNN, train, seed)
    assert {"conv2d_backward", "batch_norm_backward", "scale_shift_act_backward"} <= ran, ran


def test_float32_model_matches_pytorch(seed: int) -> None:
    hal_model, torch_model = twins(TransformerBlock, seed, torch.float32)
    x, grad = _inputs(TransformerBlock, torch.float32)
    got_y, got_g, got_gx = _forward_backward(hal_model, x, grad)
    want_y, want_g, want_gx = _forward_backward(torch_model, x, grad)
    torch.testing.assert_close(got_y, want_y, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_gx, want_gx, rtol=1e-4, atol=1e-5)
    for name, g in want_g.items():
        torch.testing.assert_close(got_g[name], g, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"grad of {n}: {m}")


def _as_accurate_as_eager(got: torch.Tensor, eager: torch.Tensor, reference: torch.Tensor, scale: float,
                          what: str) -> None:
    """A compiled float32 result is as accurate as eager's: its largest error against the float64
    reference is at most twice eager's, plus one part in a million of `scale`. The two sum in
    different orders (AOTAutograd's graph against eager's calls), and where terms cancel one element
    can differ by far more than float32's relative tolerance (3e-6 absolute, 2e-4 relative, in a
    weight gradient, seen at one seed), while a wrong graph errs by the gradient's own scale.

    `scale` is the magnitude of the terms the result sums, not the result's own: a convolution bias
    ahead of a batch norm has a gradient that is zero in exact arithmetic (1.7e-16 in float64), so
    its float32 values are rounding noise of the upstream gradients (1.8e-7 compiled against 7.5e-8
    eager, seen at one seed). Gradients take the largest reference gradient of the model."""
    err = (got.double() - reference).abs().max().item()
    allowed = 2 * (eager.double() - reference).abs().max().item() + 1e-6 * scale
    assert err <= allowed, f"{what}: error {err:.3g} against float64, eager's allows {allowed:.3g}"


@pytest.mark.parametrize("cls", [SmallCNN, TransformerBlock, LlamaBlock], ids=["cnn", "transformer", "llama"])
def test_compiles_fullgraph_without_graph_breaks(cls: type, seed: int) -> None:
    """Dynamo sees every hal op as one torch.ops.hal node (explain: one graph, no break); the graph
    compiled through AOTAutograd (aot_eager: functionalisation, the autograd formulas, the mutated
    running statistics) gives eager's outputs, gradients and buffers."""
    model, _ = twins(cls, seed, torch.float32)
    model.train()
    x, grad = _inputs(cls, torch.float32)
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    traced = {str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert any(t.startswith("hal.") for t in traced), traced

    eager, _ = twins(cls, seed, torch.float32)
    compiled_model, _ = twins(cls, seed, torch.float32)
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    t0 = time.perf_counter()
    got_y, got_g, got_gx = _forward_backward(compiled_model, x, grad, compiled)
    print(f"compile + first step: {time.perf_counter() - t0:.1f} s")
    want_y, want_g, want_gx = _forward_backward(eager, x, grad)
    reference, _ = twins(cls, seed, torch.float64)
    reference.train()
    ref_y, ref_g, ref_gx = _forward_backward(reference, x.double(), grad.double())
    _as_accurate_as_eager(got_y, want_y, ref_y, ref_y.abs().max().item(), "output")
    grad_scale = max(g.abs().max().item() for g in [ref_gx, *ref_g.values()])
    _as_accurate_as_eager(got_gx, want_gx, ref_gx, grad_scale, "grad of the input")
    for name, g in want_g.items():
        _as_accurate_as_eager(got_g[name], g, ref_g[name], grad_scale, f"grad of {name}")
    for a, b in zip(compiled_model.buffers(), eager.buffers()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_inductor_compiles_cnn_in_eval(seed: int) -> None:
    """The default backend (inductor) around hal's opaque ops, eval mode: same outputs as eager, and
    the running statistics untouched."""
    model, _ = twins(SmallCNN, seed, torch.float32)
    model.eval()
    x, _ = _inputs(SmallCNN, torch.float32)
    before = [b.clone() for b in model.buffers()]
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        got = compiled(x)
        want = model(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(model.buffers(), before):
        assert torch.equal(a, b)


def test_dynamic_shapes_compile_once(seed: int) -> None:
    """With dynamic=True one graph serves several batch and sequence lengths: the fake kernels keep
    sizes symbolic (the checker sees their hints), and results and gradients match eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    model, _ = twins(TransformerBlock, seed, torch.float32)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=counter)
    for batch, seq in ((2, 5), (3, 7), (4, 3)):  # sizes 0 and 1 are always specialised by Dynamo
        x = torch.randn(batch, seq, 8)
        grad = torch.randn(batch, 1, 8)
        got_y, got_g, _ = _forward_backward(model, x, grad, compiled)
        want_y, want_g, _ = _forward_backward(model, x, grad)
        torch.testing.assert_close(got_y, want_y, rtol=1e-5, atol=1e-6)
        for name, g in want_g.items():
            torch.testing.assert_close(got_g[name], g, rtol=1e-5, atol=1e-6)
    assert counter.frame_count == 1
