"""``hal conformance --model``: a wrong kernel planted in one op of a small model (a CPU kernel of the
real ``cpu`` backend wrapped to scale its result, registered by a test plugin beside the installed
ones) is named with its op, kernel and call site, and confirmed by a forced re-run; the unplanted
model passes; a wrong backward kernel is named as such; a wrong op inside a decomposition is found
by bisecting the decomposition; the command line writes the three reports; a Hugging Face Llama
built from a config runs.

The runs use HAL_TUNE=off (kernel choice by priority alone), so that a tuning cache on the machine
cannot prefer another kernel over the planted one."""

from __future__ import annotations

import inspect
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable, Sequence

import pytest
import torch

import hal
from hal.conformance import cli
from hal.conformance.model import Settings, check_model
from hal.dispatch import DISPATCHER
from hal.plugin import Plugin
from hal.runtime import Runtime
from tests.conformance import model_mode_models

MLP = "tests.conformance.model_mode_models:tiny_mlp"
MLP_WITH_LOSS = "tests.conformance.model_mode_models:tiny_mlp_with_loss"
SETTINGS = Settings(steps=2, tune="off")
MODELS_FILE = Path(model_mode_models.__file__).resolve()


def _installed() -> list[Plugin]:
    return [lp.plugin for lp in DISPATCHER.runtime().plugins if lp.plugin is not None]


def _scaled(op: str, kernel: str, factor: float, *, differentiable: Any = None) -> Plugin:
    """A plugin adding kernel ``scaled`` of ``op`` to the cpu backend, above its kernels: the cpu
    backend's ``kernel`` with its result times ``factor`` (1.0: the same results, registered as
    ``differentiable`` says, to steer the route a call takes)."""
    base = next(k for k in DISPATCHER.runtime().kernels(op, "cpu") if k.name == kernel)
    plugin = Plugin(f"planted_{op}", "0.0.1")

    def scaled(*args: Any) -> Any:
        out = base.fn(*args)
        return tuple(o * factor if isinstance(o, torch.Tensor) else o for o in out) if isinstance(out, tuple) else out * factor

    scaled.__signature__ = inspect.signature(base.fn)  # type: ignore[attr-defined]  (the op's parameters)
    differentiable = base.differentiable if differentiable is None else differentiable
    plugin.kernel(op, name="scaled", backend="cpu", priority=1000, differentiable=differentiable)(scaled)
    return plugin


@pytest.fixture
def plant(install_plugins: Callable[[Sequence[Plugin]], Runtime]) -> Callable[..., None]:
    """Install the real plugins plus planted ones (restored afterwards)."""
    real = _installed()
    return lambda *plugins: install_plugins([*real, *plugins]) and None


def test_a_planted_wrong_kernel_is_named_with_its_op_kernel_and_call_site(plant: Callable[..., None]) -> None:
    plant(_scaled("linear", "torch", 1.01))
    r = check_model(MLP, SETTINGS)
    assert r.status == "fail", r.summary_line
    assert r.first is not None and r.call is not None and r.culprit is not None
    assert (r.first.index, r.first.kind, r.first.component) == (0, "output", "out")
    assert r.first.used > 10, r.first  # a 1% error against float32 budgets of ~1e-5
    assert (r.culprit.op, r.culprit.backend, r.culprit.kernel, r.culprit.phase) == ("linear", "cpu", "scaled", "forward")
    assert r.call.site is not None and Path(r.call.site.file).resolve() == MODELS_FILE
    assert r.call.site.line == model_mode_models.PLANTED_LINE and r.call.site.function == "forward"
    assert r.confirmation is not None and r.confirmation.confirmed and r.confirmation.forced == [(0,)]
    # forcing call #0 to cpu_ref moves the first divergence to the next linear call, still planted
    assert r.confirmation.trials[0].first_after is not None and "call #2 linear (cpu/scaled)" in r.confirmation.trials[0].first_after
    # the loss curves of both runs come with it
    assert r.test is not None and r.reference is not None and len(r.test.losses) == len(r.reference.losses) == 2
    assert abs(r.test.losses[0] - r.reference.losses[0]) > 1e-4 * abs(r.reference.losses[0])


def test_the_unplanted_model_passes() -> None:
    r = check_model(MLP, SETTINGS)
    assert r.status == "pass", r.summary_line
    assert r.comparison is not None and r.comparison.checks and all(c.ok for c in r.comparison.checks)
    kinds = {c.kind for c in r.comparison.checks}
    assert kinds == {"output", "gradient"}
    assert {c.op for c in r.test.calls} == {"linear", "layer_norm", "cross_entropy"}  # type: ignore[union-attr]
    assert r.test.losses[1] < r.test.losses[0]  # type: ignore[union-attr]
    assert max(abs(a - b) / abs(b) for a, b in zip(r.test.losses, r.reference.losses)) < 1e-5  # type: ignore[union-attr]


