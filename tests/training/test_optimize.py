"""hal.optimize: the optimized step trains as a plain eager loop does (losses and final parameters
from the same initial state), measuring leaves no trace, and explain() says what was chosen and why.

Tolerances: the fused and patched models compute the same function with other kernels (hal's
rms_norm, swiglu, fused conv-bn-relu) and the compiled step with Inductor's kernels, so float32
results differ by reassociation, about 1e-7 relative per op. Three AdamW steps move each parameter
by at most about 3 * lr whatever the gradient's size (the update is m / sqrt(v)); rounding noise in
a gradient changes that direction only where the gradient is near zero, which random inputs make
rare: atol 2e-5 (lr 1e-2) and rtol 1e-4 cover it with margin, while a missed or doubled step or an
optimizer state not restored after measuring moves parameters by about lr (1e-2) and is caught.
torch.compile on this CPU takes about 20 s: only one test measures it (``compile=None``); the others
pass ``compile=False``.
"""

from __future__ import annotations

import copy
import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hal
from hal.fast.state import Snapshot

ATOL, RTOL = 2e-5, 1e-4


class ConvBNReLUStack(nn.Module):
    """conv-bn-relu blocks (a Sequential and a residual tail with a shared ReLU), a linear head."""

    def __init__(self, width: int = 4, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.conv = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        y = self.relu(self.bn(self.conv(y)) + y)
        return self.fc(y.mean(dim=(2, 3)))


def _batches(n: int, gen: torch.Generator, classes: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(4, 3, 8, 8, generator=gen), torch.randint(0, classes, (4,), generator=gen)) for _ in range(n)]


def _eager(model: nn.Module, opt: torch.optim.Optimizer, batches: list, loss_of) -> list[float]:
    losses = []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, batch)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def _assert_same_state(got: nn.Module, want: nn.Module, atol: float = ATOL, rtol: float = RTOL) -> None:
    """Every tensor of the two state dicts agrees: integers exactly; floats within atol + rtol * |want|
    for at least 99% of the elements and within atol on average. An element whose gradient is a
    cancellation (its value near rounding noise) can take another AdamW direction under another
    summation order, by up to about lr; a missed or doubled step, or a state not restored, moves
    nearly every element by about lr (and the mean far past atol)."""
    g, w = got.state_dict(), want.state_dict()
    assert g.keys() == w.keys()
    for name in w:
        if not w[name].is_floating_point():
            assert torch.equal(g[name], w[name]), name
            continue
        diff = (g[name].double() - w[name].double()).abs()
        outside = (diff > atol + rtol * w[name].double().abs()).double().mean().item()
        assert torch.isfinite(diff).all(), name
        assert outside <= 0.01 and diff.mean().item() <= atol, f"{name}: {outside:.2%} of elements outside tolerance, mean |diff| {diff.mean().item():.2e}, max {diff.max().item():.2e}"


def test_cnn_matches_eager_and_explains_measured_choice(seed: int) -> None:
    model = ConvBNReLUStack()
    reference = copy.deepcopy(model)
    batches = _batches(3, torch.Generator().manual_seed(seed))
    step = hal.optimize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=F.cross_entropy, measure_steps=2)
    assert "not chosen yet" in step.explain()

    first = step(*batches[0])  # measures eager and compile on this batch, then runs the real step
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    want = _eager(reference, ref_opt, batches[:1], _ce)
    _assert_same_state(model, reference)  # the measuring steps were undone: one step's worth
    losses = [float(first)] + [float(step(*b)) for b in batches[1:]]
    want += _eager(reference, ref_opt, batches[1:], _ce)
    assert losses == pytest.approx(want, rel=1e-5, abs=1e-6)
    _assert_same_state(model, reference)

    r = step.report
    assert r.rewrite.choice == "fuse" and "FusedConvBNReLU2d" in r.rewrite.reason and "FusedConvBNAddReLU2d" in r.rewrite.reason
    assert r.optimizer.choice == "hal.optim.AdamW" and "replaced AdamW" in r.optimizer.reason
    assert isinstance(step.optimizer, hal.optim.AdamW)
    assert [t.name for t in r.trials] == ["eager", "compile"]
    ok = {t.name: t.median_ms for t in r.trials if t.median_ms is not None}
    assert "eager" in ok and r.chosen in ok
    fastest = min(ok, key=ok.get)
    assert r.chosen == fastest or (r.chosen == "eager" and ok[fastest] > ok["eager"] * (1 - step.margin))
    text = step.explain()
    assert f"step       {r.chosen}" in text and "eager: " in text and "ms/step" in text and "measuring cost" in text
    assert r.compile.choice == ("yes" if r.chosen == "compile" else "no")
    assert "graph      no: the model is on cpu" in text
    assert r.extra_steps >= 2 * (1 + step.measure_steps) - (0 if "compile" in ok else step.measure_steps)


