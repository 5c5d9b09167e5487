"""Golden loss curves: fresh CPU runs of the built-in models match the committed curves
(``conformance/golden/cpu/loss_curves.json``), within the tolerances the golden module justifies
(:data:`hal.conformance.model_golden.RTOL`: 1e-4 relative for the float32 curve, 500 times the
float32-vs-float64 gap measured on the project's CPUs, smaller than what a kernel wrong by a
fraction of a percent does to the loss; 1e-9 for the float64 reference's); a curve off by more, or
a run with other settings, is reported; ``--write-golden`` and ``--golden`` round-trip."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from hal.conformance import cli, model_golden
from hal.conformance.model import ModelResult, Settings, check_model

GOLDEN = model_golden.GOLDEN_DIR / "cpu" / model_golden.FILE


@pytest.fixture(scope="module")
def golden_runs() -> tuple[dict, list[ModelResult]]:
    doc = model_golden.load(GOLDEN)
    settings = Settings(**doc["settings"], bisect=False)
    return doc, [check_model(name, settings) for name in doc["models"]]


def test_the_golden_file_covers_every_built_in_model() -> None:
    from hal.conformance.model_zoo import BUILTIN

    doc = model_golden.load(GOLDEN)
    assert set(doc["models"]) == set(BUILTIN) and doc["backend"] == "cpu" and doc["reference"] == "cpu_ref"
    for name, m in doc["models"].items():
        assert len(m["loss"]) == len(m["reference_loss"]) == doc["settings"]["steps"], name
        # the committed float32 curve is within 2e-7 of the float64 one: the gap RTOL is 500 times
        assert max(abs(a - b) / abs(b) for a, b in zip(m["loss"], m["reference_loss"])) < 2e-7 * 1.5, name


def test_fresh_cpu_runs_match_the_golden_curves(golden_runs: tuple[dict, list[ModelResult]]) -> None:
    doc, results = golden_runs
    assert [r.status for r in results] == ["pass"] * len(results), [r.summary_line for r in results]
    assert model_golden.compare(doc, results) == []


def test_a_curve_off_by_more_than_the_tolerance_or_other_settings_are_reported(golden_runs: tuple[dict, list[ModelResult]]) -> None:
    doc, results = golden_runs
    off = copy.deepcopy(doc)
    name = results[0].name
    off["models"][name]["loss"][-1] *= 1 + 3 * model_golden.RTOL
    problems = model_golden.compare(off, results)
    assert len(problems) == 1 and problems[0].startswith(f"{name}: loss step {len(results[0].test.losses) - 1}:"), problems  # type: ignore[union-attr]
    other = copy.deepcopy(doc)
    other["settings"]["lr"] = 2 * doc["settings"]["lr"]
    assert all("settings differ" in p for p in model_golden.compare(other, results))


def test_write_golden_then_golden_round_trips_on_the_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HAL_TUNE", "off")
    model = "tests.conformance.model_mode_models:tiny_mlp"
    args = ["--model", model, "--steps", "2", "--no-bisect", "--report-dir", str(tmp_path / "reports")]
    assert cli.main(args + ["--write-golden", str(tmp_path / "golden")]) == 0
    path = tmp_path / "golden" / model_golden.FILE
    assert cli.main(args + ["--golden", str(path)]) == 0
    doc = json.loads(path.read_text())
    doc["models"][model]["loss"][0] *= 1.01
    path.write_text(json.dumps(doc))
    assert cli.main(args + ["--golden", str(path)]) == 1
    assert cli.main(args + ["--golden", str(tmp_path / "missing.json")]) == 2
