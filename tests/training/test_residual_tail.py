"""ResNet's residual tail as hal ops: ``fused_conv_bn_add_relu`` against torch on the CPU (forward,
gradients of every input including the residual, running statistics), its routes in ``hal.explain``
and ``hal.stats``, and ``hal.nn.fuse`` on the repository's own ResNet (``hal_bench.models_resnet``):
no standalone batch norm, add or ReLU left in inference, the same outputs, gradients, running
statistics and state as the unfused model."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hal
import hal.nn
from hal_bench.models_resnet import ResNet
from tests.training.models import randomize_batch_norms

TOLERANCE = {torch.float64: dict(rtol=1e-10, atol=1e-11), torch.float32: dict(rtol=2e-4, atol=2e-5)}


def _tail_args(dtype: torch.dtype, layout: str, conv_bias: bool = False) -> dict[str, Any]:
    """A ResNet tail: 1x1 convolution expanding 8 -> 16 channels, batch norm state of every kind, a
    residual of the output's shape (random, never zeros)."""
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    x = torch.randn(3, 8, 7, 6, dtype=dtype).contiguous(memory_format=fmt)
    return dict(
        x=x,
        conv_weight=(torch.randn(16, 8, 1, 1, dtype=dtype) / 8**0.5).contiguous(memory_format=fmt),
        conv_bias=torch.randn(16, dtype=dtype) if conv_bias else None,
        bn_weight=torch.rand(16, dtype=dtype) + 0.5,
        bn_bias=torch.randn(16, dtype=dtype) * 0.5,
        running_mean=torch.randn(16, dtype=dtype) * 0.2,
        running_var=torch.rand(16, dtype=dtype) + 0.5,
        residual=torch.randn(3, 16, 7, 6, dtype=dtype).contiguous(memory_format=fmt),
    )


def _torch_tail(a: dict[str, Any], training: bool, momentum: float = 0.1, eps: float = 1e-5) -> torch.Tensor:
    y = F.conv2d(a["x"], a["conv_weight"], a["conv_bias"])
    return F.relu(F.batch_norm(y, a["running_mean"], a["running_var"], a["bn_weight"], a["bn_bias"], training, momentum, eps) + a["residual"])


def _copies(a: dict[str, Any], grad: bool) -> dict[str, Any]:
    """Fresh tensors of the same values (leaves needing a gradient where ``grad``; the running
    statistics never)."""
    out = {}
    for k, v in a.items():
        t = None if v is None else v.detach().clone()
        if t is not None and grad and k not in ("running_mean", "running_var"):
            t.requires_grad_(True)
        out[k] = t
    return out


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_op_matches_torch_forward_backward_and_running_stats(dtype: torch.dtype, training: bool, layout: str, seed: int) -> None:
    """hal.ops.fused_conv_bn_add_relu against conv2d -> batch_norm -> add -> relu in torch: the
    result, the gradient of every input (the residual's included) and the running statistics."""
    base = _tail_args(dtype, layout, conv_bias=True)
    ours, theirs = _copies(base, grad=True), _copies(base, grad=True)
    got = hal.ops.fused_conv_bn_add_relu(*ours.values(), momentum=0.3, training=training)
    want = _torch_tail(theirs, training, momentum=0.3)
    assert (want > 0).any() and (want == 0).any()  # the ReLU both passes and clips
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(ours[name], theirs[name], **TOLERANCE[dtype], msg=lambda m, n=name: f"{n}: {m}")
    if training:
        assert not torch.equal(ours["running_mean"], base["running_mean"])  # they were updated
    grad_out = torch.randn_like(want)
    leaves = [k for k, v in ours.items() if v is not None and v.requires_grad]
    grads = torch.autograd.grad(got, [ours[k] for k in leaves], grad_out)
    expected = torch.autograd.grad(want, [theirs[k] for k in leaves], grad_out)
    assert "residual" in leaves
    for name, g, w in zip(leaves, grads, expected):
        torch.testing.assert_close(g, w, **TOLERANCE[dtype], msg=lambda m, n=name: f"gradient of {n}: {m}")


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_forced_kernel_trains_through_the_backward_op(training: bool, seed: int) -> None:
    """With the op's own kernel forced, autograd runs hal's node and fused_conv_bn_add_relu_backward
    (which reads the ReLU's mask off the result), with torch's gradients."""
    base = _tail_args(torch.float32, "contiguous")
    ours, theirs = _copies(base, grad=True), _copies(base, grad=True)
    hal.reset_stats()
    with hal.use(kernel={"fused_conv_bn_add_relu": "torch"}):
        got = hal.ops.fused_conv_bn_add_relu(*ours.values(), training=training)
    want = _torch_tail(theirs, training)
    grad_out = torch.randn_like(want)
    got.backward(grad_out)
    want.backward(grad_out)
    ran = {op for (op, _, _), c in hal.stats().items() if c["calls"]}
    assert ran == {"fused_conv_bn_add_relu", "fused_conv_bn_add_relu_backward"}, ran
    for name in ("x", "conv_weight", "bn_weight", "bn_bias", "residual"):
        torch.testing.assert_close(ours[name].grad, theirs[name].grad, **TOLERANCE[torch.float32], msg=lambda m, n=name: f"gradient of {n}: {m}")