def test_a_wrong_backward_kernel_is_named_as_the_backward_ops(plant: Callable[..., None]) -> None:
    # layer_norm's own kernel without torch autograd: hal's node runs layer_norm_backward, planted wrong
    plant(_scaled("layer_norm", "torch", 1.0, differentiable=False), _scaled("layer_norm_backward", "torch", 1.01, differentiable=False))
    r = check_model(MLP, SETTINGS)
    assert r.status == "fail" and r.first is not None and r.culprit is not None, r.summary_line
    assert (r.first.index, r.first.kind) == (1, "gradient"), r.first
    assert (r.culprit.op, r.culprit.backend, r.culprit.kernel, r.culprit.phase) == ("layer_norm_backward", "cpu", "scaled", "backward")
    assert r.confirmation is not None and r.confirmation.confirmed


def test_a_wrong_op_inside_a_decomposition_is_found_by_bisecting_it(plant: Callable[..., None]) -> None:
    # linear(act="relu") needing autograd, with a linear kernel torch's autograd cannot record, runs
    # as linear then scale_shift_act (its training decomposition); the activation's kernel is wrong
    plant(_scaled("linear", "torch", 1.0, differentiable=False), _scaled("scale_shift_act", "torch", 1.01))
    r = check_model(MLP_WITH_LOSS, SETTINGS)
    assert r.status == "fail" and r.call is not None and r.culprit is not None, r.summary_line
    assert (r.call.op, r.call.route) == ("linear", "decomposition")
    assert (r.culprit.op, r.culprit.kernel, r.culprit.path) == ("scale_shift_act", "scaled", (0, 2))
    assert r.confirmation is not None and r.confirmation.confirmed


def test_the_command_line_writes_three_reports_naming_the_planted_kernel(plant: Callable[..., None], tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HAL_TUNE", "off")
    plant(_scaled("linear", "torch", 1.01))
    status = cli.main(["--model", MLP, "--steps", "2", "--report-dir", str(tmp_path)])
    assert status == 1
    doc = json.loads((tmp_path / "model-report.json").read_text())
    assert doc["mode"] == "model" and doc["backend"] == "cpu" and doc["summary"] == {"pass": 0, "fail": 1, "error": 0, "skip": 0}
    m = doc["models"][0]
    assert (m["culprit"]["op"], m["culprit"]["kernel"]) == ("linear", "scaled")
    assert m["first_divergence"]["site"]["line"] == model_mode_models.PLANTED_LINE
    assert len(m["loss"]) == len(m["reference_loss"]) == 2 and m["call_table"][0]["kernel"] == "scaled"
    md = (tmp_path / "model-report.md").read_text()
    assert "Diverging op `linear`, kernel `cpu/scaled`" in md and f"model_mode_models.py:{model_mode_models.PLANTED_LINE}" in md
    assert "### Loss curves" in md
    suite = ET.parse(tmp_path / "model-junit.xml").getroot().find("testsuite")
    assert suite is not None and suite.get("failures") == "1"
    case = suite.find("testcase")
    assert case is not None and case.get("name") == MLP
    failure = case.find("failure")
    assert failure is not None and "linear (cpu/scaled)" in failure.get("message", "")


def test_model_options_need_model_and_bad_models_are_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--steps", "2", "--report-dir", str(tmp_path)]) == 2
    assert "--steps only apply with --model" in capsys.readouterr().err
    assert cli.main(["--model", "no_such_model", "--report-dir", str(tmp_path)]) == 2
    assert "no built-in model 'no_such_model'" in capsys.readouterr().err
    assert cli.main(["--model", "tests.conformance.model_mode_models:missing", "--report-dir", str(tmp_path)]) == 2
    assert "has no attribute 'missing'" in capsys.readouterr().err


def test_a_hugging_face_llama_from_a_config_runs_patched() -> None:
    pytest.importorskip("transformers")
    r = check_model("hf_llama", SETTINGS)
    assert r.status == "pass", r.summary_line
    ops = {c.op for c in r.test.calls}  # type: ignore[union-attr]
    assert {"rms_norm", "scaled_dot_product_attention", "swiglu", "linear_cross_entropy"} <= ops, ops
    sites = {c.site.file for c in r.test.calls if c.site is not None}  # type: ignore[union-attr]
    assert any(f.endswith("modeling_llama.py") for f in sites), sites


def test_the_dispatchers_observer_sees_the_calls_of_its_scope_and_no_others() -> None:
    from hal import config

    seen: list[tuple[str, str, str]] = []

    def observer(decl: Any, route: Any, run: Callable[..., Any], args: tuple) -> Any:
        seen.append((decl.name, route.backend, route.kernel))
        return run(*args)

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 9, generator=gen, requires_grad=True)
    with config.scope(observer=observer):
        y = hal.ops.softmax(x, -1)
    assert [s[0] for s in seen] == ["softmax"] and torch.allclose(y, torch.softmax(x, -1))
    hal.ops.softmax(x, -1)  # outside the scope: the plan made inside it is not used
    assert len(seen) == 1
    with config.scope(observer=observer):
        hal.ops.softmax(x, -1)  # a cached plan of the scope still goes through the observer
    assert len(seen) == 2
