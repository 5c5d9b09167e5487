"""hal.nn.patch: modules swapped in place by structure (no tracing), computing what the model
computed before: a tiny Hugging Face Llama built from a config (no weights downloaded) trains like
the unpatched one in float32; norms, Sequential chains and look-alikes that compute something else."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import hal
from hal.nn.patch import RMSNorm, Sequential, SwiGLUMLP


def _tiny_llama(seed: int) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # norms away from their initial ones, so that the weights matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape) + 0.5)
    return model


def _train(model: nn.Module, batches: list[torch.Tensor], steps: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    losses = []
    for i in range(steps):
        ids = batches[i % len(batches)]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def test_llama_patches_and_trains_like_the_unpatched_model(seed: int) -> None:
    model = _tiny_llama(seed)
    plain = copy.deepcopy(model)
    keys = {k: v.data_ptr() for k, v in model.state_dict().items()}
    assert hal.nn.patch(model) is model
    layers = model.model.layers
    assert all(isinstance(m, RMSNorm) for l in layers for m in (l.input_layernorm, l.post_attention_layernorm))
    assert isinstance(model.model.norm, RMSNorm)
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == keys  # same keys, same storage
    gen = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, 64, (2, 12), generator=gen) for _ in range(2)]
    got, want = _train(model, batches, 4), _train(plain, batches, 4)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    assert want[-1] < want[0]
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    ids = batches[0]
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
    ran = {op for (op, _, _), c in hal.stats().items() if c["calls"]}
    assert {"rms_norm", "rms_norm_backward"} <= ran, ran


def test_llama_mlp_becomes_swiglu(seed: int) -> None:
    model = _tiny_llama(seed)
    plain = copy.deepcopy(model)
    gate = model.model.layers[0].mlp.gate_proj
    hal.nn.patch(model)
    assert all(isinstance(l.mlp, SwiGLUMLP) for l in model.model.layers)
    assert model.model.layers[0].mlp.gate_proj is gate  # the same linear modules
    gen = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, 64, (2, 12), generator=gen)]
    torch.testing.assert_close(torch.tensor(_train(model, batches, 3)), torch.tensor(_train(plain, batches, 3)), rtol=1e-5, atol=1e-6)
    assert any(op == "swiglu" and c["calls"] for (op, _, _), c in hal.stats().items())


def test_bfloat16_llama_patches_and_matches_to_rounding(seed: int) -> None:
    model = _tiny_llama(seed).to(torch.bfloat16)
    plain = copy.deepcopy(model)
    hal.nn.patch(model)
    assert isinstance(model.model.norm, RMSNorm)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        got, want = model(input_ids=ids).logits, plain(input_ids=ids).logits
    assert got.dtype == want.dtype == torch.bfloat16
    err = float((got.double() - want.double()).norm() / want.double().norm())
    assert err < 2e-2, err


def test_meta_models_are_left_alone() -> None:
    with torch.device("meta"):
        model = nn.ModuleDict({"norm": _LlamaNormAlone(), "mlp": nn.Sequential(nn.Linear(4, 4), nn.ReLU())})
    hal.nn.patch(model)
    assert type(model["norm"]) is _LlamaNormAlone


class GemmaStyleRMSNorm(nn.Module):
    """Looks like Llama's RMSNorm (weight, variance_epsilon) but scales by 1 + weight."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * (1.0 + self.weight)


