"""The command line and the user documentation: piping into a reader that stops early, ``--version``,
a ``--quick`` conformance run beside a full report, and documentation that is current and stays
inside the repository."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import hal
from hal.cli import docs

ROOT = Path(__file__).resolve().parents[2]


def _hal(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hal", *args], capture_output=True, text=True, timeout=300, **kw)


def test_info_json_into_a_reader_that_stops_early_ends_quietly() -> None:
    """``hal info --json | head``: the reader is gone before hal writes (hal takes seconds to start,
    the reader none to close); hal ends with 141 (SIGPIPE's status) and no traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "hal", "info", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_version_everywhere_agrees() -> None:
    out = _hal("--version")
    assert out.returncode == 0 and out.stdout.split()[:2] == ["hal", hal.__version__]
    assert importlib.metadata.version("hal") == hal.__version__


def test_quick_run_does_not_replace_a_full_report(tmp_path: Path) -> None:
    """A full run's report in --report-dir stops a --quick run (exit 2, naming --report-dir, the
    report untouched); in another folder the quick run goes ahead."""
    full = tmp_path / "full"
    common = ("conformance", "--backend", "cpu_ref", "--ops", "softmax_backward", "--dtypes", "float32")
    assert _hal(*common, "--report-dir", str(full)).returncode == 0
    before = (full / "report.json").read_text()
    assert json.loads(before)["mode"] == "full"
    refused = _hal(*common, "--quick", "--report-dir", str(full))
    assert refused.returncode == 2 and "--report-dir" in refused.stderr and "full run" in refused.stderr, refused.stderr
    assert (full / "report.json").read_text() == before
    elsewhere = _hal(*common, "--quick", "--report-dir", str(tmp_path / "quick"))
    assert elsewhere.returncode == 0 and json.loads((tmp_path / "quick" / "report.json").read_text())["mode"] == "quick"


def test_op_reference_is_current() -> None:
    """docs/ops.md is what the declarations generate (regenerate with `python -m hal.cli.docs`)."""
    assert docs.DEFAULT_PATH.read_text() == docs.render(), "docs/ops.md is stale: run `python -m hal.cli.docs`"


def test_op_reference_covers_every_op() -> None:
    text = docs.DEFAULT_PATH.read_text()
    for decl in hal.list_ops():
        assert f"### {decl.name}\n" in text and f"hal.ops.{decl.name}{decl.signature}" in text


def test_documentation_links_stay_inside_the_repository() -> None:
    """Every relative link of the README and docs/ names a file of this checkout (a clone carries
    its documentation; nothing points at ../shared or other places outside it)."""
    link = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "conformance" / "README.md"]:
        for target in link.findall(page.read_text()):
            if re.match(r"^[a-z]+:", target):
                continue  # a URL
            resolved = (page.parent / target).resolve()
            assert resolved.is_relative_to(ROOT), f"{page.name} links outside the repository: {target}"
            assert resolved.exists(), f"{page.name} links to a missing file: {target}"
