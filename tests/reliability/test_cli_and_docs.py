"""The command line and the user documentation: piping into a reader that stops early, ``--version``,
a ``--quick`` conformance run beside a full report, bad input refused in one line with exit status
2, and documentation that is current and stays inside the repository."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


def test_hal_ops_stub_is_current_and_names_what_hal_ops_finds() -> None:
    """ops/__init__.pyi is what type checkers and IDEs read for hal.ops, whose names are found at run
    time (regenerate it with `python -m hal.cli.docs`): every name of ``__all__`` and every family."""
    import ast

    import hal.ops

    text = docs.STUB_PATH.read_text()
    assert text == docs.render_stub(), "ops/__init__.pyi is stale: run `python -m hal.cli.docs`"
    tree = ast.parse(text)
    imported = {a.asname for node in tree.body if isinstance(node, ast.ImportFrom) and node.level == 1 for a in node.names}
    families = {f.__name__.rsplit(".", 1)[1] for f in hal.ops.FAMILIES}
    assert imported == set(hal.ops.__all__) | families
    listed = next(node.value for node in tree.body if isinstance(node, ast.Assign) and node.targets[0].id == "__all__")
    assert ast.literal_eval(listed) == hal.ops.__all__


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


# --- bad input: one line saying what to do, exit status 2, never a traceback (issue 41 item 10) ------

#: module:callable steps for `hal tune`: a good one (make), one whose callable raises, and one that
#: waits to be interrupted once it has said so in the file `ready`
USER_STEPS = '''
import time

import torch


def make():
    x = torch.randn(64)
    return (lambda t: torch.softmax(t, 0)), (x,)


def raises():
    raise ValueError("the user's own error")


def slow():
    open("ready", "w").close()
    time.sleep(120)
'''

#: (id, arguments, text stderr must contain); {tmp} is a folder with the file `afile` and userstep.py,
#: also the working directory
BAD_INPUT = [
    # the cases
    ("report-dir-under-a-file", ["conformance", "--backend", "cpu_ref", "--ops", "softmax", "--quick", "--report-dir", "{tmp}/afile/sub"], "afile is a file, not a folder"),
    ("report-dir-in-proc", ["conformance", "--backend", "cpu_ref", "--ops", "softmax", "--quick", "--report-dir", "/proc/hal-report"], "--report-dir /proc/hal-report: cannot write there"),
    ("world-size-0", ["conformance", "--backend", "cpu_ref", "--ops", "softmax", "--quick", "--world-size", "0"], "argument --world-size: 0 is too small: give 1 or more"),
    ("tune-missing-module", ["tune", "no_such_module:make"], "cannot import module 'no_such_module'"),
    ("tune-not-a-step", ["tune", "os:getcwd"], "os:getcwd returned a value of type str; return a step"),
    ("tune-export-under-a-file", ["tune", "userstep:make", "--export", "{tmp}/afile/seed"], "--export {tmp}/afile/seed: cannot write there ({tmp}/afile is a file, not a folder)"),
    ("bench-unknown-op", ["bench", "--ops", "sofmax"], "unknown op 'sofmax' (did you mean 'softmax'?)"),
    ("info-unknown-option", ["info", "--bogus"], "usage: hal info [-h] [--json]\nhal info: error: unrecognized arguments: --bogus"),
    # found attacking the rest of the command line
    ("collectives-world-size-0", ["bench", "--collectives", "--world-size", "0"], "--world-size 0: give 1 or more"),
    ("collectives-endless-sizes", ["bench", "--collectives", "--step-factor", "1", "--min-bytes", "0"], "--min-bytes 0: give 1 or more; --step-factor 1.0: give a factor above 1"),
    ("bench-out-under-a-file", ["bench", "--ops", "softmax", "--out", "{tmp}/afile/out"], "--out {tmp}/afile/out: cannot write there"),
    ("bench-render-not-a-document", ["bench", "--render", "{tmp}/afile"], "not a hal bench result document"),
    ("bench-unknown-variant", ["bench", "--models", "llama_train", "--variants", "hal+compil"], "unknown variant 'hal+compil' (did you mean 'hal+compile'?)"),
    ("bench-unknown-max-batch-variant", ["bench", "--models", "llama_train", "--max-batch", "eagr"], "--max-batch: unknown variant 'eagr' (did you mean 'eager'?)"),
    ("model-report-dir-under-a-file", ["conformance", "--model", "cnn", "--report-dir", "{tmp}/afile/models"], "--report-dir {tmp}/afile/models: cannot write there"),
    ("model-not-a-model", ["conformance", "--model", "os:getcwd"], "hal conformance: --model os:getcwd: the callable returned str; return (model, batch)"),
    ("model-lr-nan", ["conformance", "--model", "cnn", "--lr", "nan"], "--lr nan: give a finite learning rate"),
    ("tune-unknown-context", ["tune", "--contexts", "eagr", "userstep:make"], "unknown context 'eagr' (did you mean 'eager'?)"),
    ("tune-step-raises", ["tune", "userstep:raises"], "userstep:raises raised ValueError: the user's own error"),
]


@pytest.mark.parametrize("argv,expected", [case[1:] for case in BAD_INPUT], ids=[case[0] for case in BAD_INPUT])
def test_bad_input_is_one_line_and_exit_status_2(tmp_path: Path, argv: list[str], expected: str) -> None:
    """Each bad input is refused before anything runs: exit status 2, stderr one line naming the
    problem (after the command's own usage where argparse refuses it), no traceback."""
    (tmp_path / "afile").write_text("[1, 2]")  # JSON, but no bench document
    (tmp_path / "userstep.py").write_text(USER_STEPS)
    argv = [a.format(tmp=tmp_path) for a in argv]
    out = _hal(*argv, cwd=tmp_path)
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr and expected.format(tmp=tmp_path) in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 or lines[0].startswith(f"usage: hal {argv[0]} "), out.stderr
    assert out.stdout == "", out.stdout  # nothing was measured or run


def test_an_unusable_backend_is_exit_status_2_in_every_command(tmp_path: Path) -> None:
    """A backend that is installed but not usable (its plugin disabled) stops conformance, bench and
    tune (through HAL_BACKEND) alike, with the reason."""
    (tmp_path / "userstep.py").write_text(USER_STEPS)
    env = os.environ | {"HAL_DISABLE_PLUGINS": "cpu_ref"}
    runs = {
        "conformance": _hal("conformance", "--backend", "cpu_ref", "--ops", "softmax", "--quick", cwd=tmp_path, env=env),
        "bench": _hal("bench", "--backend", "cpu_ref", "--ops", "softmax", cwd=tmp_path, env=env),
        "tune": _hal("tune", "userstep:make", cwd=tmp_path, env=env | {"HAL_BACKEND": "cpu_ref"}),
    }
    for command, out in runs.items():
        assert out.returncode == 2 and "Traceback" not in out.stderr, (command, out.stderr)
        assert "disabled by HAL_DISABLE_PLUGINS" in out.stderr, (command, out.stderr)


def test_ctrl_c_ends_a_command_with_130_and_one_line(tmp_path: Path) -> None:
    """SIGINT (Ctrl-C) in the middle of a command: status 130 and one line, no KeyboardInterrupt
    traceback."""
    (tmp_path / "userstep.py").write_text(USER_STEPS)
    # SIGINT back to its default in the child: a test run started in the background by a
    # non-interactive shell inherits SIGINT ignored, and Python then never raises KeyboardInterrupt
    proc = subprocess.Popen([sys.executable, "-m", "hal", "tune", "userstep:slow"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 240
    while not (tmp_path / "ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip() == "hal: interrupted", (proc.returncode, err)