def _ce(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _tiny_llama(seed: int) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def test_hf_llama_falls_back_to_patch_and_matches_eager(seed: int) -> None:
    model = _tiny_llama(seed)
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, 64, (2, 8), generator=gen) for _ in range(3)]
    step = hal.optimize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), compile=False)
    losses = [float(step(ids, labels=ids)) for ids in batches]  # no loss_fn: the output's .loss
    want = _eager(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), batches, lambda m, ids: m(ids, labels=ids).loss)
    assert losses == pytest.approx(want, rel=1e-5)
    _assert_same_state(model, reference)
    r = step.report
    assert r.rewrite.choice == "patch" and "hal.nn.fuse could not trace LlamaForCausalLM" in r.rewrite.reason
    assert "RMSNorm" in r.rewrite.reason and "SwiGLUMLP" in r.rewrite.reason
    assert step.model is model and r.chosen == "eager" and not r.trials
    assert "compile    no: compile=False" in step.explain()


def test_sgd_is_kept_with_the_reason(seed: int) -> None:
    model = ConvBNReLUStack()
    reference = copy.deepcopy(model)
    batches = _batches(3, torch.Generator().manual_seed(seed))
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, dampening=0.1)
    step = hal.optimize(model, sgd, loss_fn=F.cross_entropy, compile=False)
    losses = [float(step(x, y)) for x, y in batches]
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9, dampening=0.1)
    want = _eager(reference, ref_opt, batches, lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    assert losses == pytest.approx(want, rel=1e-5, abs=1e-6)
    _assert_same_state(model, reference)
    assert step.optimizer is sgd
    assert step.report.optimizer.choice == "SGD (kept)" and "is not torch.optim.AdamW" in step.report.optimizer.reason


@pytest.mark.parametrize("make, replaced, why", [
    (lambda ps: torch.optim.Adam(ps, lr=1e-3), True, "weight_decay=0"),
    (lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.1), False, "adds L2 to the gradient"),
    (lambda ps: torch.optim.AdamW(ps, amsgrad=True), False, "amsgrad=True"),
    (lambda ps: torch.optim.AdamW([{"params": ps[:2], "lr": 1e-2}, {"params": ps[2:], "weight_decay": 0.0}]), True, "2 param group(s)"),
], ids=["adam", "adam-l2", "amsgrad", "two-groups"])
def test_optimizer_replaced_only_when_the_update_is_the_same(make, replaced: bool, why: str) -> None:
    model = ConvBNReLUStack()
    opt = make(list(model.parameters()))
    step = hal.optimize(model, opt, loss_fn=F.cross_entropy, compile=False, rewrite="none")
    assert isinstance(step.optimizer, hal.optim.AdamW) is replaced and why in step.report.optimizer.reason
    if replaced:
        for mine, theirs in zip(step.optimizer.param_groups, opt.param_groups):
            assert all(mine[k] == theirs[k] for k in ("lr", "betas", "eps", "weight_decay"))
            assert [id(p) for p in mine["params"]] == [id(p) for p in theirs["params"]]


def test_scheduler_on_your_optimizer_reaches_hals(seed: int) -> None:
    model = ConvBNReLUStack()
    reference = copy.deepcopy(model)
    batches = _batches(4, torch.Generator().manual_seed(seed))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.3)
    step = hal.optimize(model, opt, loss_fn=F.cross_entropy, compile=False)
    for x, y in batches:
        step(x, y)
        sched.step()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.3)
    for x, y in batches:
        ref_opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
        ref_sched.step()
    _assert_same_state(model, reference)
    assert step.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.3**3)