def test_explain_and_stats_name_the_op(seed: int) -> None:
    """Eval: one kernel call (oneDNN's convolution with an add and a ReLU post-op in float32); with
    autograd: the training decomposition, whose last step is scale_shift_act with the residual as
    its shift (torch's add and ReLU, recorded by torch's autograd)."""
    a = _tail_args(torch.float32, "contiguous")
    decision = hal.explain("fused_conv_bn_add_relu", *a.values())
    assert decision.route == "kernel" and (decision.backend, decision.kernel) == ("cpu", "onednn"), str(decision)
    hal.reset_stats()
    hal.ops.fused_conv_bn_add_relu(*a.values())
    assert hal.stats() == {("fused_conv_bn_add_relu", "cpu", "onednn"): {"calls": 1, "fallbacks": 0}}

    leaves = _copies(a, grad=True)
    trained = hal.explain("fused_conv_bn_add_relu", *leaves.values(), training=True)
    assert trained.route == "decomposition" and "fused_conv_bn_add_relu" in str(trained), str(trained)
    assert "scale_shift_act" in str(trained) and "shift: a float32 tensor of shape (3, 16, 7, 6)" in str(trained)
    hal.reset_stats()
    hal.ops.fused_conv_bn_add_relu(*leaves.values(), training=True).sum().backward()
    counted = {(op, kernel) for (op, _, kernel), c in hal.stats().items() if c["calls"]}
    assert counted == {("fused_conv_bn_add_relu", "composite"), ("conv2d", "onednn"), ("batch_norm", "torch"), ("scale_shift_act", "torch_residual")}, counted


def test_bad_residual_names_the_op_and_the_argument(seed: int) -> None:
    a = _tail_args(torch.float32, "contiguous")
    with pytest.raises(hal.InvalidArgumentError, match=r"fused_conv_bn_add_relu: argument 'residual' must be of shape \(3, 16, 7, 6\) "
                                                       r"\(the convolution output's shape\); got a float32 tensor of shape \(3, 16, 7, 1\)"):
        hal.ops.fused_conv_bn_add_relu(*{**a, "residual": a["residual"][..., :1]}.values())
    with pytest.raises(hal.InvalidArgumentError, match=r"argument 'residual' must be of the same dtype as 'x' \(float32\); got a float64"):
        hal.ops.fused_conv_bn_add_relu(*{**a, "residual": a["residual"].double()}.values())


# --- hal.nn.fuse on the repository's ResNet ---------------------------------------------------------


def _resnet(dtype: torch.dtype) -> nn.Module:
    """hal_bench's small ResNet (bottleneck blocks, downsample nn.Sequential(conv, bn)) with batch
    norms whose state is not the identity."""
    return randomize_batch_norms(ResNet((1, 2), width=4, classes=5).to(dtype))


def _counted_ops() -> dict[str, int]:
    calls: dict[str, int] = {}
    for (op, _, _), c in hal.stats().items():
        calls[op] = calls.get(op, 0) + c["calls"]
    return calls


