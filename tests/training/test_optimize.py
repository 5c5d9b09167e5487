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
from typing import Iterator

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
    # your model and optimizer untouched, eager and compiled, beside hal's rewrite; graphs listed as skipped on the CPU
    assert [t.name for t in r.trials] == ["torch eager", "torch compile", "torch graph", "torch compile+graph",
                                          "hal eager", "hal compile", "hal graph", "hal compile+graph"]
    assert all((t.skipped is not None) is ("graph" in t.name) for t in r.trials)
    ok = {t.name: t.median_ms for t in r.trials if t.median_ms is not None}
    assert "torch eager" in ok and "torch compile" in ok and r.chosen in ok
    fastest = min(ok, key=ok.get)
    assert ok[r.chosen] <= ok[fastest] / (1 - step.margin)
    assert isinstance(step.optimizer, hal.optim.AdamW) is r.chosen.startswith("hal ")
    text = step.explain()
    assert f"step       {r.chosen}: " in text and "torch eager: " in text and "torch compile: " in text and "ms/step" in text
    assert "torch compile+graph: skipped (CUDA graphs need a CUDA device" in text and "measuring cost" in text
    assert r.compile.choice == ("yes" if "compile" in r.chosen else "no")
    assert "graph      no: the model is on cpu" in text
    assert r.extra_steps >= len(ok) * (1 + step.measure_steps)


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
    assert [t.name for t in r.trials if t.median_ms is not None] == ["torch eager", "hal eager"]
    # the winner runs on your model: untouched, or patched in place as hal.nn.patch does
    assert step.model is model
    patched = any(type(m).__module__.startswith("hal.") for m in model.modules())
    assert patched is (r.chosen == "hal eager")
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
    # hal's AdamW takes your optimizer's learning rate before each step (the last one saw 3 decays);
    # where your untouched optimizer won the measurement, it is the one stepping, with all 4 decays
    assert step.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.3 ** (4 if step.optimizer is opt else 3))


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


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch thread while timing on this shared CPU (torch's thread pool spins against the
    other processes and its step times jump by tens of milliseconds)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_slow_rewrite_loses_to_your_untouched_model(seed: int, one_thread: None) -> None:
    """hal's rewrite made really slow (every hal op forced onto cpu_ref, the NumPy reference backend:
    about 60x torch's CPU kernels on these convolutions) loses to your model and optimizer run as
    given, which the step then runs; explain() shows both times and why."""
    model = ConvBNReLUStack(width=8)
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(8, 3, 16, 16, generator=gen), torch.randint(0, 5, (8,), generator=gen)) for _ in range(2)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with hal.use(backend="cpu_ref"):
        step = hal.optimize(model, opt, loss_fn=F.cross_entropy, compile=False, measure_steps=3)
        losses = [float(step(x, y)) for x, y in batches]
    r = step.report
    times = {t.name: t.median_ms for t in r.trials if t.median_ms is not None}
    assert set(times) == {"torch eager", "hal eager"} and times["hal eager"] > 3 * times["torch eager"], times
    assert r.chosen == "torch eager" and step.optimizer is opt and step.model is model
    assert "step       torch eager: fastest measured" in step.explain()
    want = _eager(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), batches, _ce)
    assert losses == pytest.approx(want, rel=1e-6)
    _assert_same_state(model, reference, atol=1e-6, rtol=1e-6)  # your own step: the plain loop's, to rounding


class _RaisesOnBadBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != 4:
            raise ValueError(f"expected 4 features, got {x.shape[-1]}")
        return self.fc(x)


def test_your_models_exception_comes_back_as_it_is() -> None:
    """A ValueError raised by your model on the first batch is raised as a ValueError (not wrapped),
    with a note listing what each candidate did."""
    step = hal.optimize(_RaisesOnBadBatch(), loss_fn=F.cross_entropy)  # eager and compiled candidates: all fail
    with pytest.raises(ValueError, match="expected 4 features, got 5") as info:
        step(torch.randn(2, 5), torch.tensor([0, 1]))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "your model and optimizer, run as given, raised this" in notes and "torch eager: failed (ValueError" in notes


