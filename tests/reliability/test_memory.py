"""Work and memory far beyond the arguments' size, property-based, under an address-space limit.

``memory_worker.py`` runs in a subprocess whose address space is capped at what it holds after
start-up plus 2 GiB, and draws convolutions with huge padding, dilation and stride, int8_linear and
softmax on expanded views, matmul gradients over broadcast batches and attention over long
sequences of few features. Every call must return torch's result or raise a ``hal.HalError``
(cpu_ref computes within memory proportional to inputs and outputs, and declines, before
allocating, what cannot fit); the issue's examples (1x1 convolutions whose padded input would take
hundreds of GiB) must compute.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import draw_seed

from .calls import COUNTS

ROOT = Path(__file__).resolve().parents[2]
HEADROOM_MIB = 2048
EXAMPLES = 40


@pytest.mark.parametrize("fixed", [False, True], ids=["fresh seed", "seed 134934166"])
def test_calls_far_beyond_their_arguments_compute_or_raise_hal_errors(fixed: bool) -> None:
    """A fresh seed each run, and the seed that found softmax of a (1, 8192) row expanded to 15730
    rows raising torch's raw allocation error: its 0.5 GiB of results fit, the dense copy torch
    makes of the expanded input besides did not (hal.dispatch.memory counts that copy now)."""
    seed = 134934166 if fixed else draw_seed()
    proc = subprocess.run(
        [sys.executable, "-m", "tests.reliability.memory_worker", str(HEADROOM_MIB), str(EXAMPLES), str(seed)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    COUNTS["result"] += report["results"]
    COUNTS["hal_error"] += report["hal_errors"]
    COUNTS["raw"] += len(report["raw"])
    assert report["limit_active"], "RLIMIT_AS did not take effect: the test would prove nothing"
    assert not report["raw"], f"seed {seed}: " + "\n".join(report["raw"])
    assert not report["mismatches"], f"seed {seed}: " + "\n".join(report["mismatches"])
    assert report["issue_examples"] == {"results": 6, "hal_errors": 2}, report["issue_examples"]
    assert report["compared"] >= report["calls"] // 4, report  # most results were checked against torch
