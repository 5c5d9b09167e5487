"""hal.graphs on a CUDA device: whole training steps of the benchmark's models captured once and
replayed with new data match eager steps; a new argument shape gets its own graph; a step that
synchronises with the host is not captured, runs eagerly, and explain says why.

Skipped without a CUDA device (CI); run on the device machine (benchmarks/h200.sh).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import hal
import hal.graphs
from hal_bench.models_llama import CONFIGS as LLAMA, OPS, Decoder
from hal_bench.models_resnet import CONFIGS as RESNET, ResNet
from tests.cuda._support import fresh_seed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEV = torch.device("cuda")


@pytest.fixture(autouse=True)
def reproducible_convolutions():
    """cuDNN's deterministic algorithms and IEEE float32, so that twin models compute the same steps
    (see tests/cuda/device/test_model_steps.py)."""
    saved = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32 = True, False, False
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32 = saved


def _resnet(seed: int) -> torch.nn.Module:
    cfg = RESNET["cpu"]
    torch.manual_seed(seed)
    return hal.nn.fuse(ResNet(cfg.layers, cfg.width, cfg.classes).to(DEV).to(memory_format=torch.channels_last), inplace=True)


def _resnet_batches(seed: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cfg = RESNET["cpu"]
    gen = torch.Generator().manual_seed(seed + 1)
    return [(torch.randn(cfg.batch, 3, cfg.image, cfg.image, generator=gen).to(DEV).contiguous(memory_format=torch.channels_last),
             torch.randint(0, cfg.classes, (cfg.batch,), generator=gen).to(DEV)) for _ in range(n)]


@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_graphed_resnet_training_matches_eager(amp) -> None:
    """Two warm-up calls, the capture, then replays on new batches: at every step the loss, and at the
    end every parameter and running statistic, as the eager twin computes them (hal's AdamW)."""
    seed = fresh_seed()
    graphed_model, eager_model = _resnet(seed), _resnet(seed)

    def make_step(model: torch.nn.Module):
        opt = hal.optim.AdamW(model.parameters(), lr=1e-2)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cuda", dtype=amp or torch.float32, enabled=amp is not None):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return step

    graphed, eager = hal.graphs.graphed(make_step(graphed_model)), make_step(eager_model)
    losses = []
    for x, y in _resnet_batches(seed, 6):
        got = graphed(x, y)
        with hal.graphs.device_bound():  # the kernels the graph runs (AdamW makes their rounding differences steps of +-lr)
            want = eager(x, y)
        losses.append(got)
        torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-4)
    assert len({float(v) for v in losses}) == len(losses)  # copied out: earlier results are not overwritten
    assert graphed.captured() == 1 and "replayed 4 time(s)" in graphed.explain()
    tol = dict(rtol=2e-2, atol=2e-3) if amp else dict(rtol=1e-3, atol=1e-4)
    for (n, p), q in zip(graphed_model.named_parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, **tol, msg=lambda m, n=n: f"{n}: {m}")
    for p, q in zip(graphed_model.buffers(), eager_model.buffers()):
        torch.testing.assert_close(p, q, **tol)


