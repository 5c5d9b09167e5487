"""hal.nn: FusedConvBNReLU2d against nn.Sequential(Conv2d, BatchNorm2d, ReLU), the Linear with an
activation and the norms against PyTorch's modules, and hal.nn.fuse on a ResNet-style model."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hal
import hal.nn


def _sequential(cin: int = 3, cout: int = 5, **conv: Any) -> nn.Sequential:
    bn_kwargs = {k: conv.pop(k) for k in ("momentum", "affine", "track_running_stats") if k in conv}
    seq = nn.Sequential(nn.Conv2d(cin, cout, 3, **conv), nn.BatchNorm2d(cout, **bn_kwargs), nn.ReLU())
    with torch.no_grad():  # non-trivial batch-norm state
        seq[1].running_mean.normal_() if seq[1].running_mean is not None else None
        seq[1].running_var.uniform_(0.5, 1.5) if seq[1].running_var is not None else None
        if seq[1].weight is not None:
            seq[1].weight.uniform_(0.5, 1.5)
            seq[1].bias.normal_()
    return seq.double()


def test_state_dict_loads_both_ways(seed: int) -> None:
    seq = _sequential(bias=True, padding=1)
    fused = hal.nn.FusedConvBNReLU2d(3, 5, 3, padding=1, bias=True).double()
    assert list(fused.state_dict()) == list(seq.state_dict())
    fused.load_state_dict(seq.state_dict())
    back = _sequential(bias=True, padding=1)
    back.load_state_dict(fused.state_dict())
    for (k, a), b in zip(seq.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), k


@pytest.mark.parametrize(
    "options",
    [
        dict(padding=1),
        dict(padding="same", bias=True, dilation=2),
        dict(stride=2, groups=1, momentum=None),
        dict(padding=1, affine=False),
        dict(padding=1, track_running_stats=False),
    ],
    ids=["pad1", "same-dilated-bias", "stride2-cumulative-momentum", "no-affine", "no-running-stats"],
)
def test_train_and_eval_match_sequential(options: dict[str, Any], seed: int) -> None:
    """Three training steps (batch statistics, running stats, num_batches_tracked, gradients) and
    an eval step (running statistics, folded in the kernel) give the Sequential's results."""
    seq = _sequential(**dict(options))
    fused = hal.nn.FusedConvBNReLU2d.from_modules(*copy.deepcopy(seq)[:2])
    for step, training in enumerate((True, True, True, False)):
        seq.train(training)
        fused.train(training)
        x = torch.randn(4, 3, 7, 7, dtype=torch.float64)
        want, got = seq(x), fused(x)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
        g = torch.randn_like(want)
        want.backward(g)
        got.backward(g)
        for (name, p), q in zip(seq.named_parameters(), fused.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-8, atol=1e-10, msg=lambda m, n=name: f"step {step} grad {n}: {m}")
        for (name, a), b in zip(seq.state_dict().items(), fused.state_dict().values()):
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"step {step} {n}: {m}")


def test_fused_module_under_bfloat16_autocast(seed: int) -> None:
    """Under autocast the convolution runs in bfloat16 (as nn.Conv2d does) beside float32
    batch-norm parameters and statistics."""
    seq = _sequential(padding=1).float()
    fused = hal.nn.FusedConvBNReLU2d.from_modules(*copy.deepcopy(seq)[:2])
    x = torch.randn(2, 3, 6, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = fused(x), seq(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)
    torch.testing.assert_close(fused.bn.running_mean, seq[1].running_mean, rtol=0.02, atol=0.01)


@pytest.mark.parametrize("act,torch_act", [("relu", F.relu), ("gelu", F.gelu), ("silu", F.silu), ("tanh", torch.tanh)])
def test_linear_with_activation(act: str, torch_act: Any, seed: int) -> None:
    ref = nn.Linear(6, 4).double()
    ours = hal.nn.Linear.from_linear(copy.deepcopy(ref), act)
    assert list(ours.state_dict()) == list(ref.state_dict())
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    got, want = ours(x), torch_act(ref(x))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    g = torch.randn_like(want)
    torch.testing.assert_close(torch.autograd.grad(got, ours.weight, g)[0], torch.autograd.grad(want, ref.weight, g)[0], rtol=1e-9, atol=1e-11)
    with pytest.raises(ValueError, match="act must be one of"):
        hal.nn.Linear(2, 2, act="swish")


@pytest.mark.parametrize("cls,ref_cls", [(hal.nn.LayerNorm, nn.LayerNorm), (hal.nn.RMSNorm, nn.RMSNorm)])
def test_norm_modules(cls: type, ref_cls: type, seed: int) -> None:
    ref = ref_cls((4, 5), dtype=torch.float64)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_()
    ours = cls((4, 5), dtype=torch.float64)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    got, want = ours(x), ref(x)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    g = torch.randn_like(want)
    torch.testing.assert_close(torch.autograd.grad(got, x, g)[0], torch.autograd.grad(want, x, g)[0], rtol=1e-9, atol=1e-11)


def test_modules_follow_autocast_lists(seed: int) -> None:
    """Under bfloat16 autocast the Linear runs in bfloat16 (as nn.Linear), the norms in float32;
    float64 inputs are left alone, as autocast leaves them."""
    lin, ref = hal.nn.Linear(4, 3, act="relu"), nn.Linear(4, 3)
    ref.load_state_dict(lin.state_dict())
    norm = hal.nn.LayerNorm(3)
    x = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
        z = norm(y)
        wide = hal.nn.Linear(4, 3).double()(x.double())
    assert y.dtype == torch.bfloat16 and z.dtype == torch.float32 and wide.dtype == torch.float64
    torch.testing.assert_close(y.float(), F.relu(ref(x)), rtol=0.02, atol=0.02)
    torch.testing.assert_close(z, F.layer_norm(y.float(), (3,)), rtol=1e-5, atol=1e-5)


class BasicBlock(nn.Module):
    """torchvision's BasicBlock: ``self.relu`` serves both the fused chain and the residual."""

    def __init__(self, c: int, downsample: bool = False) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, stride=2 if downsample else 1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.downsample = nn.Sequential(nn.Conv2d(c, c, 1, stride=2, bias=False), nn.BatchNorm2d(c)) if downsample else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNetish(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True))
        self.layer1 = BasicBlock(4)
        self.layer2 = BasicBlock(4, downsample=True)
        self.fc1 = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layer2(self.layer1(self.stem(x))).mean(dim=(2, 3))
        return self.fc2(F.gelu(self.fc1(y)))


