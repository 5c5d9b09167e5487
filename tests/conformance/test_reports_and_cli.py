"""Known failures (xfail, xpass, stale ids), the three report files, exit codes, the collectives
hook, and ``hal conformance --quick`` on cpu_ref end to end."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import types
import xml.etree.ElementTree as ET

import pytest
from hal.conformance.runner import RECORD_KEYS, STATUSES, Suite, run_collectives

import hal
from hal.cli import main as hal_main

from ._support import run_suite, softmax_backend

SCHEMA = {"hal_version", "commit", "backend", "backend_version", "device", "started", "duration_s", "results", "summary"}


def write_xfail(tmp_path, lines):
    path = tmp_path / "xfail.txt"
    path.write_text("# test list\n" + "\n".join(lines) + "\n")
    return str(path)


def cli(*args: str) -> tuple[int, str]:
    """Run ``hal conformance`` in this process (so test backends are visible); (rc, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = hal_main(["conformance", *args])
    return rc, err.getvalue()


def test_xfail_xpass_and_stale_ids(install, seed, tmp_path):
    install(softmax_backend())
    failing_id = "softmax[odd_bug,float32,odd_prime]"
    passing_id = "softmax[good,float32,odd_prime]"
    stale_id = "softmax[good,float32,no_such_case]"
    collective_id = "all_reduce[native,float32,sum-exact-1037-contiguous]"
    lines = [f"{failing_id}  known: odd rows", f"{passing_id}  thought broken", f"{stale_id}  renamed long ago", f"{collective_id}  gloo bug"]
    xfail = write_xfail(tmp_path, lines)
    suite = Suite("buggy", seed=seed, ops=["softmax"], dtypes=["float32"], xfail_file=xfail)
    results = {r.id: r for r in suite.run(suite.plan())}
    assert results[failing_id].status == "xfail" and results[failing_id].reason.startswith("known: odd rows (out: ")
    assert results[passing_id].status == "xpass" and "remove it" in results[passing_id].reason
    assert suite.stale_xfails() == [stale_id]  # collective ids are judged only against a collective run
    assert suite.stale_xfails([collective_id]) == [stale_id]
    assert suite.stale_xfails(["all_reduce[native,float32,other]"]) == [collective_id, stale_id]
    assert results["softmax[odd_bug,float32,first_dim]"].status == "fail"  # not listed: still a failure


def test_xfail_file_errors_name_the_line(tmp_path):
    from hal.conformance import xfail

    with pytest.raises(ValueError, match=r"x.txt:2: .*has no reason"):
        xfail.parse("# c\nsoftmax[a,float32,b]\n", "x.txt")
    with pytest.raises(ValueError, match=r"x.txt:1: 'softmax' is not a case id"):
        xfail.parse("softmax  why\n", "x.txt")


@pytest.mark.parametrize("option, what", [("--xfail", "xfail file"), ("--tolerances", "tolerance file")])
def test_a_folder_given_as_a_file_is_called_a_folder(tmp_path, option, what):
    """Before: a folder given with --xfail or --tolerances was said not to exist."""
    base = ["--backend", "cpu_ref", "--ops", "softmax", "--quick", "--list"]
    rc, err = cli(*base, option, str(tmp_path))
    assert rc == 2 and f"{what} {tmp_path} is a folder, not a file (given with {option})" in err, err
    rc, err = cli(*base, option, str(tmp_path / "missing.txt"))
    assert rc == 2 and f"{what} {tmp_path / 'missing.txt'} does not exist (given with {option})" in err, err


def test_reports_are_valid_and_failures_come_with_a_working_repro(install, seed, tmp_path):
    install(softmax_backend())
    rc, err = cli("--backend", "buggy", "--ops", "softmax", "--dtypes", "float32", "--seed", str(seed), "--report-dir", str(tmp_path))
    assert rc == 1, err
    doc = json.loads((tmp_path / "report.json").read_text())
    assert SCHEMA <= set(doc)
    assert doc["backend"] == "buggy" and doc["backend_version"] == "0.0.1" and doc["seed"] == seed
    assert doc["device"] == {"name": "test CPU", "vendor": "test vendor", "arch": "test arch"}
    assert doc["hal_version"] == hal.__version__ and doc["reference"] == "cpu_ref in float64"
    assert set(doc["summary"]) == set(STATUSES)
    statuses = [r["status"] for r in doc["results"]]
    assert {k: statuses.count(k) for k in STATUSES} == doc["summary"]
    assert doc["summary"]["fail"] > 0 and doc["summary"]["pass"] > 0 and doc["exit_status"] == 1
    for rec in doc["results"]:
        assert set(RECORD_KEYS) <= set(rec) and rec["status"] in STATUSES
        assert rec["id"] == f"{rec['op']}[{rec['kernel']},{rec['dtype']},{rec['case']}]"
        assert rec["atol"] is not None and rec["max_abs_err"] is not None
    failures = [r for r in doc["results"] if r["status"] == "fail"]
    assert all(r["kernel"] == "odd_bug" and r["reason"] and r["repro"] for r in failures)

    suite_el = ET.parse(tmp_path / "junit.xml").getroot().find("testsuite")
    cases = suite_el.findall("testcase")
    assert len(cases) == len(doc["results"]) == int(suite_el.get("tests"))
    failed = {c.get("name") for c in cases if c.find("failure") is not None}
    assert failed == {r["id"] for r in failures} and int(suite_el.get("failures")) == len(failed)

    md = (tmp_path / "report.md").read_text()
    assert md.index("## Failures") < md.index("## Results by op")
    table = md[md.index("## Results by op") :]
    assert table.index("| softmax | odd_bug |") < table.index("| softmax | good |")  # failing rows first
    snippet = md.split("```python\n", 1)[1].split("```", 1)[0]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(snippet, "<repro>", "exec"), {})
    assert out.getvalue().startswith(f"FAIL {failures[0]['id']}")


