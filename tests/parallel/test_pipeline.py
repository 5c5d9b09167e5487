"""hal.parallel.pipeline on real gloo groups: every schedule's loss and gradients against one process.

Every rank builds the same model from the seed, keeps a copy as the one-process reference, and runs
its stages of the other under GPipe, 1F1B and interleaved 1F1B (2 stages per rank) on 2 and 4 ranks:
hal's Llama-style benchmark decoder (hal ops: RMSNorm, rotary, SDPA, SwiGLU, the fused LM head +
cross-entropy) in float64, and an ``nn.Sequential`` of hal's fused ``Linear`` in float32. Two SGD
steps each: the loss (on the last stage's rank) and every gradient of the rank's stages must equal
the reference's (float64 to rounding).
"""

from __future__ import annotations

import copy
import time
import traceback
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import hal
from hal.dist.launch import launch
from hal.parallel.pipeline import PipelineParallel, split_model

#: numba's parallel kernels (hal's CPU backend) in every rank would oversubscribe the cores: one thread each
ONE_THREAD = {"NUMBA_NUM_THREADS": "1"}

pytestmark = pytest.mark.timeout(240)

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b"]
BATCH, MICRO = 8, 4


def _llama(seed: int, layers: int = 8) -> torch.nn.Module:
    from bench.models_llama import OPS, Decoder, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab=48, dim=16, layers=layers, heads=2, ffn=24, seq=6, batch=BATCH)
    return Decoder(cfg, OPS["hal"]()).to(torch.float64)


