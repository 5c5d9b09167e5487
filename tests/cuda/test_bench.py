"""hal bench on the CPU (cpu_ref): the command runs quickly, its JSON holds a timed result per case
with ratios against eager PyTorch, and the Markdown report renders it; targets are judged."""

from __future__ import annotations

import json

import pytest

from hal.cli import main
from hal_bench import report, runner
from hal_bench.cases import all_cases, canonical, skewed_sizes


def test_every_op_has_a_case_on_both_devices() -> None:
    import hal

    ops = {d.name for d in hal.list_ops()}
    for gpu in (False, True):
        assert {c.op for c in all_cases(gpu)} == ops


def test_cli_json_on_cpu_ref(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--backend", "cpu_ref", "--ops", "softmax,layer_norm,dispatch", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["device"]["type"] == "cpu" and doc["ceilings"]["copy_bytes_per_s"] > 0
    ops = [r["op"] for r in doc["results"]]
    assert ops == ["layer_norm", "layer_norm_backward", "softmax", "softmax_backward"]
    for r in doc["results"]:
        assert "error" not in r, r
        assert r["kernel"] == "cpu_ref/numpy" and r["hal_us"] > 0
        assert r["peers"]["eager"]["us"] > 0
        assert r["peers"]["eager"]["ratio"] == pytest.approx(r["peers"]["eager"]["us"] / r["hal_us"])
    assert doc["dispatch_overhead"]["hal_call_us"] > doc["dispatch_overhead"]["direct_call_us"] > 0
    md = report.to_markdown(doc)
    assert "| softmax_backward |" in md and "Dispatch overhead" in md


def test_targets_are_judged() -> None:
    rec = {"hal_us": 100.0, "bw_fraction": 0.8, "peers": {"eager": {"us": 250.0, "ratio": 2.5}, "peer:a": {"us": 90.0, "ratio": 0.9}, "peer:b": {"us": 120.0, "ratio": 1.2}}}
    got = {t["target"]: (t["value"], t["met"]) for t in runner.judge({"eager": 2.0, "bw": 0.85, "best_peer": 0.95, "compile": 1.0}, rec)}
    assert got["eager"] == (2.5, True)
    assert got["bw"] == (0.8, False)
    assert got["best_peer"] == (pytest.approx(0.9), False)
    assert got["compile"] == (None, None)


def test_canonical_arguments_and_skewed_sizes() -> None:
    import torch

    x = torch.randn(2, 3, 8, 8)
    w = torch.randn(4, 3, 3, 3)
    canon = canonical("conv2d", (x, w), {"padding": "same"})
    assert canon[3:] == ((1, 1), (1, 1, 1, 1), (1, 1), 1)
    sizes = skewed_sizes(16, 1000, torch.Generator().manual_seed(0))
    assert sum(sizes) == 1000 and max(sizes) > 2 * min(sizes)
