"""hal.amp.DynamicLossScaler against torch.amp.GradScaler, and hal.optim.AdamW against
torch.optim.AdamW, with and without float32 master weights."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import hal
import hal.amp
import hal.optim

OVERFLOW_SCRIPT = "FFFIFIIFFFFFIIIFF"  # F: finite gradients, I: an infinite gradient this step


def _step(p: torch.nn.Parameter, opt: torch.optim.Optimizer, scaler: object, x: torch.Tensor, overflow: bool) -> torch.Tensor:
    opt.zero_grad()
    loss = (p @ x).square().sum() * (float("inf") if overflow else 1.0)
    scaled = scaler.scale(loss)
    scaled.backward()
    scaler.step(opt)
    scaler.update()
    return scaled.detach()


@pytest.mark.parametrize("torch_opt", ["adamw", "sgd"])
def test_scaler_matches_grad_scaler_on_a_scripted_sequence(torch_opt: str, seed: int) -> None:
    """Same scaled losses, scales after every update and skipped steps as GradScaler, with
    hal.optim.AdamW (skipped on the device through found_inf) or SGD (skipped on the host)."""
    w0 = torch.randn(4, 3)
    ref_p, our_p = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    if torch_opt == "adamw":
        ref_opt, our_opt = torch.optim.AdamW([ref_p], lr=0.01), hal.optim.AdamW([our_p], lr=0.01)
    else:
        ref_opt, our_opt = torch.optim.SGD([ref_p], lr=0.01), torch.optim.SGD([our_p], lr=0.01)
    ref = torch.amp.GradScaler("cpu", init_scale=4.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    ours = hal.amp.DynamicLossScaler(init_scale=4.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    skipped_ref, skipped_ours = [], []
    for i, c in enumerate(OVERFLOW_SCRIPT):
        x = torch.randn(3)
        before_ref, before_ours = ref_p.detach().clone(), our_p.detach().clone()
        want = _step(ref_p, ref_opt, ref, x, c == "I")
        got = _step(our_p, our_opt, ours, x, c == "I")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # inf == inf too
        assert ours.get_scale() == ref.get_scale(), f"step {i}"
        skipped_ref.append(torch.equal(before_ref, ref_p.detach()))
        skipped_ours.append(torch.equal(before_ours, our_p.detach()))
        torch.testing.assert_close(our_p.detach(), ref_p.detach(), rtol=1e-5, atol=1e-6)
    assert skipped_ours == skipped_ref == [c == "I" for c in OVERFLOW_SCRIPT]
    assert ours.state_dict() | {"consecutive_overflows": 0} == ref.state_dict() | {"consecutive_overflows": 0}
    h = ours.history
    assert h.overflow_steps == [i for i, c in enumerate(OVERFLOW_SCRIPT) if c == "I"]
    assert h.max_consecutive_overflows == 3 and h.consecutive_overflows == 0
    assert h.scales[0] == 4.0 and len(h.scales) == len(OVERFLOW_SCRIPT)
    if torch_opt == "adamw":
        assert float(our_opt.state[our_p]["step"]) == float(ref_opt.state[ref_p]["step"]) == OVERFLOW_SCRIPT.count("F")


def test_backoff_after_consecutive_overflows_and_gradient_statistics(seed: int) -> None:
    """backoff_after=2: a lone overflow is skipped without backing off, the second in a row backs
    off (and every further one); statistics every 2 steps."""
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = hal.optim.AdamW([p], lr=0.01)
    scaler = hal.amp.DynamicLossScaler(init_scale=64.0, growth_interval=100, policy=hal.amp.ScalerPolicy(stats_every=2, backoff_after=2))
    scales = []
    for c in "FIFIIIF":
        _step(p, opt, scaler, torch.randn(3), c == "I")
        scales.append(scaler.get_scale())
    assert scales == [64.0, 64.0, 64.0, 64.0, 32.0, 16.0, 16.0]
    assert scaler.history.overflow_steps == [1, 3, 4, 5] and scaler.history.max_consecutive_overflows == 3
    stats = scaler.history.grad_stats
    assert [s.step for s in stats] == [0, 2, 4, 6]
    finite = [s for s in stats if s.step in (0, 2, 6)]
    assert all(s.norm > 0 and 0 < s.max_abs <= s.norm and s.zero_fraction == 0.0 for s in finite)
    assert not torch.isfinite(torch.tensor(stats[2].norm))
    assert "4 overflowed" in str(scaler.history)


def test_scaler_state_dict_round_trips_with_grad_scaler() -> None:
    ours = hal.amp.DynamicLossScaler(init_scale=8.0, growth_interval=7)
    ref = torch.amp.GradScaler("cpu")
    ref.load_state_dict(ours.state_dict())
    assert ref.get_scale() == 8.0 and ref.get_growth_interval() == 7
    back = hal.amp.DynamicLossScaler()
    back.load_state_dict(ref.state_dict())
    assert back.get_scale() == 8.0 and back.get_growth_interval() == 7
    with pytest.raises(RuntimeError, match="state dict is empty"):
        back.load_state_dict({})


def test_scaler_misuse_raises_as_grad_scaler_does(seed: int) -> None:
    p = torch.nn.Parameter(torch.randn(3))
    opt = hal.optim.AdamW([p])
    scaler = hal.amp.DynamicLossScaler()
    with pytest.raises(AssertionError, match="No inf checks"):
        scaler.update()
    scaler.scale(p.sum())
    with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer"):
        scaler.step(opt)  # no gradient yet
    scaler = hal.amp.DynamicLossScaler()
    scaler.scale(p.sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match="Closure"):
        scaler.step(opt, closure=lambda: None)
    scaler.update()
    disabled = hal.amp.DynamicLossScaler(enabled=False)
    loss = p.sum()
    assert disabled.scale(loss) is loss and disabled.get_scale() == 1.0 and disabled.state_dict() == {}


def _adamw_run(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer, grads: list[list[torch.Tensor]]) -> None:
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.to(p.dtype)
        opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adamw_matches_torch_over_20_steps(dtype: torch.dtype, seed: int) -> None:
    """Two param groups (different lr and weight decay), 20 steps, same grads."""
    shapes = [(5, 3), (7,), (2, 2, 3)]
    init = [torch.randn(s, dtype=dtype) for s in shapes]
    grads = [[torch.randn(s, dtype=dtype) for s in shapes] for _ in range(20)]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    ours = [torch.nn.Parameter(t.clone()) for t in init]

    def groups(ps: list) -> list[dict]:
        return [{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-3, "weight_decay": 0.1}]

    _adamw_run(ref, torch.optim.AdamW(groups(ref), lr=1e-2, betas=(0.8, 0.99), eps=1e-6, foreach=False), grads)
    opt = hal.optim.AdamW(groups(ours), lr=1e-2, betas=(0.8, 0.99), eps=1e-6)
    _adamw_run(ours, opt, grads)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-13)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.detach(), b.detach(), **tol)
    assert float(opt.state[ours[0]]["step"]) == 20.0
    assert any(op == "fused_adamw_" for op, _, _ in hal.stats())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_adamw_master_weights_match_float32_training(dtype: torch.dtype, seed: int) -> None:
    """Half-precision params with master_weights=True: the float32 masters follow torch's AdamW on
    float32 params fed the same (half-precision) gradients, and each param is its master rounded."""
    shapes = [(6, 4), (4,)]
    init = [torch.randn(s).to(dtype) for s in shapes]
    grads = [[torch.randn(s).to(dtype) for s in shapes] for _ in range(20)]
    ref = [torch.nn.Parameter(t.float()) for t in init]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    _adamw_run(ref, torch.optim.AdamW(ref, lr=1e-3, foreach=False), grads)
    opt = hal.optim.AdamW(ours, lr=1e-3, master_weights=True)
    _adamw_run(ours, opt, grads)
    for p, r in zip(ours, ref):
        master = opt.state[p]["master_param"]
        assert master.dtype == torch.float32 and opt.state[p]["exp_avg"].dtype == torch.float32
        torch.testing.assert_close(master, r.detach(), rtol=1e-5, atol=1e-6)
        assert torch.equal(p.detach(), master.to(dtype))
    # the point of masters: 1e-3-sized updates vanish in bfloat16 params without them
    plain = [torch.nn.Parameter(t.clone()) for t in init]
    _adamw_run(plain, hal.optim.AdamW(plain, lr=1e-3), grads)
    drift = [(p.float() - r.detach()).abs().max().item() for p, r in zip(plain, ref)]
    kept = [(p.float() - r.detach()).abs().max().item() for p, r in zip(ours, ref)]
    assert max(kept) <= max(drift)


def test_adamw_found_inf_skips_without_advancing(seed: int) -> None:
    p = torch.nn.Parameter(torch.randn(3, 3))
    opt = hal.optim.AdamW([p], lr=0.1)
    p.grad = torch.randn(3, 3)
    opt.step()
    before = (p.detach().clone(), opt.state[p]["exp_avg"].clone())
    opt.step(found_inf=torch.tensor(1.0))
    assert torch.equal(p.detach(), before[0]) and torch.equal(opt.state[p]["exp_avg"], before[1])
    assert float(opt.state[p]["step"]) == 1.0
    opt.step(found_inf=torch.tensor(0.0))
    assert float(opt.state[p]["step"]) == 2.0 and not torch.equal(p.detach(), before[0])


def test_adamw_state_dict_round_trips_with_torch_adamw(seed: int) -> None:
    """hal's state loads into torch.optim.AdamW and torch's into hal's; each pair then takes the
    same step."""
    p = torch.nn.Parameter(torch.randn(4))
    ours = hal.optim.AdamW([p], lr=0.05)
    p.grad = torch.randn(4)
    ours.step()
    q = torch.nn.Parameter(p.detach().clone())
    ref = torch.optim.AdamW([q], lr=0.05, foreach=False)
    ref.load_state_dict(copy.deepcopy(ours.state_dict()))

    r = torch.nn.Parameter(torch.randn(4))
    theirs = torch.optim.AdamW([r], lr=0.05, foreach=False)
    r.grad = torch.randn(4)
    theirs.step()
    s = torch.nn.Parameter(r.detach().clone())
    back = hal.optim.AdamW([s], lr=0.05)
    back.load_state_dict(copy.deepcopy(theirs.state_dict()))
    assert back.param_groups[0]["master_weights"] is False and float(back.state[s]["step"]) == 1.0

    for a, b, opt_a, opt_b in ((p, q, ours, ref), (s, r, back, theirs)):
        g = torch.randn(4)
        a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


def test_adamw_reuses_its_launches_and_notices_changes_from_outside(seed: int) -> None:
    """Launch lists are built once and reused; a parameter gaining a gradient, a moment or a whole
    state replaced from outside, or a state emptied, is taken into account at the next step (the
    same results as torch.optim.AdamW fed the same changes)."""
    shapes = [(4, 3), (5,), (2, 2)]
    init = [torch.randn(s) for s in shapes]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    opt = hal.optim.AdamW(ours, lr=0.05)
    ref_opt = torch.optim.AdamW(ref, lr=0.05, foreach=False)

    def step(with_grad: tuple[int, ...]) -> None:
        for i in range(len(shapes)):
            g = torch.randn(shapes[i]) if i in with_grad else None
            ours[i].grad, ref[i].grad = (None, None) if g is None else (g.clone(), g.clone())
        opt.step()
        ref_opt.step()
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)

    step((0, 1))
    step((0, 1))
    launches = next(iter(opt._launch_cache.values()))
    step((0, 1))
    assert next(iter(opt._launch_cache.values())) is launches  # reused while nothing changed
    step((0, 1, 2))  # a parameter's first step
    new_avg = torch.randn(5)
    opt.state[ours[1]]["exp_avg"] = new_avg.clone()
    ref_opt.state[ref[1]]["exp_avg"] = new_avg.clone()
    step((0, 1, 2))
    opt.state[ours[0]].clear()
    ref_opt.state[ref[0]].clear()
    step((0, 1, 2))
    assert float(opt.state[ours[0]]["step"]) == 1.0 and float(opt.state[ours[1]]["step"]) == 6.0


def test_adamw_holds_its_plan_and_rebinds_when_the_call_changes(seed: int) -> None:
    """The step runs the plan it bound on its first step (counted in hal.stats, no cache key
    computed); gradients with other strides, a hal.use scope forcing another kernel, and
    hal.dispatch.reset() each make it bind again, and results stay torch.optim.AdamW's."""
    shapes = [(6, 4), (5,), (3, 2, 2)]
    init = [torch.randn(s) for s in shapes]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    opt = hal.optim.AdamW(ours, lr=0.05)
    ref_opt = torch.optim.AdamW(ref, lr=0.05, foreach=False)
    kernels = [k.name for k in hal.dispatch.DISPATCHER.runtime().kernels("fused_adamw_", "cpu_ref")]

    def step(transposed: bool = False) -> None:
        for a, b, s in zip(ours, ref, shapes):
            g = torch.randn(s[::-1]).mT if transposed and len(s) == 2 else torch.randn(s)
            a.grad, b.grad = g, g.clone()
        opt.step()
        ref_opt.step()
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)

    hal.reset_stats()
    step()
    (launch,) = next(iter(opt._launch_cache.values()))
    first = launch.plan.bound
    with torch.no_grad():  # the mode the step runs in, part of what the plan was decided for
        assert first is not None and first.current()
    step()
    assert launch.plan.bound is first  # held across steps
    assert sum(v["calls"] for (op, _, _), v in hal.stats().items() if op == "fused_adamw_") == 2
    step(transposed=True)  # a gradient with other strides: bound again for that call
    assert launch.plan.bound is not first
    strided = launch.plan.bound
    with hal.use(backend="cpu_ref", kernel={"fused_adamw_": kernels[-1]}):
        step(transposed=True)
        assert launch.plan.bound is not strided
    hal.dispatch.reset()
    with torch.no_grad():
        assert not launch.plan.bound.current()
    step()


