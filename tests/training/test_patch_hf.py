"""hal.nn.patch on whole Hugging Face decoder LMs (Llama, Mistral, Qwen2, Gemma, Mixtral), tiny
configs built here (no weights downloaded): rotary embedding, attention, norms, MLPs, experts and
the LM head with its loss on hal ops, computing what the unpatched model computes.

Tolerances: float32 throughout; the patched model sums in other orders (fused softmax, fused
linear cross-entropy over blocks, grouped GEMMs), so losses agree to ~1e-6 relative and gradients
to a few float32 ulps of their largest element per tensor: rtol 1e-4 with atol 1e-6 leaves
two orders of margin over the 6e-7 relative error observed and still catches any wrong term."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn
from transformers import (GemmaConfig, GemmaForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          MixtralConfig, MixtralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

import hal
from hal.nn.patch import RMSNorm, SwiGLUMLP
from hal.nn.patch_hf import GeGLUMLP, OffsetRMSNorm

VOCAB = 128
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 6}),  # shorter than the sequences: a real mask
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "gemma": (GemmaConfig, GemmaForCausalLM, {"head_dim": 16}),
    "mixtral": (MixtralConfig, MixtralForCausalLM, {"num_local_experts": 4, "num_experts_per_tok": 2}),
}
#: what patch must report swapping, per family (2 layers: 2 attentions, 2 MLPs, 2 * 2 + 1 norms)
EXPECTED = {
    "llama": {"Attention(rotary+sdpa)": 2, "SwiGLUMLP": 2, "RMSNorm": 5},
    "mistral": {"Attention(rotary+sdpa)": 2, "SwiGLUMLP": 2, "RMSNorm": 5},
    "qwen2": {"Attention(rotary+sdpa)": 2, "SwiGLUMLP": 2, "RMSNorm": 5},
    "gemma": {"Attention(rotary+sdpa)": 2, "GeGLUMLP": 2, "OffsetRMSNorm": 5},
    "mixtral": {"Attention(rotary+sdpa)": 2, "Experts(grouped_gemm)": 2, "RMSNorm": 5},
}
HEAD = "LMHead+loss(linear_cross_entropy)"


def _config(family: str, **over: object):
    config_cls, _, extra = FAMILIES[family]
    return config_cls(**{**_COMMON, **extra, **over})


def _model(family: str, seed: int, config=None) -> nn.Module:
    _, model_cls, _ = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_cls(config if config is not None else _config(family))
    with torch.no_grad():  # norms away from their initial values, so that the weights matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape) - 0.5 if family == "gemma" else torch.rand(p.shape) + 0.5)
    return model


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 12), generator=gen)
    labels = ids.clone()
    labels[0, :3] = -100
    labels[1, 7] = -100
    return ids, labels


def _ran() -> set[str]:
    return {op for (op, _, _), c in hal.stats().items() if c["calls"]}


def _report(caplog: pytest.LogCaptureFixture) -> dict[str, int]:
    line = [r.getMessage() for r in caplog.records if r.name == "hal.nn.patch"][-1]
    return {k: int(v) for k, v in (part.rsplit(" x", 1) for part in line.split(": ", 1)[1].split(", "))}


def _assert_grads(model: nn.Module, plain: nn.Module) -> None:
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"grad of {n}: {m}")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_patches_and_computes_loss_and_gradients_as_unpatched(family: str, seed: int, caplog: pytest.LogCaptureFixture) -> None:
    model = _model(family, seed)
    plain = copy.deepcopy(model)
    keys = {k: v.data_ptr() for k, v in model.state_dict().items()}
    with caplog.at_level(logging.INFO, logger="hal.nn.patch"):
        assert hal.nn.patch(model) is model
    assert _report(caplog) == {**EXPECTED[family], HEAD: 1}
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == keys  # same keys, parameters shared
    assert type(model).__name__ == type(plain).__name__  # save_pretrained records this name
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn, type(plain.model.layers[0].self_attn))  # a subclass: HF's hooks still find it
    norm_cls = OffsetRMSNorm if family == "gemma" else RMSNorm
    assert isinstance(model.model.norm, norm_cls) and isinstance(layer.input_layernorm, norm_cls)

    ids, labels = _batch(seed)
    hal.reset_stats()
    out = model(input_ids=ids, labels=labels)
    want = plain(input_ids=ids, labels=labels)
    assert out.logits is None  # the loss path never materialises the logits
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    want.loss.backward()
    _assert_grads(model, plain)
    ran = _ran()
    expected_ops = {"rotary_embedding", "rotary_embedding_backward", "scaled_dot_product_attention",
                    "scaled_dot_product_attention_backward", "linear_cross_entropy", "linear_cross_entropy_backward", "rms_norm"}
    expected_ops |= {"mixtral": {"grouped_gemm", "grouped_gemm_backward", "swiglu"}, "gemma": {"linear"}}.get(family, {"swiglu"})
    assert expected_ops <= ran, expected_ops - ran

    # without labels: logits as before, here with a padded row (the attention gets a mask)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
        ref = plain(input_ids=ids, attention_mask=mask).logits
    assert got is not None and got.shape == (2, 12, VOCAB)
    torch.testing.assert_close(got[mask.bool()], ref[mask.bool()], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_second_model_of_the_same_class_and_config_runs_torch(family: str, seed: int) -> None:
    """Only the given model changes: another one built from the same config object keeps HF's
    classes and calls no hal op."""
    config = _config(family)
    model, other = _model(family, seed, config), _model(family, seed + 1, config)
    original_attn = type(other.model.layers[0].self_attn)
    impl = config._attn_implementation
    hal.nn.patch(model)
    assert config._attn_implementation == impl
    assert type(other) is FAMILIES[family][1] and type(other.model.layers[0].self_attn) is original_attn
    assert type(other.lm_head) is nn.Linear
    ids, labels = _batch(seed)
    hal.reset_stats()
    out = other(input_ids=ids, labels=labels)
    out.loss.backward()
    assert out.logits is not None and not _ran()
    model(input_ids=ids, labels=labels).loss.backward()
    assert "scaled_dot_product_attention" in _ran()


def test_loss_options_follow_hf(seed: int) -> None:
    """num_items_in_batch (a sum divided by it), shift_labels, return_dict=False, logits_to_keep."""
    model = _model("qwen2", seed)
    plain = copy.deepcopy(model)
    hal.nn.patch(model)
    ids, labels = _batch(seed)
    n = torch.tensor(17)
    for kwargs in ({"num_items_in_batch": n}, {"shift_labels": labels}, {"logits_to_keep": 0}):
        got, want = model(input_ids=ids, labels=labels, **kwargs).loss, plain(input_ids=ids, labels=labels, **kwargs).loss
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, k=kwargs: f"{k}: {m}")
    got = model(input_ids=ids, labels=labels, return_dict=False)
    want = plain(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(got, tuple) and len(got) == len(want) - 1  # no logits
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)


def test_mixtral_router_aux_loss_is_added(seed: int) -> None:
    model = _model("mixtral", seed)
    plain = copy.deepcopy(model)
    hal.nn.patch(model)
    ids, labels = _batch(seed)
    got = model(input_ids=ids, labels=labels, output_router_logits=True)
    want = plain(input_ids=ids, labels=labels, output_router_logits=True)
    assert float(want.aux_loss.detach()) > 0
    torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    got.loss.backward()
    want.loss.backward()
    _assert_grads(model, plain)


def test_bfloat16_autocast_llama_matches_to_rounding(seed: int) -> None:
    model = _model("llama", seed)
    plain = copy.deepcopy(model)
    hal.nn.patch(model)
    ids, labels = _batch(seed)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = model(input_ids=ids, labels=labels).loss, plain(input_ids=ids, labels=labels).loss
        got.backward()
        want.backward()
    assert got.dtype == want.dtype == torch.float32
    assert abs(float(got.detach()) - float(want.detach())) < 2e-2 * abs(float(want.detach()))
    g = torch.cat([p.grad.flatten() for p in model.parameters()]).double()
    r = torch.cat([p.grad.flatten() for p in plain.parameters()]).double()
    assert float((g - r).norm() / r.norm()) < 5e-2


class _ScaledByWeightNorm(nn.Module):
    """Gemma's RMSNorm layout (weight, eps) scaling by weight, not 1 + weight."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).type_as(x)


