"""``pytest --hal-backend NAME``: the conformance cases as tests named by their report ids, with
failures, known failures (XFAIL / XPASS) and skips mapped onto pytest's outcomes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: A conftest installing the test backend of _support.py beside cpu_ref in the pytest subprocess.
CONFTEST = """
import hal_backend_cpu_ref
from hal import dispatch
from hal.runtime import Runtime
from tests.conformance._support import softmax_backend


def pytest_configure(config):
    dispatch.install(Runtime.from_plugins([hal_backend_cpu_ref.plugin, softmax_backend()]))
"""


def pytest_run(cwd, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_failures_xfail_and_xpass_map_onto_pytest_outcomes(tmp_path, seed):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    xfail = tmp_path / "xfail.txt"
    xfail.write_text("softmax[odd_bug,float32,odd_prime]  known\nsoftmax[good,float32,odd_prime]  thought broken\n")
    args = ["--hal-backend", "buggy", "--hal-ops", "softmax", "--hal-dtypes", "float32", "--hal-seed", str(seed), "--hal-xfail", str(xfail)]
    proc = pytest_run(tmp_path, *args)
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:]
    assert "XFAIL hal-conformance[buggy]::softmax[odd_bug,float32,odd_prime]" in out
    assert "XPASS hal-conformance[buggy]::softmax[good,float32,odd_prime]" in out
    assert "FAILED hal-conformance[buggy]::softmax[odd_bug,float32,first_dim]" in out
    assert "PASSED hal-conformance[buggy]::softmax[good,float32,first_dim]" in out  # ids are the report ids
    assert "reproduce with:" in out and "from hal.conformance import case_inputs, reproduce" in out
    assert "beyond tolerance" in out

