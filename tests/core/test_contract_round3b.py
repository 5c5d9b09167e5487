"""Regression tests for what the recorded re-run of issue 41's attack classes found
(benchmarks/attacks41.py, the twenty-fourth session). Each test fails on the code before its fix
(noted per test); inputs are drawn from the test's seed, never zeros."""

from __future__ import annotations

import copy
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import hal
from hal.optim import AdamW


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- hal.optim.AdamW ----------------------------------------------------------------------------------


def test_adamw_keeps_the_count_of_a_parameter_without_a_gradient(seed: int) -> None:
    """Before: parameters that started together shared one step count, so a parameter without a
    gradient in a step (frozen for a while, unused by a branch) had its count incremented by the
    others' launch, and its next update used the wrong bias correction (torch counts each
    parameter's own steps). Also across a checkpoint into torch.optim.AdamW."""
    g = _gen(seed)
    theirs = [nn.Parameter(torch.randn(4, 3, generator=g)), nn.Parameter(torch.randn(3, generator=g))]
    ours = [nn.Parameter(p.detach().clone()) for p in theirs]
    opt, ref = AdamW(ours, lr=0.05), torch.optim.AdamW(theirs, lr=0.05)
    for step in range(6):
        if step == 4:  # hal's state, saved and resumed in torch's AdamW
            buffer = io.BytesIO()
            torch.save(opt.state_dict(), buffer)
            buffer.seek(0)
            opt = torch.optim.AdamW(ours, lr=0.05)
            opt.load_state_dict(torch.load(buffer))
        for i, (a, b) in enumerate(zip(ours, theirs)):
            grad = None if (i == 0 and step % 2 == 1) else torch.randn(a.shape, generator=g)
            a.grad = b.grad = grad
            if grad is not None:
                a.grad, b.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
        if step == 3:
            assert [float(s["step"]) for s in opt.state_dict()["state"].values()] == [2.0, 4.0]
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("option", ["amsgrad", "maximize"])
def test_adamw_refuses_a_torch_state_saved_with_an_option_it_lacks(seed: int, option: str) -> None:
    """Before: the state of a torch.optim.AdamW run with amsgrad or maximize loaded into hal's AdamW
    without a word, which then continued another optimization (maximize: the wrong direction)."""
    g = _gen(seed)
    params = [nn.Parameter(torch.randn(4, 3, generator=g))]
    ref = torch.optim.AdamW(params, lr=0.05, **{option: True})
    params[0].grad = torch.randn(4, 3, generator=g)
    ref.step()
    with pytest.raises(hal.InvalidArgumentError, match=f"without {option}.*keep torch.optim.AdamW"):
        AdamW(params, lr=0.05).load_state_dict(copy.deepcopy(ref.state_dict()))


def test_adamw_refuses_a_parameter_listed_twice(seed: int) -> None:
    """Before: accepted (torch warns that this will become an error and steps the parameter twice
    per step); hal's fused launch then updated it in a way matching neither."""
    p = nn.Parameter(torch.randn(3, 2, generator=_gen(seed)))
    with pytest.raises(hal.InvalidArgumentError, match="each parameter once.*listed twice"):
        AdamW([p, p])
    opt = AdamW([p])
    with pytest.raises(hal.InvalidArgumentError, match="listed twice"):
        opt.add_param_group({"params": [p]})


# --- hal.nn.patch: what recognising a module may not change --------------------------------------------


def test_patch_leaves_a_spectral_norm_models_state_as_it_was(seed: int) -> None:
    """Before: patch read the ``weight`` of every module to recognise norms, and reading a
    parametrized weight runs the parametrization: spectral_norm's power iteration (training mode)
    moved its ``_u``/``_v`` vectors, so the patched model computed another weight than the original."""
    from torch.nn.utils import parametrizations

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
    parametrizations.spectral_norm(model[0])
    plain = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    hal.nn.patch(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    x = torch.randn(2, 4, 5, 5, generator=_gen(seed))
    torch.testing.assert_close(model(x), plain(x))


def _tiny_llama(seed: int) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config).eval()


def test_patch_does_not_call_the_users_hooks_with_its_probes(seed: int) -> None:
    """Before: the LM head's check ran the whole model twice on probe tokens, so a forward hook on
    a decoder layer (activation logging) saw two calls that the user never made."""
    model = _tiny_llama(seed)
    calls: list[tuple] = []
    model.model.layers[0].register_forward_hook(lambda mod, args, out: calls.append(tuple(args[0].shape)))
    hal.nn.patch(model)
    assert calls == []
    ids = torch.randint(0, 64, (2, 7), generator=_gen(seed))
    model(input_ids=ids)
    assert calls == [(2, 7, 32)]


def test_patch_keeps_a_hook_on_an_attention_projection(seed: int) -> None:
    """A forward hook on q_proj changes what the model computes; the patched attention must keep
    running it (or leave that attention alone). Before: the probe of the attention's copy ran the
    user's hook too (copied along with the module)."""
    model = _tiny_llama(seed)
    seen: list[int] = []

    def scale(mod: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        seen.append(out.shape[0])
        return out * 1.5

    model.model.layers[1].self_attn.q_proj.register_forward_hook(scale)
    plain = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 7), generator=_gen(seed))
    want = plain(input_ids=ids).logits
    seen.clear()
    hal.nn.patch(model)
    assert seen == []
    torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-4, atol=1e-5)


# --- hal.optimize -----------------------------------------------------------------------------------


def test_optimize_refuses_a_model_on_the_meta_device() -> None:
    """Before: RuntimeError "User specified an unsupported autocast device_type 'meta'" from inside
    the first step."""
    with pytest.raises(hal.InvalidArgumentError, match="meta device.*materialise"):
        hal.optimize(nn.Linear(4, 3, device="meta"), None, loss_fn=nn.functional.mse_loss, compile=False, graph=False)