def test_exit_codes(install, seed, tmp_path):
    install(softmax_backend())
    base = ["--backend", "buggy", "--ops", "softmax", "--dtypes", "float32", "--seed", str(seed), "--report-dir", str(tmp_path)]
    assert cli(*base)[0] == 1  # odd_bug fails
    results = run_suite("buggy", seed, ["softmax"], ["float32"])
    known = [f"{i}  odd rows" for i, r in results.items() if r.status == "fail"]
    assert cli(*base, "--xfail", write_xfail(tmp_path, known))[0] == 0  # only expected failures left
    xpass = known + ["softmax[good,float32,odd_prime]  thought broken"]
    assert cli(*base, "--xfail", write_xfail(tmp_path, xpass))[0] == 0
    assert cli(*base, "--xfail", write_xfail(tmp_path, xpass), "--strict-xpass")[0] == 1
    rc, err = cli("--backend", "buggy", "--ops", "no_such_op")
    assert rc == 2 and "no op matches 'no_such_op'" in err
    rc, err = cli("--backend", "no_such_backend")
    assert rc == 2 and "not installed" in err


def test_list_prints_the_stable_case_ids(capsys):
    assert hal_main(["conformance", "--backend", "cpu_ref", "--ops", "conv2d", "--dtypes", "float16", "--list"]) == 0
    ids = capsys.readouterr().out.split()
    assert "conv2d[numpy,float16,resnet50_conv3x3_b1]" in ids and "conv2d[numpy,float16,groups4]" in ids
    assert len(ids) == len(set(ids))


def test_collectives_hook(install, seed, monkeypatch):
    install(softmax_backend())
    suite = Suite("buggy", seed=seed, ops=["softmax"], dtypes=["float32"])
    monkeypatch.setitem(sys.modules, "hal.conformance.collectives", None)  # as if not installed
    results, notes = run_collectives(suite, 4)
    assert [r.status for r in results] == ["error"] and "no collective case ran" in notes[0]

    calls = []

    def run(world_size, device, seed, quick):
        calls.append((world_size, device, seed, quick))
        good = {"op": "all_reduce", "kernel": "native", "dtype": "float32", "case": "sum_1k", "status": "pass", "max_abs_err": 0.0, "max_rel_err": 0.0, "atol": 1e-6, "rtol": 1e-5, "reason": None}
        return [good, {"op": "all_gather", "status": "pass"}]

    monkeypatch.setitem(sys.modules, "hal.conformance.collectives", types.SimpleNamespace(run=run))
    results, notes = run_collectives(suite, 4)
    assert calls == [(4, "cpu", seed, False)] and notes == []
    assert results[0].id == "all_reduce[native,float32,sum_1k]" and results[0].status == "pass"
    assert results[1].status == "error" and "malformed record" in results[1].reason


