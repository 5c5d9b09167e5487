"""hal.optimize(fp8=recipe) on a CUDA device with FP8 (sm_89+): a Hugging Face Llama's layers run
their GEMMs in FP8 inside the compiled step captured whole as a CUDA graph, with current and
delayed scaling, with and without selective recompute; the loss falls as the bf16 step's does.

Skipped without a CUDA device with FP8 (CI); run on the device machine.
"""

from __future__ import annotations

import pytest
import torch

import hal
import hal.fp8

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs a CUDA device with FP8 (sm_89 or newer)")


def _llama(seed: int) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).cuda()


def _losses(recipe, recompute, steps: int = 8) -> tuple[list[float], hal.OptimizedStep, torch.nn.Module]:
    model = _llama(0)
    ids = torch.randint(0, 512, (4, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    step = hal.optimize(model, torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True), amp=torch.bfloat16,
                        candidates=["hal compile+graph"], measure_steps=1, fp8=recipe, recompute=recompute)
    return [float(step(input_ids=ids, labels=ids)) for _ in range(steps)], step, model


@pytest.mark.parametrize("recompute", [None, "selective"])
@pytest.mark.parametrize("recipe", [hal.fp8.CurrentScaling(), hal.fp8.DelayedScaling()], ids=["current", "delayed"])
def test_fp8_step_compiles_captures_and_trains(recipe, recompute) -> None:
    torch._dynamo.reset()
    bf16, _, _ = _losses(None, recompute)
    fp8, step, model = _losses(recipe, recompute)
    assert step.report.chosen == "hal compile+graph" and step.report.fp8.choice == "fp8", step.explain()
    assert sum(isinstance(m, hal.fp8.Linear) for m in model.modules()) == 14
    assert all(map(torch.isfinite, map(torch.tensor, fp8))), fp8
    assert fp8[-1] < 0.8 * fp8[0], fp8  # it learns the batch
    assert abs(fp8[-1] - bf16[-1]) < 0.1 * bf16[0], (fp8, bf16)
