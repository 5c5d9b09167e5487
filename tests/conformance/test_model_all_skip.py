"""``hal conformance --model all`` on a machine without transformers (what scripts/quickstart.sh sets
up): hf_llama is skipped with its reason in every report, the other models run, and the exit
status is theirs. transformers is made unimportable for real (``sys.modules`` holding None is how
Python marks a module that must not import)."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from hal.cli import main


@pytest.fixture
def no_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)


def test_all_skips_the_model_whose_package_is_missing(no_transformers: None, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["conformance", "--model", "all", "--steps", "1", "--report-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert status == 0, err
    assert "hf_llama: skipped: needs transformers, which does not import here" in err and "pip install transformers" in err
    doc = json.loads((tmp_path / "model-report.json").read_text())
    assert doc["summary"] == {"pass": 2, "fail": 0, "error": 0, "skip": 1} and doc["exit_status"] == 0
    assert doc["backend"] == "cpu"  # the run's backend, from a model that ran
    models = {m["model"]: m for m in doc["models"]}
    assert [models[n]["status"] for n in ("cnn", "llama", "hf_llama")] == ["pass", "pass", "skip"]
    assert models["hf_llama"]["error"] is None and "needs transformers" in models["hf_llama"]["skip_reason"]
    md = (tmp_path / "model-report.md").read_text()
    assert "**PASSED** — 2 pass, 0 fail, 0 error, 1 skip" in md and "## `hf_llama` — SKIP" in md and "Skipped: needs transformers" in md
    junit = ET.parse(tmp_path / "model-junit.xml").getroot()
    assert junit.get("skipped") == "1" and junit.get("failures") == "0" and junit.get("errors") == "0"
    skipped = junit.findall(".//testcase[@name='hf_llama']/skipped")
    assert len(skipped) == 1 and "pip install transformers" in skipped[0].get("message", "")


def test_the_model_named_alone_is_still_an_error(no_transformers: None, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Asked for by name, a model that cannot run is not skipped: the run fails and says why."""
    status = main(["conformance", "--model", "hf_llama", "--steps", "1", "--report-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert status == 1
    assert "hf_llama: ERROR ValueError: model hf_llama needs transformers" in err and "pip install transformers" in err
    assert json.loads((tmp_path / "model-report.json").read_text())["summary"]["error"] == 1