def test_scaler_holds_its_unscale_plan_and_rebinds_for_other_strides(seed: int) -> None:
    """unscale_ keeps one plan per (device, dtype) group across iterations and binds again when the
    gradients' strides change; each iteration's gradients come out divided by that scale."""
    p = torch.nn.Parameter(torch.randn(6, 4))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = hal.amp.DynamicLossScaler(init_scale=8.0)
    held = []
    for transposed in (False, False, True):
        g = torch.randn(4, 6).mT if transposed else torch.randn(6, 4)
        p.grad = g.clone()
        scaler.scale(p.sum())  # the iteration's scale is set by scale()
        scaler.unscale_(opt)
        torch.testing.assert_close(p.grad, g / 8.0, rtol=0, atol=0)
        assert p.grad.stride() == g.stride()
        (plan,) = scaler._unscale_plans[id(opt)].values()
        held.append(plan.bound)
        scaler.step(opt)
        scaler.update(8.0)
    assert held[0] is held[1] and held[2] is not held[1]


# --- checkpoints between hal.optim.AdamW and torch.optim.AdamW ----------------------------------


def _mlp(dtype: torch.dtype = torch.float32) -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(dtype)


def _two_groups(model: torch.nn.Module) -> list[dict]:
    """Two param groups with their own learning rate and weight decay (the first layer, the last)."""
    first, last = model[0], model[2]
    return [{"params": list(first.parameters())}, {"params": list(last.parameters()), "lr": 3e-3, "weight_decay": 0.1}]