def test_fuse_resnet_places_the_three_fused_modules() -> None:
    fused = hal.nn.fuse(_resnet(torch.float32))
    kinds: dict[str, list[str]] = {}
    for name, m in fused.named_modules():
        kinds.setdefault(type(m).__name__, []).append(name)
    assert kinds["FusedConvBNAddReLU2d"] == ["layers.0.0.conv3_fused", "layers.1.0.conv3_fused", "layers.1.1.conv3_fused"]  # every block's tail
    assert kinds["FusedConvBN2d"] == ["layers.0.0.downsample.0_fused", "layers.1.0.downsample.0_fused"]
    assert len(kinds["FusedConvBNReLU2d"]) == 1 + 2 * 3  # the stem, conv1 and conv2 of each block
    wrappers = [fused.get_submodule(n) for n in kinds["FusedConvBNAddReLU2d"] + kinds["FusedConvBN2d"] + kinds["FusedConvBNReLU2d"]]
    borrowed = {id(m) for w in wrappers for m in (w.conv, w.bn)}
    loose = [n for n in kinds["Conv2d"] + kinds["BatchNorm2d"] if id(fused.get_submodule(n)) not in borrowed]
    assert not loose, loose  # every convolution and batch norm is borrowed by a fused module


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_fused_resnet_inference_is_one_op_per_convolution(dtype: torch.dtype, seed: int) -> None:
    """Eval on channels_last images: the fused model gives the unfused one's logits, and every
    convolution is one hal call: no batch_norm, scale_shift_act (add or ReLU) runs."""
    model = _resnet(dtype).eval()
    reference = copy.deepcopy(model)
    fused = hal.nn.fuse(model)
    x = torch.randn(2, 3, 32, 32, dtype=dtype).contiguous(memory_format=torch.channels_last)
    hal.reset_stats()
    with torch.no_grad():
        got = fused(x)
        want = reference(x)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    calls = _counted_ops()
    assert calls == {"fused_conv_bn_relu": 7, "fused_conv_bn_add_relu": 3, "conv2d": 2}, calls


def test_fused_resnet_trains_like_the_unfused_model(seed: int) -> None:
    """Two SGD steps in float64: the same losses, gradients of every parameter, parameters, running
    statistics and num_batches_tracked; then the same eval output."""
    model = _resnet(torch.float64)
    reference = copy.deepcopy(model)
    fused = hal.nn.fuse(model, inplace=True)  # shares model's parameters and buffers: compared by model's names
    opt_f, opt_r = torch.optim.SGD(model.parameters(), lr=0.05), torch.optim.SGD(reference.parameters(), lr=0.05)
    for step in range(2):
        x = torch.randn(3, 3, 32, 32, dtype=torch.float64)
        loss_f, loss_r = fused(x).square().mean(), reference(x).square().mean()
        torch.testing.assert_close(loss_f, loss_r, rtol=1e-10, atol=1e-12)
        loss_f.backward()
        loss_r.backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-8, atol=1e-11, msg=lambda m, n=name: f"step {step} grad {n}: {m}")
        opt_f.step()
        opt_r.step()
        opt_f.zero_grad()
        opt_r.zero_grad()
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=lambda m, n=name: f"{n}: {m}")
    ran = {op for op, c in _counted_ops().items() if c}
    assert {"fused_conv_bn_add_relu", "fused_conv_bn_relu"} <= ran, ran
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(fused.eval()(x), reference.eval()(x), rtol=1e-9, atol=1e-11)


def test_fused_resnet_keeps_the_state_dict_of_the_unfused_one(seed: int) -> None:
    """hal.nn.fuse keeps every state_dict key (API.md v1.2): the unfused model's checkpoint loads
    into the fused model (strictly), which then computes what the unfused one does, and the fused
    model's checkpoint loads back into an unfused model."""
    source, target = _resnet(torch.float64), hal.nn.fuse(_resnet(torch.float64))
    assert set(target.state_dict()) == set(source.state_dict())  # (the order is torch.fx's, which follows the calls)
    target.load_state_dict(source.state_dict())
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(target.eval()(x), source.eval()(x), **TOLERANCE[torch.float64])
    back = _resnet(torch.float64)
    back.load_state_dict(target.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(x), source(x), **TOLERANCE[torch.float64])