def _sequential(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = [hal.nn.Linear(12, 12, act="gelu") for _ in range(7)] + [hal.nn.Linear(12, 5)]
    return torch.nn.Sequential(*layers)


def _data(seed: int, step: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 101 + step)
    if kind == "llama":
        tokens = torch.randint(0, 48, (BATCH, 7), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return torch.randn(BATCH, 12, generator=g), torch.randn(BATCH, 5, generator=g)


def _check(rank: int, n: int, seed: int, kind: str, schedule: str) -> None:
    model = _llama(seed, layers=2 * n) if kind == "llama" else _sequential(seed)
    ref = copy.deepcopy(model)
    names = {id(p): n for n, p in model.named_parameters()}
    loss_fn = None if kind == "llama" else (lambda out, tgt: F.mse_loss(out, tgt))
    x0, _ = _data(seed, 0, kind)
    pp = PipelineParallel(model, microbatch=x0[: BATCH // MICRO], n_microbatches=MICRO, schedule=schedule, loss_fn=loss_fn)
    assert pp.p2p_through_hal, "this torch's pipelining transfers could not be routed through hal.dist"
    opt = torch.optim.SGD(pp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_named = dict(ref.named_parameters())
    tol = dict(rtol=1e-10, atol=1e-12) if kind == "llama" else dict(rtol=2e-5, atol=2e-6)
    for step in range(2):
        x, y = _data(seed, step, kind)
        loss = pp.step(x, target=y)
        want = ref(x, y) if kind == "llama" else F.mse_loss(ref(x), y)
        want.backward()
        if pp.has_last:
            torch.testing.assert_close(loss.double(), want.detach().double(), **tol, msg=lambda m: f"step {step} loss: {m}")
        else:
            assert loss is None
        for p in pp.parameters():
            name = names[id(p)]
            assert p.grad is not None, f"step {step}: no gradient for {name}"
            torch.testing.assert_close(p.grad, ref_named[name].grad, **tol, msg=lambda m: f"step {step} grad of {name}: {m}")
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()


def _bad_arguments(n: int) -> None:
    """Rejected before any transfer, with what to do."""
    model, x = _sequential(0), torch.randn(2, 12)
    with pytest.raises(hal.InvalidArgumentError, match="one of gpipe, 1f1b, interleaved_1f1b"):
        PipelineParallel(model, microbatch=x, n_microbatches=4, schedule="zigzag", loss_fn=F.mse_loss)
    with pytest.raises(hal.InvalidArgumentError, match="at least the"):
        PipelineParallel(model, microbatch=x, n_microbatches=n - 1, schedule="1f1b", loss_fn=F.mse_loss)
    with pytest.raises(hal.InvalidArgumentError, match="loss_fn"):
        PipelineParallel(model, microbatch=x, n_microbatches=4)
    with pytest.raises(hal.InvalidArgumentError, match="interleaved_1f1b"):
        PipelineParallel(model, microbatch=x, n_microbatches=4, stages_per_rank=2, loss_fn=F.mse_loss)


def _run_checks(rank: int, n: int, seed: int) -> dict[str, tuple[str, float]]:
    todo = [(f"llama_f64_{s}", "llama", s) for s in SCHEDULES] + [(f"sequential_f32_{s}", "sequential", s) for s in SCHEDULES]
    todo.append(("bad_arguments", "", ""))
    out = {}
    for name, kind, schedule in todo:
        started = time.monotonic()
        try:
            if kind:
                _check(rank, n, seed, kind, schedule)
            else:
                _bad_arguments(n)
            error = ""
        except Exception:
            error = traceback.format_exc()
        out[name] = (error, time.monotonic() - started)
    return out


Outcomes = dict[str, list[tuple[str, float]]]
NAMES = [f"{k}_{s}" for k in ("llama_f64", "sequential_f32") for s in SCHEDULES] + ["bad_arguments"]


def _launch(n: int, seed: int) -> Outcomes:
    results = launch(_run_checks, n, (seed,), timeout_s=200, env=ONE_THREAD)
    bad = [f"rank {r.rank}: {r.message}\n{r.traceback}" for r in results if not r.ok]
    assert not bad, f"HAL_TEST_SEED={seed}\n" + "\n".join(bad)
    return {name: [r.value[name] for r in results] for name in results[0].value}


@pytest.fixture(scope="module")
def two_ranks(seed: int) -> Outcomes:
    return _launch(2, seed)


@pytest.fixture(scope="module")
def four_ranks(seed: int) -> Outcomes:
    return _launch(4, seed)


def _passed(outcomes: Outcomes, name: str, seed: int) -> None:
    print(f"{name}: {max(s for _, s in outcomes[name]):.2f} s on the slowest rank")
    errors = [f"rank {r}:\n{e}" for r, (e, _) in enumerate(outcomes[name]) if e]
    assert not errors, f"{name} failed (HAL_TEST_SEED={seed}):\n" + "\n".join(errors)


@pytest.mark.parametrize("name", NAMES)
def test_two_ranks_match_one_process(two_ranks: Outcomes, name: str, seed: int) -> None:
    _passed(two_ranks, name, seed)


@pytest.mark.parametrize("name", NAMES)
def test_four_ranks_match_one_process(four_ranks: Outcomes, name: str, seed: int) -> None:
    _passed(four_ranks, name, seed)


def test_cutting_checks_its_arguments() -> None:
    model = _sequential(0)
    pieces = split_model(model, 3)
    assert [len(p) for p in pieces] == [3, 3, 2]
    assert [len(p) for p in split_model(model, 3, boundaries=[1, 7])] == [1, 6, 1]
    with pytest.raises(hal.InvalidArgumentError, match="boundaries"):
        split_model(model, 3, boundaries=[5, 2])
    with pytest.raises(hal.InvalidArgumentError, match="at most the model's 8 layers"):
        split_model(model, 9)
    with pytest.raises(hal.InvalidArgumentError, match="Llama-style"):
        split_model(torch.nn.Linear(3, 3), 2)
    llama = _llama(0)
    stages = split_model(llama, 3)
    assert [s.layer_ids for s in stages] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    tokens, targets = _data(0, 0, "llama")
    h = tokens
    for s in stages:
        h = s(h)
    torch.testing.assert_close(stages[-1].loss(h, targets), llama(tokens, targets), rtol=1e-12, atol=1e-12)