def test_param_group_added_after_optimize_is_trained(seed: int) -> None:
    """A param group added to your optimizer after hal.optimize replaced it with hal's AdamW is
    trained from the next step on, as by your optimizer in a plain loop."""
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(5, 6, generator=gen), torch.randint(0, 3, (5,), generator=gen)) for _ in range(4)]
    opt = torch.optim.AdamW(model[0].parameters(), lr=1e-2)
    step = hal.optimize(model, opt, loss_fn=F.cross_entropy, candidates=["hal eager"])
    ref_opt = torch.optim.AdamW(reference[0].parameters(), lr=1e-2)
    for i, (x, y) in enumerate(batches):
        if i == 2:
            opt.add_param_group({"params": list(model[2].parameters()), "lr": 3e-2})
            ref_opt.add_param_group({"params": list(reference[2].parameters()), "lr": 3e-2})
        step(x, y)
        ref_opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
    assert isinstance(step.optimizer, hal.optim.AdamW) and step.optimizer.param_groups[1]["lr"] == 3e-2
    _assert_same_state(model, reference)
    assert "param group 1 (2 parameter(s)) added to your optimizer after hal.optimize" in step.explain()

    opt.param_groups[0]["params"].pop()  # a group's parameters changed: hal's AdamW cannot follow
    with pytest.raises(RuntimeError, match="param groups changed after hal.optimize replaced it.*call hal.optimize again"):
        step(*batches[0])


def test_dropout_in_eager_candidates_draws_what_a_plain_loop_draws(seed: int) -> None:
    """The documented promise: the eager candidates (yours and hal's rewrite) draw the dropout masks
    a plain loop draws from the same generator state, after measuring (which restores it)."""
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(5, 6, generator=gen), torch.randint(0, 3, (5,), generator=gen)) for _ in range(3)]
    step = hal.optimize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=F.cross_entropy, compile=False)
    torch.manual_seed(seed)
    losses = [float(step(x, y)) for x, y in batches]
    torch.manual_seed(seed)
    want = _eager(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), batches, _ce)
    assert losses == pytest.approx(want, rel=1e-5, abs=1e-6)
    _assert_same_state(model, reference)


def test_spectral_norm_linear_builds_and_trains(seed: int) -> None:
    """torch.nn.utils.spectral_norm (a forward pre-hook computing the weight) on a Linear before an
    activation: hal.optimize builds its step (hal.nn.fuse keeps the chain's hooks) and trains as a
    plain loop does."""
    model = nn.Sequential(torch.nn.utils.spectral_norm(nn.Linear(6, 8)), nn.ReLU(), nn.Linear(8, 3))
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(5, 6, generator=gen), torch.randint(0, 3, (5,), generator=gen)) for _ in range(3)]
    step = hal.optimize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=F.cross_entropy, candidates=["hal eager"])
    losses = [float(step(x, y)) for x, y in batches]
    want = _eager(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), batches, _ce)
    assert losses == pytest.approx(want, rel=1e-5, abs=1e-6)
    _assert_same_state(model, reference)
    assert step.report.rewrite.choice == "fuse" and "runs its modules unfused while they have hooks" in step.report.rewrite.reason


def test_fused_step_uses_a_parameter_replaced_after_optimize(seed: int) -> None:
    """A Parameter of your model replaced after hal.optimize fused it is the one the step computes with."""
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    step = hal.optimize(model, torch.optim.SGD(model.parameters(), lr=0.0), loss_fn=F.cross_entropy, candidates=["hal eager"])
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    step(x, y)
    model[0].weight = nn.Parameter(torch.randn(8, 6))
    want = F.cross_entropy(model(x), y)
    assert float(step(x, y)) == pytest.approx(float(want), rel=1e-6)
    assert model[0].weight.grad is not None  # the new parameter got the gradient (your optimizer does not hold it)