def test_optimize_says_when_the_step_gets_fewer_arguments_than_inputs(seed: int) -> None:
    """Before: the model was called with every argument (the targets too) and raised "forward()
    takes 2 positional arguments but 3 were given"."""
    g = _gen(seed)
    model = nn.Linear(4, 3)
    step = hal.optimize(model, torch.optim.AdamW(model.parameters()), loss_fn=nn.functional.mse_loss, inputs=3,
                        compile=False, graph=False, measure_steps=1)
    with pytest.raises(hal.InvalidArgumentError, match=r"argument 'inputs'.*called with \(2\).*got inputs=3"):
        step(torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g))


# --- hal.fp8 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("margin", [-3, float("nan"), float("inf"), "1"])
def test_delayed_scaling_refuses_a_margin_that_is_no_headroom(margin: object) -> None:
    """Before: DelayedScaling(margin=-3) was taken and scaled below the amax, so every value above
    max_finite / 8 saturated silently (an FP8 Linear's output far from nn.Linear's)."""
    from hal.fp8.recipes import DelayedScaling

    with pytest.raises(ValueError, match="hal.fp8: DelayedScaling needs margin, a finite number >= 0"):
        DelayedScaling(margin=margin)  # type: ignore[arg-type]
    assert DelayedScaling(margin=2).margin == 2


# --- hal.library: a backward op that is never declared ---------------------------------------------------

_LIBRARY_SCRIPT = r"""
import torch, hal, hal.library
from hal.types import Tensor

@hal.library.declare(dtypes=("float32",), tolerances=hal.library.ELEMENTWISE, backward="no_such_backward", gradients="x")
def r3b_cube(x: Tensor) -> Tensor:
    '''x**3'''

r3b_cube.fake(lambda a: a["x"].new_empty(a["x"].shape))
try:
    hal.library.register_kernel("r3b_cube", backend="cpu", name="k")(lambda x: x**3)
except hal.InvalidArgumentError as exc:
    print("REFUSED", exc)
for bad in ({"backward": "softmax", "gradients": "x"}, {"tolerances": 1e-5}):
    def r3b_other(x: Tensor) -> Tensor:
        '''x'''
    try:
        hal.library.declare(dtypes=("float32",), **{"tolerances": hal.library.ELEMENTWISE, **bad})(r3b_other)
    except hal.InvalidArgumentError as exc:
        print("REFUSED", exc)
"""


def test_library_refuses_an_undeclared_backward_op_at_registration() -> None:
    """Before: ``backward="no_such_backward"`` was accepted, kernels registered, and the first call
    needing autograd failed (KeyError, later UnsupportedError); ``backward="softmax"`` (a forward
    op) raised a bare TypeError, ``tolerances=1e-5`` "'float' object is not iterable". Now each is
    an InvalidArgumentError when made. Declarations last for the process: run in a fresh one."""
    out = subprocess.run([sys.executable, "-c", _LIBRARY_SCRIPT], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    lines = [line for line in out.stdout.splitlines() if line.startswith("REFUSED")]
    assert len(lines) == 3, out.stdout + out.stderr[-3000:]
    assert "register_kernel: argument 'op'" in lines[0] and "'no_such_backward'" in lines[0] and "forward='r3b_cube'" in lines[0]
    assert "argument 'backward'" in lines[1] and "'softmax', an op declared as a forward op" in lines[1]
    assert "argument 'tolerances'" in lines[2] and "hal.library.Tolerance" in lines[2]


# --- the tune cache and hal.tune (attacks41's tuning class) ------------------------------------------


def test_a_tune_cache_nested_too_deeply_is_ignored_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Before: json.loads raised RecursionError out of TuneCache (every call measuring its kernels
    raised); the docs promise a file hal cannot use is ignored with one warning."""
    import logging

    from hal.tuning import TuneCache

    first = TuneCache("cpu-a41-model", {"hal": "x"}, tmp_path)
    first.put("k", {"winner": "a", "times_us": {"a": 1.0}})
    first.path.write_text("[" * 100000 + "]" * 100000)
    with caplog.at_level(logging.WARNING, logger="hal"):
        again = TuneCache("cpu-a41-model", {"hal": "x"}, tmp_path)
        assert again.get("k") is None
        again.put("k", {"winner": "b", "times_us": {"b": 2.0}})
    assert "nested too deeply" in caplog.text and str(again.path) in caplog.text
    assert TuneCache("cpu-a41-model", {"hal": "x"}, tmp_path).get("k")["winner"] == "b"


@pytest.mark.parametrize("device, versions, error", [(5, {"hal": "x"}, "not a slug"), ("cpu-a41", ["hal"], "versions must be a mapping"),
                                                     ("cpu-a41", {"hal": 1}, "versions must be a mapping")])
def test_tune_cache_refuses_a_device_or_versions_of_the_wrong_type(tmp_path: Path, device, versions, error: str) -> None:
    """Before: re's "expected string or bytes-like object, got 'int'" and dict()'s "dictionary update
    sequence element #0 has length 3; 2 is required" (a {"hal": 1} was taken and hashed)."""
    from hal.tuning import TuneCache

    with pytest.raises((ValueError, TypeError), match=error):
        TuneCache(device, versions, tmp_path)


def test_hal_tune_refuses_a_step_that_is_not_callable() -> None:
    """Before: TypeError: 'int' object is not callable, from inside hal.tune."""
    with pytest.raises(hal.InvalidArgumentError, match="hal.tune: argument 'step' must be a callable"):
        hal.tune(5)