def _make(kind: str, model: torch.nn.Module, master: bool = False) -> torch.optim.Optimizer:
    if kind == "hal":
        return hal.optim.AdamW(_two_groups(model), lr=2e-2, betas=(0.8, 0.99), master_weights=master)
    return torch.optim.AdamW(_two_groups(model), lr=2e-2, betas=(0.8, 0.99))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x.to(model[0].weight.dtype)).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _checkpointed(opt: torch.optim.Optimizer) -> dict:
    """The optimizer's state_dict through torch.save and torch.load, as a checkpoint file holds it."""
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer)


@pytest.mark.parametrize("first, then", [("hal", "torch"), ("torch", "hal")])
def test_adamw_checkpoint_resumes_in_the_other_optimizer_as_if_never_switched(first: str, then: str, seed: int) -> None:
    """A model trained 3 steps by one AdamW, checkpointed and resumed for 4 steps by the other,
    gives the losses and parameters of 7 steps of one optimizer (to float rounding), with two
    param groups; every parameter counts its own 7 steps. Before: hal's state held one step tensor
    shared by the parameters of a launch, which torch.optim.AdamW incremented once per parameter
    (4 parameters: 3 + 4 * 4 = 19 after the switch), and the loss drifted."""
    batches = [(torch.randn(16, 6), torch.randn(16, 3)) for _ in range(7)]
    model = _mlp()
    straight = copy.deepcopy(model)
    opt = _make(first, model)
    losses = _train(model, opt, batches[:3])
    resumed = _make(then, model)
    resumed.load_state_dict(_checkpointed(opt))
    losses += _train(model, resumed, batches[3:])

    reference = _make(then, straight)
    want = _train(straight, reference, batches)
    torch.testing.assert_close(losses, want, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), straight.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)
    steps = [resumed.state[p]["step"] for p in model.parameters()]
    assert [float(s) for s in steps] == [7.0] * 4
    assert resumed.param_groups[1]["lr"] == 3e-3 and resumed.param_groups[1]["weight_decay"] == 0.1