def test_snapshot_restores_what_steps_change(seed: int) -> None:
    """Parameters, batch-norm statistics, gradients, optimizer state (created or grown), the loss
    scaler and the random generator come back; stepping after the restore is the first real step."""
    model = nn.Sequential(ConvBNReLUStack(), nn.Dropout(0.3))
    opt = hal.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = hal.amp.DynamicLossScaler(init_scale=2.0**8)
    x, y = _batches(1, torch.Generator().manual_seed(seed))[0]

    def train_step() -> float:
        loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    before = copy.deepcopy(model.state_dict())
    snap = Snapshot([model], opt, [scaler])
    first = [train_step() for _ in range(3)]
    assert not torch.equal(model.state_dict()["0.fc.weight"], before["0.fc.weight"])
    snap.restore()
    _assert_same_state(model, _with_state(model, before), atol=0, rtol=0)
    assert not opt.state and scaler.history.steps == 0 and all(p.grad is None for p in model.parameters())
    assert [train_step() for _ in range(3)] == first  # same dropout masks, same scale, same updates

    snap = Snapshot([model], opt, [scaler])  # now with state: restored in place
    exp_avg = opt.state[model[0].fc.weight]["exp_avg"]
    saved = exp_avg.clone()
    train_step()
    snap.restore()
    assert opt.state[model[0].fc.weight]["exp_avg"] is exp_avg and torch.equal(exp_avg, saved)
    assert scaler.history.steps == 3


def _with_state(model: nn.Module, state: dict) -> nn.Module:
    twin = copy.deepcopy(model)
    twin.load_state_dict(state)
    return twin


def test_bf16_autocast_and_fp16_scaler(seed: int) -> None:
    for amp in (torch.bfloat16, torch.float16):
        model = ConvBNReLUStack()
        reference = copy.deepcopy(model)
        batches = _batches(2, torch.Generator().manual_seed(seed))
        step = hal.optimize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=F.cross_entropy, amp=amp, compile=False)
        losses = [float(step(x, y)) for x, y in batches]

        def loss_of(m, b, amp=amp):
            with torch.autocast("cpu", dtype=amp):
                return F.cross_entropy(m(b[0]), b[1])

        want = _eager(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), batches, loss_of)
        assert all(math.isfinite(v) for v in losses)
        assert losses == pytest.approx(want, rel=2e-2)  # half-precision activations: about 3 significant digits
        assert ("DynamicLossScaler" in step.explain()) is (amp is torch.float16)
        assert (step.scaler is not None) is (amp is torch.float16)


def test_errors_say_what_to_do() -> None:
    model = ConvBNReLUStack()
    x, y = _batches(1, torch.Generator().manual_seed(0))[0]
    with pytest.raises(ValueError, match="must return the loss.*pass loss_fn"):
        hal.optimize(model, compile=False, rewrite="none")(x)
    with pytest.raises(ValueError, match=r"0-d floating-point tensor, got a tensor of shape \(4,\).*reduce it"):
        hal.optimize(model, compile=False, rewrite="none", loss_fn=lambda out, t: F.cross_entropy(out, t, reduction="none"))(x, y)
    with pytest.raises(ValueError, match="amp must be None, torch.bfloat16 or torch.float16"):
        hal.optimize(model, amp=torch.float64)
    with pytest.raises(ValueError, match="rewrite must be one of"):
        hal.optimize(model, rewrite="fx")
    with pytest.raises(ValueError, match="rewrite='auto' to fall back to hal.nn.patch"):
        hal.optimize(_Untraceable(), rewrite="fuse")
    step = hal.optimize(_Untraceable(), compile=False)
    assert step.report.rewrite.choice == "patch" and "could not trace" in step.report.rewrite.reason
    assert "no optimizer given: hal.optim.AdamW" in step.explain()


class _Untraceable(nn.Module):
    """Control flow on a tensor's value: torch.fx cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        return y.square().mean() if y.sum() > 0 else y.abs().mean()


def test_exported_as_hal_optimize() -> None:
    import hal.fast

    assert hal.optimize is hal.fast.optimize and hal.OptimizedStep is hal.fast.OptimizedStep
    assert "optimize" in hal.__all__


def test_example_runs_briefly(capsys: pytest.CaptureFixture[str]) -> None:
    path = Path(__file__).resolve().parents[2] / "examples" / "train_llama_optimize.py"
    spec = importlib.util.spec_from_file_location("train_llama_optimize", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    loss = module.main(["--steps", "3", "--compile", "off", "--log-every", "1"])
    out = capsys.readouterr().out
    assert math.isfinite(loss) and out.count("loss ") >= 3
    assert "hal.optimize: training step of" in out and "optimizer  hal.optim.AdamW" in out
