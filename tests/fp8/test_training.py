"""hal.fp8 in training, on the CPU: converted models under torch.compile (fullgraph, the same
forward, gradients and delayed-scaling state as eager over several steps), with hal.optim.AdamW
keeping float32 master weights of a bfloat16 model (the loss falls and tracks the bfloat16 run),
the recipes' state updated in place, and FP8 refused at construction on GPUs without it (the
reasons of hal.plugin_sdk.fp8_hardware for architecture strings; the CUDA runs are in
tests/cuda/device/test_fp8_training.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hal
from hal.errors import UnsupportedError
from hal.fp8.device import require_fp8, unsupported
from hal.plugin_sdk.fp8_hardware import fp8_arch_reasons


def mlp(seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 48), nn.GELU(),
                         nn.Linear(48, 16)).to(dtype)


def batches(seed: int, n: int, dtype: torch.dtype = torch.float32, vary: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inputs and targets of a smooth function; ``vary``: input amaxes that move from batch to batch
    (so delayed scaling's history matters)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(32, 16, generator=g) / 4
    out = []
    for i in range(n):
        x = torch.randn(24, 32, generator=g) * ((1 + i % 3) if vary else 1)
        out.append((x.to(dtype), torch.tanh(x @ w).to(dtype)))
    return out


@pytest.mark.parametrize("recipe", [hal.fp8.DelayedScaling(history=3), hal.fp8.RowwiseScaling()], ids=["delayed", "row"])
def test_compiled_fullgraph_matches_eager(recipe):
    """Three SGD steps, eager and compiled (fullgraph=True: a graph break is an error): the same
    outputs and gradients, and delayed scaling's histories and scales updated alike."""
    eager = hal.fp8.convert(mlp(1), recipe, keep=("last",))
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (eager, compiled_model)]
    for x, y in batches(2, 3):
        for model, opt in ((eager, opts[0]), (compiled, opts[1])):
            opt.zero_grad()
            out = model(x)
            (out - y).square().mean().backward()
            opt.step()
        # Inductor's code and the eager kernels round a few elements differently by an ulp (on a
        # CPU without AVX-512 its GELU did); where such an element lands on an FP8 rounding
        # boundary it moves by one FP8 step, which e4m3's 3 mantissa bits make up to ~1e-2 of it
        # (seen: 16 of 384 outputs, 8e-3 relative, 1.2e-4 absolute). A wrong scale or a dropped
        # update moves every element by far more.
        torch.testing.assert_close(compiled(x), eager(x), rtol=2e-2, atol=5e-4)
        for (name, p), q in zip(eager.named_parameters(), compiled_model.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=2e-2, atol=5e-4, msg=name)
    for (name, b), c in zip(eager.named_buffers(), compiled_model.buffers()):
        torch.testing.assert_close(c, b, rtol=1e-5, atol=0.0, msg=name)
    if isinstance(recipe, hal.fp8.DelayedScaling):
        assert all(float(b.max()) > 0 for n, b in eager.named_buffers() if n.endswith("amax_history"))


def train(model: nn.Module, opt: torch.optim.Optimizer, data, dtype) -> list[float]:
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = (model(x).float() - y.float()).square().mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def test_hal_adamw_with_float32_masters_trains_a_converted_bfloat16_model():
    recipe = hal.fp8.DelayedScaling()  # the recipe with state (current scaling runs in the other tests)
    data = batches(5, 40, torch.bfloat16, vary=False)
    ref_model = mlp(3, torch.bfloat16)
    ref = train(ref_model, hal.optim.AdamW(ref_model.parameters(), lr=1e-2, master_weights=True), data, torch.bfloat16)
    model = hal.fp8.convert(mlp(3, torch.bfloat16), recipe)
    assert sum(isinstance(m, hal.fp8.Linear) for m in model.modules()) == 2  # first and last kept
    opt = hal.optim.AdamW(model.parameters(), lr=1e-2, master_weights=True)
    losses = train(model, opt, data, torch.bfloat16)
    masters = [opt.state[p]["master_param"] for p in model.parameters()]
    assert all(m.dtype == torch.float32 for m in masters)
    for p, m in zip(model.parameters(), masters):
        assert torch.equal(p, m.to(torch.bfloat16))  # the parameter is its master rounded
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.5 * first, losses
    assert abs(last - sum(ref[-5:]) / 5) < 0.05 * first, (losses[-5:], ref[-5:])


def test_casting_a_converted_model_keeps_the_recipe_state_float32():
    model = hal.fp8.convert(mlp(8), hal.fp8.DelayedScaling(history=4), keep=()).to(torch.bfloat16)
    assert all(b.dtype == torch.float32 for b in model.buffers())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    x, y = batches(9, 1, torch.bfloat16)[0]
    (model(x).float() - y.float()).square().mean().backward()
    assert all(b.dtype == torch.float32 for b in model.half().buffers())


def test_delayed_state_is_updated_in_place():
    """The history and the scale keep their storage step after step (what CUDA graph replays need)."""
    model = hal.fp8.convert(mlp(4), hal.fp8.DelayedScaling(history=4), keep=())
    ptrs = {n: b.data_ptr() for n, b in model.named_buffers()}
    for x, y in batches(6, 3):
        (model(x) - y).square().mean().backward()
    assert {n: b.data_ptr() for n, b in model.named_buffers()} == ptrs
    assert all(float(b[:3].min()) > 0 for n, b in model.named_buffers() if n.endswith("amax_history"))


@pytest.mark.parametrize("arch,formats", [("sm_80", ("e4m3fn", "e5m2")), ("sm_86", ("e4m3fn", "e5m2")),
                                          ("gfx90a", ("e4m3fnuz", "e5m2fnuz")), ("gfx942", ("e4m3fn", "e5m2")),
                                          ("sm_90", ("e4m3fnuz", "e5m2fnuz"))])
def test_refusal_names_the_device_and_reasons(arch, formats):
    reasons = fp8_arch_reasons(arch, formats)
    assert reasons
    err = unsupported("hal.fp8.Linear", f"cuda:0 ({arch})", reasons)
    assert isinstance(err, UnsupportedError)
    assert arch in str(err) and all(r in str(err) for r in reasons)


def test_fp8_devices_and_the_cpu_pass():
    for arch, formats in (("sm_89", ("e4m3fn", "e5m2")), ("sm_90", ("e4m3fn", "e5m2")), ("gfx942", ("e4m3fnuz", "e5m2fnuz")),
                          ("gfx950", ("e4m3fn", "e5m2"))):
        assert fp8_arch_reasons(arch, formats) == []
    require_fp8("hal.fp8.Linear", torch.device("cpu"), ("e4m3fn", "e5m2"))
    require_fp8("hal.fp8.Linear", torch.device("meta"), ("e4m3fn", "e5m2"))
    lin = hal.fp8.Linear(16, 16, recipe=hal.fp8.DelayedScaling(format="e4m3fnuz"))  # the CPU emulates every format
    assert lin(torch.randn(4, 16)).shape == (4, 16)


def test_convert_checks_its_recipe_before_changing_anything():
    model = mlp(7)
    with pytest.raises(TypeError, match="recipe"):
        hal.fp8.convert(model, recipe="e4m3fn", keep=())
    assert not any(isinstance(m, hal.fp8.Linear) for m in model.modules())
