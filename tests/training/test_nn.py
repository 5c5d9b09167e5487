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
from hal.nn.fuse import fuse_notes
from tests.training.models import randomize_batch_norms


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


def _same_result_and_gradients(seq: nn.Module, fused: nn.Module, want: torch.Tensor, got: torch.Tensor, label: str) -> None:
    """The fused module's result equals the reference's, and after one backward of a fresh random
    gradient through both, so do the gradients of their parameters (in order)."""
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    g = torch.randn_like(want)
    want.backward(g)
    got.backward(g)
    for (name, p), q in zip(seq.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-8, atol=1e-10, msg=lambda m, n=name: f"{label} grad {n}: {m}")


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
        _same_result_and_gradients(seq, fused, seq(x), fused(x), f"step {step}")
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


def _conv_bn(**options: Any) -> nn.Sequential:
    """nn.Sequential(Conv2d(3, 5, 3), BatchNorm2d(5)) in float64 with non-trivial batch-norm state."""
    return _sequential(**options)[:2]


def _residual_options() -> list[Any]:
    return [
        pytest.param(dict(padding=1), id="pad1"),
        pytest.param(dict(stride=2, bias=True, momentum=None), id="stride2-bias-cumulative-momentum"),
        pytest.param(dict(padding="same", dilation=2, affine=False), id="same-dilated-no-affine"),
        pytest.param(dict(padding=1, track_running_stats=False), id="no-running-stats"),
    ]


@pytest.mark.parametrize("options", _residual_options())
def test_conv_bn_add_relu_module_matches_sequential_plus_residual(options: dict[str, Any], seed: int) -> None:
    """FusedConvBNAddReLU2d(x, r) against relu(Sequential(conv, bn)(x) + r): three training steps and
    an eval step (results, gradients of x, r and every parameter, running statistics, state_dict)."""
    seq = _conv_bn(**dict(options))
    fused = hal.nn.FusedConvBNAddReLU2d.from_modules(*copy.deepcopy(seq))
    assert list(fused.state_dict()) == list(seq.state_dict())
    for step, training in enumerate((True, True, True, False)):
        seq.train(training)
        fused.train(training)
        x = torch.randn(4, 3, 7, 7, dtype=torch.float64, requires_grad=True)
        xr = x.detach().clone().requires_grad_(True)
        shape = seq[0](x).shape
        r = torch.randn(shape, dtype=torch.float64, requires_grad=True)
        rr = r.detach().clone().requires_grad_(True)
        _same_result_and_gradients(seq, fused, F.relu(seq(xr) + rr), fused(x, r), f"step {step}")
        torch.testing.assert_close(x.grad, xr.grad, rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(r.grad, rr.grad, rtol=1e-8, atol=1e-10)
        for (name, a), b in zip(seq.state_dict().items(), fused.state_dict().values()):
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"step {step} {n}: {m}")


def test_conv_bn_add_relu_module_state_dict_and_unfusable_residuals(seed: int) -> None:
    """The state_dict of nn.Sequential(conv, bn) loads both ways; a residual the op does not take (one
    that broadcasts, one of another dtype) is added by torch, as the unfused chain adds it."""
    seq = _conv_bn(padding=1, bias=True)
    fused = hal.nn.FusedConvBNAddReLU2d(3, 5, 3, padding=1, bias=True).double()
    fused.load_state_dict(seq.state_dict())
    back = _conv_bn(padding=1, bias=True)
    back.load_state_dict(fused.state_dict())
    for (k, a), b in zip(seq.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), k
    seq.eval()
    fused.eval()
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    hal.reset_stats()
    for r in (torch.randn(5, 1, 1, dtype=torch.float64), torch.randn(2, 5, 6, 6, dtype=torch.float32)):
        with torch.no_grad():
            got, want = fused(x, r), F.relu(seq(x) + r)
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    assert {op for (op, _, _) in hal.stats()} == {"conv2d", "batch_norm"}  # the unfused chain, torch's add and ReLU


