"""FP8 as a path of hal.optimize and hal.nn.patch (issue 40): ``fp8=recipe`` runs the linear layers
inside a model's repeated blocks (a decoder's layers) in FP8 through ``hal.fp8.convert(...,
within="auto")``; embeddings and the LM head keep the autocast dtype. hal.optimize does it in its
'hal' variant only (your model untouched until that variant wins) and says so in explain(); a
selective recompute keeps the FP8 GEMM's output (declared compute-bound). These run on the CPU,
where hal's FP8 ops run emulated; the speed is measured on the device (benchmarks/levers40.py
--parts optimize --fp8 ...).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hal
import hal.fp8
import hal.nn
from hal.nn.recompute import compute_bound

transformers = pytest.importorskip("transformers")

_BLOCK_LINEARS = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}


def _tiny_llama(seed: int, layers: int = 2) -> nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32, initializer_range=0.2)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def _fp8_names(model: nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, hal.fp8.Linear)}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_convert_within_blocks_converts_the_layers_only() -> None:
    model = _tiny_llama(1)
    keys = list(model.state_dict())
    hal.fp8.convert(model, hal.fp8.CurrentScaling(), within="blocks")
    assert _fp8_names(model) == {f"model.layers.{i}.{n}" for i in range(2) for n in _BLOCK_LINEARS}
    assert type(model.lm_head) is nn.Linear and list(model.state_dict()) == keys
    # "auto" on a model without repeated blocks: every linear but the first and the last
    mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    hal.fp8.convert(mlp, within="auto")
    assert _fp8_names(mlp) == {"2"}
    with pytest.raises(ValueError, match="within must be"):
        hal.fp8.convert(_tiny_llama(1), within="layers")


def test_fp8_gemm_is_kept_by_selective_recompute() -> None:
    assert torch.ops.hal.fp8_scaled_mm.default in compute_bound()
    assert torch.ops.hal.int8_linear.default in compute_bound()
    assert torch.ops.hal.fp8_quantize.default not in compute_bound()  # a cast: recomputed
    assert hal.registry.OPS["fp8_scaled_mm"].compute_bound and hal.registry.OPS["linear"].compute_bound
    assert not hal.registry.OPS["rms_norm"].compute_bound


def test_patch_fp8_trains_close_to_the_unpatched_model() -> None:
    model = _tiny_llama(2)
    reference = copy.deepcopy(model)
    hal.nn.patch(model, fp8=hal.fp8.CurrentScaling())
    assert _fp8_names(model) == {f"model.layers.{i}.{n}" for i in range(2) for n in _BLOCK_LINEARS}
    ids = torch.randint(0, 64, (2, 16))
    loss = model(input_ids=ids, labels=ids).loss
    expected = reference(input_ids=ids, labels=ids).loss
    loss.backward()
    expected.backward()
    loss, expected = loss.detach(), expected.detach()
    assert torch.isfinite(loss) and abs(loss.item() - expected.item()) < 0.03 * expected.item()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None, name
        cos = torch.nn.functional.cosine_similarity(p.grad.flatten(), q.grad.flatten(), dim=0)
        assert cos > 0.85, (name, float(cos))  # e5m2 gradients (2 mantissa bits): about 0.95 here; a wrong GEMM gives about 0
    with pytest.raises(TypeError, match="hal.fp8 recipe"):
        hal.nn.patch(_tiny_llama(2), fp8="e4m3")


def _run(candidates: list[str], recompute=None, steps: int = 4, seed: int = 3):
    model = _tiny_llama(seed)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed))
    step = hal.optimize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), candidates=candidates, measure_steps=1,
                        fp8=hal.fp8.CurrentScaling(), recompute=recompute)
    losses = [float(step(input_ids=ids, labels=ids)) for _ in range(steps)]
    return model, step, losses


def test_optimize_fp8_converts_the_hal_variant_and_says_so() -> None:
    model, step, losses = _run(["hal eager"])
    text = step.explain()
    assert "fp8        fp8: 14 nn.Linear layers inside its repeated blocks" in text, text
    assert "2 decoder layers hand their FP8 projections the amaxes of their inputs" in text, text
    assert step.report.fp8.choice == "fp8"
    # the hal variant won (the only candidate): your model now runs its layers in FP8, the amaxes of
    # their inputs from the norms and the SwiGLU (per-tensor current scaling)
    assert _fp8_names(model) == {f"model.layers.{i}.{n}" for i in range(2) for n in _BLOCK_LINEARS}
    from hal.nn.patch_hf_amax import _AmaxDecoderLayer

    assert all(isinstance(layer, _AmaxDecoderLayer) for layer in model.model.layers)
    hal.reset_stats()
    step(input_ids=torch.randint(0, 64, (2, 16)), labels=torch.randint(0, 64, (2, 16)))
    ran = {op for (op, _, _), c in hal.stats().items() if c["calls"]}
    assert {"rms_norm_amax", "swiglu_amax", "fp8_quantize_transpose_from_amax"} <= ran, ran
    assert losses[-1] < losses[0] and all(map(torch.isfinite, map(torch.tensor, losses)))


def test_optimize_fp8_leaves_your_model_alone_where_the_untouched_step_wins() -> None:
    model, step, _ = _run(["torch eager"])
    assert step.report.chosen == "torch eager"
    assert not _fp8_names(model)


def test_optimize_fp8_with_selective_recompute_matches_without() -> None:
    _, _, plain = _run(["hal eager"], seed=5)
    model, step, recomputed = _run(["hal eager"], recompute="selective", seed=5)
    assert step.report.recompute.choice == "selective" and _fp8_names(model)
    assert recomputed == pytest.approx(plain, rel=1e-5, abs=1e-6)


def test_optimize_fp8_rejects_what_is_not_a_recipe() -> None:
    model = _tiny_llama(4)
    with pytest.raises(TypeError, match="hal.fp8 recipe"):
        hal.optimize(model, torch.optim.AdamW(model.parameters()), fp8=True)