def test_adamw_state_dict_gives_each_parameter_its_own_step_as_torch_does(seed: int) -> None:
    """hal shares one step tensor inside a launch, but the state_dict it gives out holds one
    independent step tensor per parameter, on the CPU, as torch.optim.AdamW's does; hal's own
    steps are unchanged by what is done to the state_dict."""
    model = _mlp()
    opt = _make("hal", model)
    _train(model, opt, [(torch.randn(4, 6), torch.randn(4, 3))] * 2)
    ours, theirs = opt.state_dict(), _make("torch", _mlp()).state_dict()
    steps = [s["step"] for s in ours["state"].values()]
    assert len(steps) == 4 and len({id(s) for s in steps}) == 4
    assert all(s.device.type == "cpu" and s.dtype == torch.float32 and s.shape == () and float(s) == 2.0 for s in steps)
    steps[0].add_(5.0)
    assert [float(opt.state[p]["step"]) for p in model.parameters()] == [2.0] * 4
    assert ours["param_groups"][0].keys() - theirs["param_groups"][0].keys() == {"master_weights"}


def test_adamw_master_weights_resume_from_a_checkpoint_exactly(seed: int) -> None:
    """master_weights=True on a bfloat16 model: resumed from a checkpoint, training goes on bit for
    bit as without the checkpoint (float32 masters and moments survive the load). Before: loading
    cast the masters and moments to the parameters' bfloat16, as torch's Optimizer casts state."""
    batches = [(torch.randn(16, 6), torch.randn(16, 3)) for _ in range(6)]
    model = _mlp(torch.bfloat16)
    straight = copy.deepcopy(model)
    opt = _make("hal", model, master=True)
    losses = _train(model, opt, batches[:3])
    resumed = _make("hal", model, master=True)
    resumed.load_state_dict(_checkpointed(opt))
    losses += _train(model, resumed, batches[3:])
    want = _train(straight, _make("hal", straight, master=True), batches)
    assert losses == want
    for p, q in zip(model.parameters(), straight.parameters()):
        assert torch.equal(p, q)
        assert resumed.state[p]["master_param"].dtype == resumed.state[p]["exp_avg"].dtype == torch.float32