class _ExactGeluMLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, 2 * d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.act_fn = nn.GELU()  # erf, not tanh: not a GeGLU of gelu_tanh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_gemma_look_alikes_are_left_alone() -> None:
    model = nn.ModuleDict({"norm": _ScaledByWeightNorm(8), "mlp": _ExactGeluMLP(8)})
    hal.nn.patch(model)
    assert type(model["norm"]) is _ScaledByWeightNorm and type(model["mlp"]) is _ExactGeluMLP
    tanh_mlp = _ExactGeluMLP(8)
    tanh_mlp.act_fn = nn.GELU(approximate="tanh")
    model = nn.ModuleDict({"mlp": tanh_mlp})
    hal.nn.patch(model)
    assert type(model["mlp"]) is GeGLUMLP and not isinstance(model["mlp"], SwiGLUMLP)


def test_unpadded_attention_takes_is_causal_in_place_of_a_materialised_mask(seed: int) -> None:
    """A model called without an attention mask tells its attention layers so: the mask transformers
    materialises anyway (while a CUDA graph is captured, or a graph traced, in some versions) is then
    the causal one, and hal's attention takes the op's is_causal instead (a fused kernel instead of a
    masked one). Not where a sliding window makes the mask more than causal."""
    from hal.nn.patch_hf import _attend

    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 10, 16, generator=gen)
    k, v = torch.randn(2, 2, 10, 16, generator=gen), torch.randn(2, 2, 10, 16, generator=gen)
    causal = torch.ones(10, 10, dtype=torch.bool).tril().expand(2, 1, 10, 10)
    nothing_masked = torch.ones(2, 1, 10, 10, dtype=torch.bool)
    for family, replaced in (("llama", True), ("mistral", False)):  # mistral's window (6) is shorter than 10
        model = _model(family, seed)
        hal.nn.patch(model)
        attn = model.model.layers[0].self_attn
        with torch.no_grad():
            want = _attend(attn, q, k, v, None, "sdpa", None)
            torch.testing.assert_close(_attend(attn, q, k, v, causal, "sdpa", None, unpadded=True), want)
            got = _attend(attn, q, k, v, nothing_masked, "sdpa", None, unpadded=True)
            given = _attend(attn, q, k, v, nothing_masked, "sdpa", None)
        assert not torch.allclose(want, given), "the two masks must give different results for this test to mean anything"
        torch.testing.assert_close(got, want if replaced else given)
