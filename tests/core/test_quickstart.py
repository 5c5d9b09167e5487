"""scripts/quickstart.sh --quick after a full run (what the README suggests): the quick run writes its
own reports, hal-conformance/quick/, and leaves the full run's in hal-conformance/ (it exited 2,
refusing to replace them). The script runs for real on a copy of itself, with this venv (HAL_VENV)
and its set-up step stood in by a no-op, since the venv is set up already."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _quickstart(tree: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAL_")}
    env["HAL_VENV"] = str(Path(sys.executable).parent.parent)
    return subprocess.run([str(tree / "scripts" / "quickstart.sh"), *args], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=300)


def test_quick_after_a_full_run_writes_its_own_reports(tmp_path: Path) -> None:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "quickstart.sh", tmp_path / "scripts")
    (tmp_path / "scripts" / "setup.sh").write_text("#!/usr/bin/env bash\n")
    (tmp_path / "scripts" / "setup.sh").chmod(0o755)
    cases = ("--ops", "softmax", "--dtypes", "float32")
    full = _quickstart(tmp_path, *cases)
    assert full.returncode == 0, full.stdout[-2000:] + full.stderr[-2000:]
    quick = _quickstart(tmp_path, "--quick", *cases)
    assert quick.returncode == 0, quick.stdout[-2000:] + quick.stderr[-2000:]
    assert "a --quick run writes its reports to hal-conformance/quick/" in quick.stdout
    assert json.loads((tmp_path / "hal-conformance" / "report.json").read_text())["mode"] == "full"
    assert json.loads((tmp_path / "hal-conformance" / "quick" / "report.json").read_text())["mode"] == "quick"
    # a folder of the user's own is used as given
    own = _quickstart(tmp_path, "--quick", "--report-dir", "mine", *cases)
    assert own.returncode == 0 and "hal-conformance/quick" not in own.stdout
    assert json.loads((tmp_path / "mine" / "report.json").read_text())["mode"] == "quick"