def test_adamw_master_weights_state_goes_to_torch_and_comes_back(seed: int) -> None:
    """A bfloat16 model's master-weight state loads into torch.optim.AdamW (one step count per
    parameter, the moments cast to the parameters' dtype as torch does), and torch's state loads
    into hal with master weights: moments in float32, masters made from the parameters, and the
    masters then follow torch's AdamW in float32 from that state, fed the same gradients."""
    model = _mlp(torch.bfloat16)
    params = list(model.parameters())
    grads = [[torch.randn_like(p) for p in params] for _ in range(6)]
    opt = _make("hal", model, master=True)
    _adamw_run(params, opt, grads[:2])
    theirs = _make("torch", model)
    theirs.load_state_dict(_checkpointed(opt))
    _adamw_run(params, theirs, grads[2:4])
    assert [float(theirs.state[p]["step"]) for p in params] == [4.0] * 4
    assert all(theirs.state[p]["exp_avg"].dtype == torch.bfloat16 for p in params)

    back = _make("hal", model, master=True)
    back.load_state_dict(_checkpointed(theirs))
    assert all(back.state[p]["exp_avg"].dtype == back.state[p]["exp_avg_sq"].dtype == torch.float32 for p in params)
    reference = _mlp()
    with torch.no_grad():
        for r, p in zip(reference.parameters(), params):
            r.copy_(p.float())
    float_opt = _make("torch", reference)
    float_opt.load_state_dict(_checkpointed(theirs))
    _adamw_run(params, back, grads[4:])
    _adamw_run(list(reference.parameters()), float_opt, grads[4:])
    for p, r in zip(params, reference.parameters()):
        assert float(back.state[p]["step"]) == 6.0
        torch.testing.assert_close(back.state[p]["master_param"], r.detach(), rtol=1e-5, atol=1e-6)
        assert torch.equal(p.detach(), back.state[p]["master_param"].to(torch.bfloat16))
