"""benchmarks/attacks41.py --quick (issue 41's attack classes, a fast subset of each) finds no
silent wrong result, no raw exception and no crash."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(300)


def test_the_quick_attack_sweep_is_clean(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attacks41.py"), "--quick", "--json", str(tmp_path / "a.json")],
                         capture_output=True, text=True, timeout=280, cwd=ROOT)
    report = json.loads((tmp_path / "a.json").read_text())
    bad = [r for r in report["results"] if r["status"] in ("silent", "raw", "crash")]
    assert report["results"] and not bad, "\n".join(f"{r['status']} {r['id']}: {r['detail']}" for r in bad) + out.stdout[-2000:]
