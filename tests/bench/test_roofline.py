"""The roofline picture on CPU results: ``hal bench --out`` writes bench.png beside the JSON and the
Markdown, ``--render`` redraws both from a saved document, and every case is placed where the
picture says (counted intensity; the bytes-only and flops-only bands keep the gap under the roof
equal to the fraction of the ceiling); failed cases are listed as not placed. Pixels are not tested."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hal.cli import main
from hal_bench import roofline

PNG = b"\x89PNG\r\n\x1a\n"


def test_bench_out_writes_the_picture_beside_the_results(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert main(["bench", "--backend", "cpu_ref", "--ops", "conv2d,softmax,matmul", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "bench.md", "bench.png"]
    assert (out / "bench.png").read_bytes()[:8] == PNG
    doc = json.loads((out / "bench.json").read_text())
    placed = roofline.place(doc)
    assert [(p.op, p.kind) for p in placed.points] == [
        ("conv2d", "counted"), ("conv2d_backward", "counted"), ("softmax", "bytes only"), ("softmax_backward", "bytes only"),
        ("matmul", "flops only"), ("matmul_backward", "flops only")]
    assert placed.not_placed == []
    ceil = doc["ceilings"]
    assert (placed.bandwidth, placed.rate) == (ceil["copy_bytes_per_s"], ceil["matmul_flops_per_s"])
    for p, r in zip(placed.points, doc["results"]):
        seconds = r["hal_us"] * 1e-6
        if p.kind == "counted":
            assert p.x == pytest.approx(r["flops"] / r["bytes"]) and p.y == pytest.approx(r["flops"] / seconds)
        elif p.kind == "bytes only":  # the gap under the slanted roof is the fraction of copy bandwidth
            assert p.y / p.x == pytest.approx(r["bytes"] / seconds)
            assert p.fraction == pytest.approx(r["bw_fraction"])
        else:  # the gap under the flat roof is the fraction of the matrix rate
            assert p.y == pytest.approx(r["flops"] / seconds) and p.fraction == pytest.approx(r["rate_fraction"])
            assert p.x > placed.rate / placed.bandwidth
    counted = [p.x for p in placed.points if p.kind == "counted"]
    assert max(p.x for p in placed.points if p.kind == "bytes only") < min(counted)
    assert min(p.x for p in placed.points if p.kind == "flops only") > max(counted)

    capsys.readouterr()
    again = tmp_path / "again"
    assert main(["bench", "--render", str(out / "bench.json"), "--out", str(again), "--plot", str(tmp_path / "extra.png")]) == 0
    assert (again / "bench.md").read_text() == (out / "bench.md").read_text()
    assert json.loads((again / "bench.json").read_text()) == doc
    assert (again / "bench.png").read_bytes()[:8] == PNG and (tmp_path / "extra.png").read_bytes()[:8] == PNG


def test_failed_and_uncounted_cases_are_listed_not_dropped(tmp_path: Path) -> None:
    doc = {
        "ceilings": {"copy_bytes_per_s": 4e12, "matmul_flops_per_s": 700e12, "matmul_dtype": "bfloat16"},
        "results": [
            {"op": "softmax", "case": "big", "bytes": 4e8, "flops": 0, "hal_us": 100.0, "peers": {"peer:liger": {"us": 90.0, "ratio": 0.9}}},
            {"op": "matmul", "case": "8192^3", "bytes": 0, "flops": 1.1e12, "hal_us": 1600.0, "peers": {}},
            {"op": "conv2d", "case": "c", "bytes": 1e8, "flops": 1e11, "hal_us": 200.0, "peers": {"peer:liger": {"skipped": "why"}}},
            {"op": "batch_norm", "case": "oom", "bytes": 1e8, "flops": 0, "error": "setup: OutOfMemoryError"},
            {"op": "quantize", "case": "none", "bytes": 0, "flops": 0, "hal_us": 5.0},
        ],
    }
    placed = roofline.plot(doc, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:8] == PNG
    assert [p.index for p in placed.points] == [1, 2, 3]
    soft, mm, conv = placed.points
    assert soft.fraction == pytest.approx(4e8 / 100e-6 / 4e12) and soft.peer == "liger"
    assert soft.peer_y == pytest.approx(soft.y * 100 / 90)  # the same work in the peer's time
    assert mm.fraction == pytest.approx(1.1e12 / 1600e-6 / 700e12)
    assert conv.x == pytest.approx(1000.0) and conv.peer is None  # a peer that did not run draws nothing
    assert placed.not_placed == ["batch_norm, oom: setup: OutOfMemoryError", "quantize, none: neither bytes nor flops counted"]
    with pytest.raises(ValueError, match="no measured ceilings"):
        roofline.place({"results": []})