def test_conv_bn_module_folds_in_eval_and_matches_sequential(seed: int) -> None:
    """FusedConvBN2d against nn.Sequential(conv, bn): training steps through conv2d and batch_norm;
    eval without autograd is one conv2d with the batch norm folded in (refolded after an update of
    the parameters); eval with parameters needing gradients stays unfolded and gives them."""
    seq = _conv_bn(padding=1, bias=True, momentum=None)
    fused = hal.nn.FusedConvBN2d.from_modules(*copy.deepcopy(seq))
    assert list(fused.state_dict()) == list(seq.state_dict())
    opt_s, opt_f = torch.optim.SGD(seq.parameters(), lr=0.1), torch.optim.SGD(fused.parameters(), lr=0.1)
    for _ in range(2):
        x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
        want, got = seq(x), fused(x)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
        want.square().sum().backward()
        got.square().sum().backward()
        opt_s.step()
        opt_f.step()
    for (k, a), b in zip(seq.state_dict().items(), fused.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-10, msg=k)

    seq.eval()
    fused.eval()
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    hal.reset_stats()
    with torch.no_grad():
        torch.testing.assert_close(fused(x), seq(x), rtol=1e-9, atol=1e-10)
    assert {op for (op, _, _) in hal.stats()} == {"conv2d"}
    with torch.no_grad():
        for a, b in ((seq[1].weight, fused.bn.weight), (seq[0].bias, fused.conv.bias)):
            a.mul_(1.5)
            b.mul_(1.5)
        torch.testing.assert_close(fused(x), seq(x), rtol=1e-9, atol=1e-10)  # the fold follows the update

    _same_result_and_gradients(seq, fused, seq(x), fused(x), "eval")


def test_conv_bn_modules_under_bfloat16_autocast(seed: int) -> None:
    """Under autocast the convolution (and the residual) run in bfloat16 beside float32 batch-norm
    parameters and statistics, as FusedConvBNReLU2d; in eval too, with the fold in float32."""
    seq = _conv_bn(padding=1).float()
    add = hal.nn.FusedConvBNAddReLU2d.from_modules(*copy.deepcopy(seq))
    plain = hal.nn.FusedConvBN2d.from_modules(*copy.deepcopy(seq))
    x, r = torch.randn(2, 3, 6, 6), torch.randn(2, 5, 6, 6)
    for training in (True, False):
        for m in (seq, add, plain):
            m.train(training)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = seq(x)
            got_add, got_plain = add(x, r), plain(x)
        assert got_add.dtype == got_plain.dtype == torch.bfloat16
        torch.testing.assert_close(got_plain.float(), want.float(), rtol=0.05, atol=0.05)
        torch.testing.assert_close(got_add.float(), F.relu(want.float() + r), rtol=0.05, atol=0.05)
    torch.testing.assert_close(add.bn.running_mean, seq[1].running_mean, rtol=0.02, atol=0.01)


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
    """fuse finds stem, layer1/2 conv1->bn1->relu (self.relu reused), the tails conv2->bn2->add->relu,
    the downsample conv->bn and fc1->gelu; the fused model computes the same function in eval and
    takes the same training step (outputs, gradients, running stats)."""
    model = randomize_batch_norms(ResNetish().double(), mean_std=1.0, bias_std=1.0)
    reference = copy.deepcopy(model)
    fused = hal.nn.fuse(model, inplace=True)  # shares model's parameters: compare by model's names
    kinds = {name: type(m).__name__ for name, m in fused.named_modules()}
    assert [n for n, k in kinds.items() if k == "FusedConvBNReLU2d"] == ["stem.0_fused", "layer1.conv1_fused", "layer2.conv1_fused"]
    assert [n for n, k in kinds.items() if k == "FusedConvBNAddReLU2d"] == ["layer1.conv2_fused", "layer2.conv2_fused"]
    assert [n for n, k in kinds.items() if k == "FusedConvBN2d"] == ["layer2.downsample.0_fused"]
    assert kinds["fc1_fused"] == "FusedLinearAct" and fused.fc1_fused.linear is fused.fc1 and fused.fc1_fused.act == "gelu"
    assert type(fused.fc1) is nn.Linear and type(fused.fc2) is nn.Linear
    # the fused modules borrow the convolutions and batch norms, which keep their paths and keys
    assert fused.get_submodule("layer1.conv2_fused").bn is fused.get_submodule("layer1.bn2")
    assert set(fused.state_dict()) == set(reference.state_dict())

    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    fused.eval()
    reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(fused(x), reference(x), rtol=1e-9, atol=1e-10)
    calls: dict[str, int] = {}
    for (op, _, _), c in hal.stats().items():
        calls[op] = calls.get(op, 0) + c["calls"]
    # the fused kernels ran; the downsample is one convolution with the batch norm folded in
    assert calls["fused_conv_bn_relu"] == 3 and calls["fused_conv_bn_add_relu"] == 2 and calls["conv2d"] == 1 and calls["linear"] == 1, calls
    assert "batch_norm" not in calls and "scale_shift_act" not in calls, calls

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