def test_quick_cpu_ref_end_to_end(tmp_path):
    """``hal conformance --quick`` in a fresh process: exit 0, and every (op, kernel, dtype) of
    cpu_ref ran at least one case and passed."""
    proc = subprocess.run(
        [sys.executable, "-m", "hal", "conformance", "--quick", "--backend", "cpu_ref", "--report-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["mode"] == "quick" and doc["poisoning"]["active"] and doc["summary"]["pass"] == len(doc["results"])
    covered = {(r["op"], r["kernel"], r["dtype"]) for r in doc["results"]}
    from hal.dispatch import DISPATCHER

    rt = DISPATCHER.runtime()
    want = set()
    for decl in hal.list_ops():
        kernels = [k.name for k in rt.kernels(decl.name, "cpu_ref")] + (["composite"] if decl.fallback_composite else [])
        want |= {(decl.name, k, t) for k in kernels for t in decl.dtypes}
    assert covered == want
    assert doc["duration_s"] < 60


def test_shards_keep_ops_whole_and_balance_case_counts():
    from hal.conformance.parallel import shard_ops
    from hal.conformance.runner import Planned

    plan = [Planned(op, "k", "float32", None, "x") for op, n in (("a", 9), ("b", 5), ("c", 4), ("d", 3), ("e", 1)) for _ in range(n)]
    shards = shard_ops(plan, 3)
    assert shards == [["a"], ["b", "e"], ["c", "d"]]  # largest first, each to the lightest: 9, 6, 7
    assert shard_ops(plan, 10) == [["a"], ["b"], ["c"], ["d"], ["e"]]  # never more workers than ops


def test_jobs_give_the_results_of_a_serial_run_in_plan_order(tmp_path, seed):
    ops = ["softmax*", "layer_norm", "matmul", "quantize"]
    proc = subprocess.run(
        [sys.executable, "-m", "hal", "conformance", "--quick", "--backend", "cpu_ref", "--seed", str(seed), "--ops", ",".join(ops), "--jobs", "3", "--report-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "3 processes" in proc.stderr
    doc = json.loads((tmp_path / "report.json").read_text())
    suite = Suite("cpu_ref", seed=seed, quick=True, ops=ops)
    serial = [r.record() for r in suite.run(suite.plan())]
    fields = ("id", "status", "max_abs_err", "max_rel_err", "atol", "rtol")
    assert [[r[f] for f in fields] for r in doc["results"]] == [[r[f] for f in fields] for r in serial]
    assert len(serial) > 20 and {r["op"] for r in serial} == {"softmax", "softmax_backward", "layer_norm", "matmul", "quantize"}


def test_a_worker_that_dies_turns_its_cases_into_errors(seed, tmp_path):
    from hal.conformance.parallel import SETTINGS, run_parallel

    suite = Suite("cpu_ref", seed=seed, quick=True, ops=["softmax", "matmul"])
    plan = suite.plan()
    settings = {k: getattr(suite, k, None) for k in SETTINGS} | {"device": 0, "poison": True, "xfail_file": None}
    settings["tolerance_file"] = str(tmp_path / "missing.txt")  # the workers' Suite raises on it
    seen = []
    results = run_parallel(suite, settings, plan, 2, progress=seen.append)
    assert [r.id for r in results] == [p.id for p in plan] and len(seen) == len(plan)
    assert all(r.status == "error" and "exited with status 1" in r.reason and "missing.txt" in r.reason for r in results)


def test_a_commit_given_in_the_environment_wins_over_git(monkeypatch):
    """A device machine's copy of the tree may carry the .git of another commit: HAL_COMMIT wins."""
    from hal_bench.runner import environment
    from hal.conformance.report import git_commit

    import torch

    head, _ = git_commit()
    told = "0123456789abcdef0123456789abcdef01234567"
    assert head != told
    monkeypatch.setenv("HAL_COMMIT", told)
    monkeypatch.setenv("HAL_DIRTY", "0")
    assert git_commit() == (told, False)
    env = environment(torch.device("cpu"))
    assert (env["commit"], env["dirty"]) == (told, False)
    monkeypatch.setenv("HAL_DIRTY", "1")
    assert git_commit() == (told, True)
