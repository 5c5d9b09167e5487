"""hal bench's named peers and targets on the CPU: Liger-Kernel's peer is in every row that has one,
with the reason it cannot run here (not installed in CI; a GPU is needed where it is installed),
quack-kernels' published figures sit beside the GPU rows marked as not measured, the targets of
issue 13 are on their rows and judge synthetic records correctly, and a peer that overwrites its
inputs is restored before every timed run."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from hal.cli import main
from hal_bench import liger, report, runner
from hal_bench.cases import all_cases, canonical
from hal_bench.peer import Peer
from hal_bench.timing import Timer

LIGER_OPS = {"rms_norm", "layer_norm", "softmax", "swiglu", "rotary_embedding", "cross_entropy", "linear_cross_entropy"}


def _expected_reason() -> str:
    if importlib.util.find_spec("liger_kernel") is None:
        return "Liger-Kernel not installed"
    return "Liger-Kernel's Triton kernels need a GPU (this run is on cpu)"


def test_liger_peer_says_why_it_did_not_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--backend", "cpu_ref", "--ops", "rms_norm,swiglu,cross_entropy", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = [(r["op"], r["case"]) for r in doc["results"]]
    assert rows == [("rms_norm", "(256, 512)"), ("rms_norm_backward", "(256, 512)"), ("swiglu", "(256, 512)"), ("swiglu_backward", "(256, 512)"),
                    ("cross_entropy", "(64, 500), mean"), ("cross_entropy_backward", "(64, 500), mean"),
                    ("cross_entropy", "train fwd+bwd (64, 500), mean")]
    for r in doc["results"]:
        assert "error" not in r, r
        assert r["peers"]["peer:liger"] == {"skipped": _expected_reason()}
        assert r["peers"]["eager"]["us"] > 0 and r["wall_s"] > 0
    assert doc["liger"] == liger.version()
    md = report.to_markdown(doc)
    assert md.count(f"liger: {_expected_reason()}") == len(rows)
    assert f"Liger-Kernel {liger.version() or 'not installed'}" in md


def test_every_liger_op_has_the_peer_in_each_of_its_rows() -> None:
    """Built on CPU inputs: the forward, backward and training rows of each op get a peer (a reason
    here), and no other op does."""
    with_peer = []
    for case in all_cases(False):
        setup = case.setup(torch.device("cpu"))
        base = case.op.removesuffix("_backward")
        if base in LIGER_OPS:
            peer = setup.peers["liger"]
            assert isinstance(peer, Peer) and peer.run is None and peer.reason == _expected_reason(), case.name
            with_peer.append(case.op)
        else:
            assert "liger" not in setup.peers, case.op
    assert sorted(with_peer) == sorted(list(LIGER_OPS) + [f"{op}_backward" for op in LIGER_OPS]
                                       + ["cross_entropy", "linear_cross_entropy"])  # forward, backward, and the two training rows


def test_reasons_of_a_peer_that_cannot_run() -> None:
    x = torch.randn(6, 10)
    assert liger.peer("matmul", "forward", (x, x)).reason == "Liger-Kernel has no kernel for matmul"
    if importlib.util.find_spec("liger_kernel") is None:
        assert liger.peer("softmax", "forward", canonical("softmax", (x, 0), {})).reason == "Liger-Kernel not installed"
    else:  # the device is checked before the options
        assert "need a GPU" in (liger.peer("softmax", "forward", canonical("softmax", (x, 0), {})).reason or "")
    with pytest.raises(ValueError, match="either a run callable or a reason"):
        Peer()


def test_issue_13_targets_are_on_their_gpu_rows() -> None:
    by = {(c.op, c.name.startswith("train fwd+bwd")): c for c in all_cases(True)}
    for op in ("rms_norm", "softmax", "rotary_embedding", "swiglu"):
        for name in (op, f"{op}_backward"):
            assert by[(name, False)].targets["best_peer"] == 1.0 and by[(name, False)].targets["bw"] == 0.9, name
    assert by[("cross_entropy", False)].targets == {"bw": 0.9, "best_peer": 1.0}
    assert by[("cross_entropy_backward", False)].targets == {"bw": 0.9}  # Liger's gradient is in its forward pass
    assert by[("cross_entropy", True)].targets == {"best_peer": 1.0}
    assert by[("layer_norm_backward", False)].targets == {"bw": 0.9, "compile": 1.0}
    assert by[("batch_norm", False)].targets == {"eager": 1.0, "bw": 0.8}
    quack = [p for c in all_cases(True) for p in c.published]
    assert {p.figure for p in quack if p.figure} == {"2.90 TB/s = 87% of the H100's bandwidth", "2.89 TB/s = 86% of the H100's bandwidth",
                                                     "3.02 TB/s = 90% of the H100's bandwidth"}
    assert all(p.peer == "quack-kernels" and p.source.startswith("https://github.com/Dao-AILab/quack/") for p in quack)
    assert not any(c.published for c in all_cases(False))  # H100 figures are not put beside CPU rows


def test_targets_judge_synthetic_rows() -> None:
    skipped = {"skipped": "Liger-Kernel not installed"}
    rec = {"hal_us": 100.0, "bw_fraction": 0.93, "peers": {"eager": {"us": 300.0, "ratio": 3.0}, "compile": {"error": "boom"}, "peer:liger": skipped}}
    got = {t["target"]: t for t in runner.judge({"bw": 0.9, "best_peer": 1.0, "compile": 1.0, "peer:liger": 1.0}, rec)}
    assert (got["bw"]["value"], got["bw"]["met"]) == (0.93, True) and "reason" not in got["bw"]
    assert got["best_peer"]["met"] is None and got["best_peer"]["reason"] == "liger: Liger-Kernel not installed"
    assert got["compile"]["met"] is None and got["compile"]["reason"] == "compile: boom"
    assert got["peer:liger"]["reason"] == "liger: Liger-Kernel not installed"
    # measured: the fastest named peer decides, eager and compile do not count as named peers
    rec["peers"] |= {"peer:liger": {"us": 95.0, "ratio": 0.95}, "peer:cudnn": {"us": 130.0, "ratio": 1.3}, "compile": {"us": 50.0, "ratio": 0.5}}
    got = {t["target"]: t for t in runner.judge({"best_peer": 1.0, "bw": 0.95}, rec)}
    assert got["best_peer"]["value"] == pytest.approx(0.95) and got["best_peer"]["met"] is False and "reason" not in got["best_peer"]
    assert got["bw"]["met"] is False
    rec["peers"]["peer:liger"] = {"us": 100.0, "ratio": 1.0}
    assert runner.judge({"best_peer": 1.0}, rec)[0]["met"] is True  # equal speed meets >= 1.0x
    md = report.to_markdown({"results": [{"op": "softmax", "case": "c", "dtype": "bfloat16", **rec, "targets": runner.judge({"best_peer": 1.0}, rec)}]})
    assert "| softmax | c | best_peer | ≥ 1.00× | 1.00× | met |" in md


def test_published_figures_are_shown_as_not_measured() -> None:
    case = next(c for c in all_cases(True) if c.op == "rms_norm")
    rec = {"op": case.op, "case": case.name, "dtype": case.dtype, "hal_us": 140.0, "peers": {"peer:liger": {"skipped": "Liger-Kernel not installed"}},
           "published": [p.__dict__ for p in case.published]}
    md = report.to_markdown({"results": [rec]})
    assert "liger: Liger-Kernel not installed; quack-kernels: published, not measured here (below)" in md
    assert "## Published figures (published, not measured here)" in md
    assert "| rms_norm | (32768, 4096) | quack-kernels | 2.90 TB/s = 87% of the H100's bandwidth |" in md
    assert case.published[0].source in md


def test_a_peer_that_overwrites_its_input_is_restored_before_each_timed_run() -> None:
    pristine = torch.randn(64)
    buf = pristine.clone()
    seen: list[bool] = []
    restores: list[int] = []

    def run() -> None:  # reads its input, then overwrites it (as Liger's SwiGLU backward does)
        seen.append(torch.equal(buf, pristine))
        buf.mul_(0.5)

    def restore() -> None:
        restores.append(1)
        buf.copy_(pristine)

    timing = Timer(torch.device("cpu"), budget_s=0.01, min_reps=4)(run, before=restore)
    assert timing["reps"] >= 4 and timing["median_us"] > 0
    assert len(seen) == len(restores) == timing["reps"] + 2  # two warm-up runs, each restored too
    assert all(seen)
    rec = runner._time_peer(Timer(torch.device("cpu"), budget_s=0.01), Peer(run=run, restore=restore), 1.0)
    assert rec["per_run"] is True and rec["ratio"] == pytest.approx(rec["us"])
    assert runner._time_peer(Timer(torch.device("cpu")), Peer(reason="why"), 1.0) == {"skipped": "why"}