class _Tails(nn.Module):
    """Residual tails written every way the fuse pass takes (and two it must leave alone)."""

    def __init__(self) -> None:
        super().__init__()
        for i in range(7):
            self.add_module(f"conv{i}", nn.Conv2d(4, 4, 3, padding=1, bias=False))
            self.add_module(f"bn{i}", nn.BatchNorm2d(4))
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.relu(self.bn0(self.conv0(x)) + x)  # operator.add, bn first
        b = F.relu(torch.add(a, self.bn1(self.conv1(a))))  # torch.add, the residual first
        c = self.bn2(self.conv2(b))
        c += b  # +=
        c = torch.relu(c)
        d = self.bn3(self.conv3(c)).add(c).relu()  # .add
        e = self.bn4(self.conv4(d)).add_(d).relu_()  # .add_ into the batch norm's result
        s = self.bn5(self.conv5(e)) + e  # the sum is used twice: conv -> bn only
        f = F.relu(s) + s
        g = f.clone()
        g.add_(self.bn6(self.conv6(f)))  # .add_ into the residual: left to torch (the write to g must stay)
        return F.relu(g)


def test_fuse_finds_residual_tails_written_every_way(seed: int) -> None:
    model = randomize_batch_norms(_Tails().double())
    reference = copy.deepcopy(model)
    fused = hal.nn.fuse(model, inplace=True)
    kinds = {name: type(m).__name__ for name, m in fused.named_children() if name.endswith("_fused")}
    assert kinds == {**{f"conv{i}_fused": "FusedConvBNAddReLU2d" for i in range(5)}, "conv5_fused": "FusedConvBN2d", "conv6_fused": "FusedConvBN2d"}, kinds
    x = torch.randn(2, 4, 5, 5, dtype=torch.float64)
    for training in (True, False):
        fused.train(training)
        reference.train(training)
        torch.testing.assert_close(fused(x), reference(x), rtol=1e-9, atol=1e-10)
    for (name, a), b in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


def test_fused_model_compiles_without_graph_breaks(seed: int) -> None:
    """The fused ResNet-style model under bfloat16 autocast, in training: one Dynamo graph."""
    model = hal.nn.fuse(ResNetish())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(model)(torch.randn(2, 3, 8, 8))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def _record_hooks(model: nn.Module, names: list[str], log: list[tuple[str, str, torch.Tensor]]) -> list[Any]:
    """Forward-pre, forward and full backward hooks on the named modules, each appending (kind,
    name, a copy of the tensor it saw) to ``log``; returns the handles. (No backward hook on a module
    whose output an in-place ReLU overwrites, nor on that ReLU: torch refuses those.)"""
    handles = []
    for name in names:
        m = model.get_submodule(name)
        handles.append(m.register_forward_pre_hook(lambda _m, args, n=name: log.append(("pre", n, args[0].detach().clone()))))
        handles.append(m.register_forward_hook(lambda _m, args, out, n=name: log.append(("forward", n, out.detach().clone()))))
        if not name.endswith(("bn1", "relu")):
            handles.append(m.register_full_backward_hook(lambda _m, gin, gout, n=name: log.append(("backward", n, gout[0].detach().clone()))))
    return handles


def _assert_same_log(got: list, want: list) -> None:
    assert [(k, n) for k, n, _ in got] == [(k, n) for k, n, _ in want]
    for (kind, name, g), (_, _, w) in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10, msg=lambda m, k=kind, n=name: f"{k} hook of {n}: {m}")


#: a conv -> bn -> relu chain (the ReLU module shared), a residual tail, a downsample and a linear -> gelu
_HOOKED = ["layer2.conv1", "layer2.bn1", "layer2.relu", "layer2.conv2", "layer2.bn2", "layer2.downsample.0", "fc1"]


@pytest.mark.parametrize("when", ["before", "after"])
def test_fuse_keeps_hooks(seed: int, when: str) -> None:
    """Hooks on the modules of fused chains, registered before fusing or after it (on the model's
    modules, which the fused model borrows), run with the values they see in the original model,
    in the same order, forward and backward; without hooks the fused ops run again."""
    model = randomize_batch_norms(ResNetish().double(), mean_std=1.0, bias_std=1.0)
    reference = copy.deepcopy(model)
    want: list = []
    got: list = []
    _record_hooks(reference, _HOOKED, want)
    handles = _record_hooks(model, _HOOKED, got) if when == "before" else []
    fused = hal.nn.fuse(model, inplace=True)
    if when == "after":
        handles = _record_hooks(model, _HOOKED, got)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    fused(x).square().sum().backward()
    reference(x).square().sum().backward()
    _assert_same_log(got, want)
    assert {n for _, n, _ in got} == set(_HOOKED)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-10)
    if when == "before":
        assert any("layer2.conv1_fused: layer2.conv1 -> layer2.bn1 fused, but runs its modules unfused" in n for n in fuse_notes(fused))

    for h in handles:
        h.remove()
    hal.reset_stats()
    got.clear()
    fused(x)
    calls = {op for (op, _, _) in hal.stats()}
    assert not got and {"fused_conv_bn_relu", "fused_conv_bn_add_relu", "linear"} <= calls, calls