class GeluMLP(nn.Module):
    """Llama's MLP layout with GELU: not a SwiGLU."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, 2 * d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.act_fn = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_look_alikes_are_left_alone() -> None:
    model = nn.ModuleDict({"norm": GemmaStyleRMSNorm(8), "mlp": GeluMLP(8)})
    hal.nn.patch(model)
    assert type(model["norm"]) is GemmaStyleRMSNorm and type(model["mlp"]) is GeluMLP


def test_torch_norms_change_class_in_place(seed: int) -> None:
    ln, rms = nn.LayerNorm(16), nn.RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        for p in (*ln.parameters(), *rms.parameters()):
            p.copy_(torch.randn(p.shape))
    model = nn.ModuleList([ln, rms])
    before = [copy.deepcopy(m) for m in model]
    hal.nn.patch(model)
    assert model[0] is ln and type(ln) is hal.nn.LayerNorm and type(rms) is hal.nn.RMSNorm
    x = torch.randn(3, 5, 16)
    for m, b in zip(model, before):
        torch.testing.assert_close(m(x), b(x), rtol=1e-5, atol=1e-6)


def _chains() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
                         nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 8), nn.GELU(), nn.Linear(8, 3))


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_sequential_chains_fuse_and_match(train: bool, seed: int) -> None:
    model = _chains().train(train)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.normal_(0, 0.1)
            m.running_var.uniform_(0.5, 1.5)
    plain = copy.deepcopy(model)
    keys = list(model.state_dict())
    hal.nn.patch(model)
    assert type(model) is Sequential and list(model.state_dict()) == keys
    for _ in range(2):
        x = torch.randn(2, 3, 6, 6, requires_grad=True)
        xp = x.detach().clone().requires_grad_(True)
        y, yp = model(x), plain(xp)
        torch.testing.assert_close(y, yp, rtol=1e-4, atol=1e-5)
        g = torch.randn_like(y)
        y.backward(g)
        yp.backward(g)
        torch.testing.assert_close(x.grad, xp.grad, rtol=1e-4, atol=1e-5)
        for (name, a), b in zip(model.named_parameters(), plain.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"grad of {n}: {m}")
        for a, b in zip(model.buffers(), plain.buffers()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    steps = [type(s).__name__ + (f"({s.act})" if hasattr(s, "act") else "") for s in model._hal_steps]
    assert steps == ["FusedConvBNReLU2d", "FusedConvBNReLU2d", "Flatten", "_LinearAct(gelu)", "Linear"], steps
    ran = {op for (op, _, _), c in hal.stats().items() if c["calls"]}
    assert "linear" in ran and ran & {"fused_conv_bn_relu", "conv2d"}, ran


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_downsample_sequential_becomes_fused_conv_bn(train: bool, seed: int) -> None:
    """torchvision's downsample shortcut, nn.Sequential(conv, bn): one FusedConvBN2d over the same
    children (state_dict unchanged), computing what the Sequential computed."""
    model = nn.Sequential(nn.Conv2d(4, 8, 1, stride=2, bias=False), nn.BatchNorm2d(8)).train(train)
    with torch.no_grad():
        model[1].running_mean.normal_(0, 0.1)
        model[1].running_var.uniform_(0.5, 1.5)
        model[1].weight.uniform_(0.5, 1.5)
    plain = copy.deepcopy(model)
    keys = list(model.state_dict())
    hal.nn.patch(model)
    assert type(model) is Sequential and list(model.state_dict()) == keys
    x = torch.randn(2, 4, 7, 7)
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x), rtol=1e-4, atol=1e-5)
    assert [type(s).__name__ for s in model._hal_steps] == ["FusedConvBN2d"]
    for a, b in zip(model.buffers(), plain.buffers()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_sequential_follows_its_children_and_hooks(seed: int) -> None:
    """A replaced child is what runs next time; a hooked module is not fused (its hook runs)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    hal.nn.patch(model)
    x = torch.randn(3, 4)
    model(x)
    model[0] = nn.Linear(4, 4)
    with torch.no_grad():
        torch.testing.assert_close(model(x), model[2](F.relu(model[0](x))), rtol=1e-5, atol=1e-6)
    seen = []
    model[1].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    model(x)
    assert seen == [(3, 4)]


def test_model_itself_is_never_replaced() -> None:
    with pytest.raises(ValueError, match="cannot replace the model itself"):
        hal.nn.patch(_LlamaNormAlone())


class _LlamaNormAlone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(v + self.variance_epsilon)).to(x.dtype)