def test_graphed_llama_training_with_torch_optimizer_matches_eager() -> None:
    """hal's decoder with torch's fused AdamW made capturable: replays match the eager twin."""
    seed = fresh_seed()
    cfg = LLAMA["cpu"]
    models = []
    for _ in range(2):
        torch.manual_seed(seed)
        models.append(Decoder(cfg, OPS["hal"]()).to(DEV))
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = [torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen).to(DEV) for _ in range(5)]

    def make_step(model: torch.nn.Module):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)

        def step(t: torch.Tensor) -> torch.Tensor:
            loss = model(t[:, :-1], t[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return step

    graphed, eager = hal.graphs.graphed(make_step(models[0])), make_step(models[1])
    for t in tokens:
        got = graphed(t)
        with hal.graphs.device_bound():  # the kernels the graph runs
            torch.testing.assert_close(got, eager(t), rtol=1e-3, atol=1e-4)
    assert graphed.captured() == 1
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4)


def test_each_argument_shape_gets_its_own_graph() -> None:
    seed = fresh_seed()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(64, 32, device=DEV, generator=gen)
    graphed = hal.graphs.graphed(lambda x: hal.ops.linear(x, w, None, "gelu"), warmup=1)
    for rows in (8, 16, 8, 16, 8, 16):
        x = torch.randn(rows, 32, device=DEV, generator=gen)
        torch.testing.assert_close(graphed(x), F.gelu(F.linear(x, w)), rtol=1e-4, atol=1e-5)
    assert graphed.captured() == 2 and "2 argument signature" in graphed.explain()


def test_a_step_that_synchronises_runs_eagerly_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    seed = fresh_seed()
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def step(x: torch.Tensor) -> torch.Tensor:
        if float(x.sum()) > 1e30:  # a host read: cannot be captured
            raise AssertionError("unreachable")
        return hal.ops.softmax(x, -1)

    graphed = hal.graphs.graphed(step, warmup=1)
    for _ in range(4):
        x = torch.randn(4, 8, device=DEV, generator=gen)
        torch.testing.assert_close(graphed(x), torch.softmax(x, -1))
    assert graphed.captured() == 0
    assert "eager: the capture failed" in graphed.explain()
    assert any("runs eagerly" in r.message for r in caplog.records)


def test_a_cpu_tensor_argument_is_not_captured() -> None:
    graphed = hal.graphs.graphed(lambda x, scale: x * scale.to(x.device), warmup=1)
    x, scale = torch.randn(3, device=DEV), torch.tensor(2.0)
    for _ in range(3):
        torch.testing.assert_close(graphed(x, scale), x * 2)
    assert "a cpu tensor among the arguments" in graphed.explain()


def test_graphed_loss_scaler_skips_an_overflowed_step_as_eager_does() -> None:
    """float16 autocast, hal's DynamicLossScaler and AdamW: one batch holding an infinity overflows;
    the replayed graph skips that update and backs the scale off on the device, as the eager twin."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    models = []
    for _ in range(2):
        torch.manual_seed(seed)
        models.append(torch.nn.Sequential(hal.nn.Linear(32, 64, act="gelu"), hal.nn.Linear(64, 8)).to(DEV))

    def make_step(model: torch.nn.Module):
        opt = hal.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = hal.amp.DynamicLossScaler(init_scale=2.0**10, growth_interval=2)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return step, scaler

    (g_step, g_scaler), (e_step, e_scaler) = make_step(models[0]), make_step(models[1])
    graphed = hal.graphs.graphed(g_step)
    for i in range(8):
        x, y = torch.randn(16, 32, generator=gen).to(DEV), torch.randn(16, 8, generator=gen).to(DEV)
        if i == 5:
            x[3, 7] = float("inf")
        graphed(x, y)
        with hal.graphs.device_bound():  # the kernels the graph runs (the C++ AdamW there, Triton's eagerly)
            e_step(x, y)
    assert graphed.captured() == 1
    assert g_scaler.get_scale() == e_scaler.get_scale()
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.isfinite(p).all()
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4)


def test_a_tensor_passed_twice_stays_one_tensor_in_the_capture() -> None:
    """A compiled step given one tensor for two arguments (a Hugging Face causal LM's
    ``input_ids=t, labels=t``) is captured: the capture's static buffers keep the two arguments one
    tensor, so torch.compile's guards hold and nothing compiles inside the capture (two copies made
    it compile again there, and the capture failed). Replays with new data match the eager step."""
    gen = torch.Generator().manual_seed(fresh_seed())
    w = torch.randn(64, 64, generator=gen).to(DEV)
    compiled = torch.compile(lambda a, b: torch.tanh(a @ w) + b * 0.5)

    def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return compiled(a, b)

    graphed = hal.graphs.graphed(step)
    for _ in range(4):
        x = torch.randn(8, 64, generator=gen).to(DEV)
        got = graphed(x, x)
        torch.testing.assert_close(got, torch.tanh(x @ w) + x * 0.5)
    assert graphed.captured() == 1, graphed.explain()
    y = torch.randn(8, 64, generator=gen).to(DEV)
    torch.testing.assert_close(graphed(x, y), torch.tanh(x @ w) + y * 0.5)  # two tensors: a signature of its own
    assert len(graphed._entries) == 2, graphed.explain()


def _hf_family(family: str):
    """A tiny model of a Hugging Face decoder family as ``transformers`` 5.x writes it (GQA, tied
    embeddings; Mistral's sliding window shorter than the sequence, Gemma's head_dim, Mixtral's
    top-2 of 4 experts), with the sdpa attention a user gets by default."""
    transformers = pytest.importorskip("transformers")
    config_cls, model_cls, extra = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
        "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 64}),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
        "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 32}),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    }[family]
    cfg = getattr(transformers, config_cls)(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                            num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True, use_cache=False, **extra)
    return getattr(transformers, model_cls)._from_config(cfg, attn_implementation="sdpa").to(DEV).train()


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gemma", "mixtral"])
def test_optimize_captures_a_compiled_hugging_face_step(family: str) -> None:
    """hal.optimize's compile+graph candidate of the rewritten model captures a Hugging Face step of
    each decoder family hal.nn.patch knows (on Llama it failed with "operation failed due to a
    previous error during capture"), and trains. The untouched model's candidate either captures
    too or says why it could not (Mixtral's own experts pick their tokens with data-dependent
    shapes, which no graph holds), and the choice falls on a candidate that ran."""
    torch.manual_seed(fresh_seed())
    model = _hf_family(family)
    tokens = torch.randint(0, 4096, (2, 128), device=DEV)
    # your torch.optim.AdamW as you made it (not capturable): the torch candidate sets it capturable
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = hal.optimize(model, opt, amp=torch.bfloat16, candidates=["torch compile+graph", "hal compile+graph"])
    losses = [float(step(input_ids=tokens, labels=tokens)) for _ in range(3)]
    report = step.explain()
    trials = {t.name: t for t in step.report.trials}
    assert trials["hal compile+graph"].median_ms is not None, report
    if family != "mixtral":
        assert trials["torch compile+graph"].median_ms is not None, report
    else:
        assert trials["torch compile+graph"].median_ms is not None or trials["torch compile+graph"].error, report
    assert step.report.chosen in {n for n, t in trials.items() if t.median_ms is not None}, report
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0], losses