def test_fuse_keeps_hooks_of_blocks_and_refuses_those_of_the_model(seed: int) -> None:
    """A block with hooks is not traced into (its hooks run; the chains inside it stay unfused); hooks
    on the model itself cannot be kept: ValueError saying what to do."""
    model = ResNetish().double()
    reference = copy.deepcopy(model)
    want: list = []
    got: list = []
    _record_hooks(reference, ["layer1", "stem"], want)
    _record_hooks(model, ["layer1", "stem"], got)
    fused = hal.nn.fuse(model, inplace=True)
    assert not [n for n, _ in fused.named_modules() if n.startswith(("layer1.", "stem.")) and n.endswith("_fused")]
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    fused(x).sum().backward()
    reference(x).sum().backward()
    _assert_same_log(got, want)

    model.register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match="cannot keep the hooks registered on ResNetish itself.*fuse its submodules instead"):
        hal.nn.fuse(model)


def test_fuse_keeps_parameter_order_and_every_module() -> None:
    """named_parameters(), named_buffers() and state_dict() of the fused model list the model's
    names in the model's order (also where forward calls modules in another order and never calls
    one), so optimizer state saved from the fused model loads into the original correctly."""

    class Reordered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(6, 3)
            self.unused = nn.Linear(2, 2)
            self.body = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 6), nn.BatchNorm1d(6))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x))

    for model in (nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)), Reordered()):
        fused = hal.nn.fuse(model, inplace=True)
        assert [(n, id(p)) for n, p in fused.named_parameters()] == [(n, id(p)) for n, p in model.named_parameters()]
        assert [n for n, _ in fused.named_buffers()] == [n for n, _ in model.named_buffers()]
        assert list(fused.state_dict()) == list(model.state_dict())

    # optimizer state saved from the fused model resumes the original's parameters, not their neighbours'
    model = Reordered()
    twin = copy.deepcopy(model)
    fused = hal.nn.fuse(model, inplace=True)
    opt = torch.optim.AdamW(fused.parameters(), lr=1e-2)
    fused(torch.randn(5, 4)).square().sum().backward()
    opt.step()
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    twin_opt.load_state_dict(opt.state_dict())
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        if p in opt.state:
            torch.testing.assert_close(twin_opt.state[q]["exp_avg"], opt.state[p]["exp_avg"], msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("style", ["hooks", "parametrize"])
def test_fuse_spectral_norm_linear(seed: int, style: str) -> None:
    """A spectral-normed Linear before an activation (torch.nn.utils.spectral_norm's pre-hook, or the
    parametrization): fuse works, computes what the model computes in training (the power iteration
    runs) and in eval, and says why the chain runs unfused."""
    norm = torch.nn.utils.spectral_norm if style == "hooks" else torch.nn.utils.parametrizations.spectral_norm
    model = nn.Sequential(norm(nn.Linear(5, 4)), nn.ReLU(), nn.Linear(4, 3)).double()
    reference = copy.deepcopy(model)
    fused = hal.nn.fuse(model)
    x = torch.randn(6, 5, dtype=torch.float64)
    for training in (True, False):
        fused.train(training)
        reference.train(training)
        out, want = fused(x), reference(x)
        torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-10)
        out.square().sum().backward()
        want.square().sum().backward()
    for (name, p), q in zip(fused.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
    notes = " ".join(fuse_notes(fused))
    assert ("runs its modules unfused while they have hooks" if style == "hooks" else "left unfused, parametrized (weight)") in notes


def test_fused_modules_read_parameters_replaced_after_fusing(seed: int) -> None:
    """A Parameter replaced on the model after fusing (linear and conv) is the one the fused model
    computes with and gives gradients to."""
    model = ResNetish().double().eval()
    fused = hal.nn.fuse(model, inplace=True).eval()
    model.fc1.weight = nn.Parameter(torch.randn_like(model.fc1.weight))
    model.stem[0].weight = nn.Parameter(torch.randn_like(model.stem[0].weight))
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    torch.testing.assert_close(fused(x), model(x), rtol=1e-9, atol=1e-10)
    fused(x).sum().backward()
    assert model.fc1.weight.grad is not None and model.stem[0].weight.grad is not None
