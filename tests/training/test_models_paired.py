"""The side-by-side timing of ``hal bench --models`` (hal_bench.models_paired): the judged pairs are
rebuilt after the sweep and timed in alternating rounds, and the targets take those ratios."""

from __future__ import annotations

import statistics
import time

import pytest
import torch
from torch import nn

from hal_bench import models, models_report
from hal_bench.models_paired import judged_pairs, time_side_by_side
from hal_bench.timing import Timer
from hal_bench.workload import Step

CPU = torch.device("cpu")


def _sleeper(seconds: float) -> Step:
    """A step whose cost is known: it sleeps ``seconds`` (the host clock times it on the CPU)."""
    def run() -> torch.Tensor:
        time.sleep(seconds)
        return torch.zeros(())
    return Step(run, nn.Identity())


def _row(times_ms: dict[str, float]) -> dict:
    row = {"model": "m", "variants": [{"variant": n, "impl": "hal" if n.startswith("hal") else "torch", "step_us": t * 1e3}
                                      for n, t in times_ms.items()]}
    models.add_ratios(row)
    return row


def test_rounds_alternate_and_the_ratio_is_the_rounds_median() -> None:
    """Two steps of known cost (4 ms and 2 ms of sleep) built by name, timed in alternating rounds:
    every round times both, each variant is built once and warmed up, the ratio is the median of the
    rounds' ratios and lies near 2, whatever the sweep had measured."""
    costs = {"compile": 0.004, "hal+compile": 0.002}
    built: list[str] = []

    def build(name: str) -> Step:
        built.append(name)
        return _sleeper(costs[name])

    row = _row({"eager": 9.0, "compile": 1.0, "hal+compile": 3.0, "hal": 8.0})  # the sweep's drifted figures
    assert judged_pairs(row) == [("compile", "hal+compile")]  # the best pair is the same pair: timed once
    rec = time_side_by_side(judged_pairs(row), build, Timer(CPU, budget_s=0.02, min_reps=3), lambda: None, rounds=3)
    assert built == ["compile", "hal+compile"]
    assert rec["rounds"] == 3 and all(len(t) == 3 for t in rec["times_us"].values())
    (pair,) = rec["pairs"]
    ratios = [a / b for a, b in zip(rec["times_us"]["compile"], rec["times_us"]["hal+compile"])]
    assert pair["ratio"] == statistics.median(ratios) and pair["ratio_range"] == [min(ratios), max(ratios)]
    assert pair["peer_us"] == statistics.median(rec["times_us"]["compile"])
    assert 1.6 < pair["ratio"] < 2.4, pair


def test_best_pair_joins_and_a_failed_rebuild_leaves_the_sweep() -> None:
    """The best peer against the best hal step is the second pair where it differs; a variant that
    cannot be rebuilt gives an error record, not an exception, and the targets keep the sweep's ratio."""
    row = _row({"eager": 9.0, "compile": 5.0, "compile+graph": 3.0, "hal+compile": 6.0, "hal+graph": 2.0})
    assert judged_pairs(row) == [("compile", "hal+compile"), ("compile+graph", "hal+graph")]

    def build(name: str) -> Step:
        if name == "hal+graph":
            raise RuntimeError("no capture here\nsecond line")
        return _sleeper(0.0)

    row["paired"] = time_side_by_side(judged_pairs(row), build, Timer(CPU, budget_s=0.01), lambda: None, rounds=2)
    assert row["paired"] == {"error": "RuntimeError: no capture here"}
    targets = {t["target"]: t for t in models_report.judge(row, gpu=True)}
    assert targets["hal+compile vs torch.compile"]["value"] == pytest.approx(5.0 / 6.0)
    assert not targets["hal+compile vs torch.compile"]["side_by_side"]
    assert "error (RuntimeError: no capture here)" in "\n".join(models_report.paired_lines({"models": [row]}))


def test_harness_judges_the_compiled_pair_side_by_side(seed: int) -> None:
    """A real run, torch.compile and hal under torch.compile on the tiny Llama step: the pair is rebuilt
    and timed in rounds, its target takes the side-by-side ratio, and the table shows both ratios."""
    doc = models.run(CPU, ["llama_train"], "tiny", use_compile=True, variants=["compile", "hal+compile"], seed=seed % 1000,
                     steps=2, budget_s=0.01, paired_rounds=3)
    (row,) = doc["models"]
    paired = row["paired"]
    assert "error" not in paired, paired
    (pair,) = paired["pairs"]
    assert (pair["peer"], pair["hal"]) == ("compile", "hal+compile") and pair["ratio"] > 0
    assert all(len(t) == 3 and min(t) > 0 for t in paired["times_us"].values())
    targets = {t["target"]: t for t in row["targets"]}
    assert targets["hal+compile vs torch.compile"]["value"] == pair["ratio"]
    assert targets["hal+compile vs torch.compile"]["side_by_side"]
    md = models_report.to_markdown(doc)
    assert "## Side by side" in md and "| llama_train | compile | hal+compile |" in md
    no_pairs = models.run(CPU, ["llama_train"], "tiny", use_compile=False, variants=["hal"], steps=2, budget_s=0.01)
    assert "paired" not in no_pairs["models"][0]  # nothing to compare: no side-by-side timing