def test_fuse_resnet_style_model(seed: int) -> None:
    """fuse finds stem, layer1/2 conv1->bn1->relu (self.relu reused) and fc1->gelu; leaves
    conv2->bn2 (followed by the residual add) and the downsample; the fused model computes the
    same function in eval and takes the same training step (outputs, gradients, running stats)."""
    model = ResNetish().double()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_()
    reference = copy.deepcopy(model)
    fused = hal.nn.fuse(model, inplace=True)  # shares model's parameters: compare by model's names
    kinds = {name: type(m).__name__ for name, m in fused.named_modules()}
    assert [n for n, k in kinds.items() if k == "FusedConvBNReLU2d"] == ["stem.0", "layer1.conv1", "layer2.conv1"]
    assert kinds["fc1"] == "Linear" and isinstance(fused.fc1, hal.nn.Linear) and fused.fc1.act == "gelu"
    assert type(fused.fc2) is nn.Linear and type(fused.layer1.bn2) is nn.BatchNorm2d
    assert "layer1.bn1" not in kinds and "layer1.relu" in kinds  # the reused ReLU stays for the residual

    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    fused.eval()
    reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(fused(x), reference(x), rtol=1e-9, atol=1e-10)
    calls: dict[str, int] = {}
    for (op, _, _), c in hal.stats().items():
        calls[op] = calls.get(op, 0) + c["calls"]
    assert calls["fused_conv_bn_relu"] == 3 and calls["linear"] == 1, calls  # the fused kernels ran

    fused.train()
    reference.train()
    opt_f = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_r = torch.optim.SGD(reference.parameters(), lr=0.1)
    loss_f, loss_r = fused(x).square().sum(), reference(x).square().sum()
    torch.testing.assert_close(loss_f, loss_r, rtol=1e-9, atol=1e-10)
    loss_f.backward()
    loss_r.backward()
    opt_f.step()
    opt_r.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
    for (name, a), b in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


def test_fuse_leaves_what_it_cannot_fuse(seed: int) -> None:
    """A conv used twice, a batch norm whose output is used twice, and a model fx cannot trace."""

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 1)
            self.bn = nn.BatchNorm2d(2)
            self.conv2 = nn.Conv2d(2, 2, 1)
            self.bn2 = nn.BatchNorm2d(2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = F.relu(self.bn(self.conv(x)))
            z = self.bn2(self.conv2(self.conv(y)))
            return F.relu(z) + z

    fused = hal.nn.fuse(Shared())
    assert not [m for m in fused.modules() if isinstance(m, hal.nn.FusedConvBNReLU2d)]
    x = torch.randn(2, 2, 3, 3)
    model = Shared().eval()
    torch.testing.assert_close(hal.nn.fuse(model).eval()(x), model(x))

    class Untraceable(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x if x.sum() > 0 else -x

    with pytest.raises(ValueError, match="could not trace"):
        hal.nn.fuse(Untraceable())


def test_fused_model_compiles_without_graph_breaks(seed: int) -> None:
    """The fused ResNet-style model under bfloat16 autocast, in training: one Dynamo graph."""
    model = hal.nn.fuse(ResNetish())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(model)(torch.randn(2, 3, 8, 8))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
