"""What ``pip install .`` ships: the core distribution and every backend's, built for real (the core as
an sdist and a wheel built from that sdist, as ``python -m build`` does) and compared file by file
with the checkout. An editable install (what the tests run on) hides a package missing from a wheel;
scripts/check_install.sh then installs and runs what is built here."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ("eager", "cpu_ref", "cpu", "cuda", "rocm")
#: tracked files under the core's source folders that are not for users' machines
NOT_SHIPPED = ("conformance/reports/", "conformance/README.md", "kits/cpp/NOTES.md")


def _setup_py() -> ModuleType:
    """setup.py loaded as a module (its setup() call only runs as a script)."""
    spec = importlib.util.spec_from_file_location("hal_setup", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tracked(folder: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", folder], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if (ROOT / line).is_file()]  # a file deleted but not yet committed is gone


def _head() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def _build(source: Path, out: Path, *kinds: str) -> None:
    done = subprocess.run([sys.executable, "-m", "build", "--no-isolation", *kinds, "--outdir", str(out), str(source)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _wheel_files(out: Path, dist: str) -> set[str]:
    (wheel,) = out.glob(f"{dist}-*.whl")
    return {n for n in zipfile.ZipFile(wheel).namelist() if ".dist-info/" not in n}


def test_the_core_wheel_ships_every_package_and_data_file_with_the_commit(tmp_path: Path) -> None:
    before = _head()
    _build(ROOT, tmp_path)  # the sdist, then the wheel built from the unpacked sdist
    after = _head()  # others may commit in this checkout meanwhile
    (wheel,) = tmp_path.glob("hal-*.whl")
    files = _wheel_files(tmp_path, "hal")
    expected, present = set(), set()
    for package, folder in _setup_py().ROOTS.items():
        installed = package.replace(".", "/")
        expected |= {installed + path[len(folder):] for path in _tracked(folder) if not path.startswith(NOT_SHIPPED)}
        present |= {installed + "/" + str(p.relative_to(ROOT / folder)) for p in (ROOT / folder).rglob("*") if p.is_file()}
    missing = sorted(expected - files)
    assert not missing, f"tracked files the wheel leaves out: {missing}"
    stamp = "hal/_build_stamp.py"
    assert not sorted(files - present - {stamp}), "the wheel ships files from outside its source folders"
    for module in ("hal/fast/__init__.py", "hal/parallel/__init__.py", "hal/fp8/__init__.py", "hal/ops/__init__.py",
                   "hal/conformance/golden/cpu/loss_curves.json", "hal_cpp/kernels/adamw.cu", "hal_bench/__init__.py"):
        assert module in files
    namespace: dict[str, object] = {}
    exec(zipfile.ZipFile(wheel).read(stamp).decode(), namespace)
    assert namespace["COMMIT"] in {before, after} and isinstance(namespace["DIRTY"], bool)
    assert not (ROOT / "hal" / "_build_stamp.py").exists(), "the build wrote its stamp into the checkout"


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_backend_wheel_ships_its_whole_package(backend: str, tmp_path: Path) -> None:
    _build(ROOT / "backends" / backend, tmp_path, "--wheel")
    files = _wheel_files(tmp_path, f"hal_backend_{backend}")
    prefix = f"backends/{backend}/"
    expected = {p[len(prefix):] for p in _tracked(f"{prefix}hal_backend_{backend}")}
    assert files == expected


def test_checkout_commit_answers_only_for_the_top_of_a_checkout() -> None:
    """A venv inside some checkout (site-packages/hal is in its tree) must not report that checkout's
    commit as the installed hal's: only the folder at the top of a checkout has a commit."""
    from hal.version import checkout_commit

    before = _head()
    commit, dirty = checkout_commit(ROOT)
    assert commit in {before, _head()} and isinstance(dirty, bool)
    assert checkout_commit(ROOT / "hal") == (None, None)
