"""The interpreter run of tests/cuda/interpreted starts as soon as collection ends, in a subprocess
beside the rest of the session (it takes about a minute on a CI machine, as do the ahead-of-time
compilations): test_interpreter.py waits for it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[2]
INTERPRETER_TEST = "test_triton_kernels_in_the_interpreter_match_cpu_ref"
_run: Optional[subprocess.Popen] = None


def start_interpreter_run() -> subprocess.Popen:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT), str(ROOT / "tests/cuda/interpreted")]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    global _run
    if os.environ.get("TRITON_INTERPRET") != "1" and any(item.name == INTERPRETER_TEST for item in items):
        _run = start_interpreter_run()


@pytest.fixture
def interpreter_run() -> subprocess.Popen:
    """The subprocess running the interpreted tests (started now if collection did not)."""
    global _run
    if _run is None:
        _run = start_interpreter_run()
    return _run
