"""The ROCm plugin as a user installs it: ``python -m build backends/rocm`` makes a wheel, pip
installs it into a fresh virtual environment (resolving its dependencies), and there ``import hal``,
``hal info`` and ``hal conformance --backend rocm`` report it unavailable with its reasons; the
conformance run exits non-zero with one line and no traceback.

As in tests/core/test_plugin_packaging.py, the venv sees this environment's packages (torch, hal,
the other backends, triton, hip-python) through a .pth file, except this environment's own editable
copy of the ROCm plugin: the venv gets its plugin from the wheel only.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOT_ROCM = "torch is not a ROCm build: install torch from the ROCm wheel index"


def _visible_parent(folder: Path) -> Path:
    """A site folder with links to this environment's packages, the ROCm plugin left out."""
    folder.mkdir()
    for parent in (p for p in site.getsitepackages() if os.path.isdir(p)):
        for entry in os.listdir(parent):
            if "hal_backend_rocm" not in entry and not (folder / entry).exists():
                (folder / entry).symlink_to(Path(parent, entry))
    return folder


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("build", reason="python -m build needs the build package (scripts/setup.sh --test installs it)")
    work = tmp_path_factory.mktemp("rocm-wheel")
    source = work / "rocm"
    shutil.copytree(ROOT / "backends" / "rocm", source, ignore=shutil.ignore_patterns("*.egg-info", "__pycache__", "build"))
    r = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(work / "dist"), str(source)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    wheels = list((work / "dist").glob("hal_backend_rocm-*.whl"))
    assert len(wheels) == 1 and list((work / "dist").glob("hal_backend_rocm-*.tar.gz"))
    return wheels[0]


@pytest.fixture(scope="module")
def rocm_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("rocm-venv")
    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    parent = _visible_parent(root / "parent-site")
    Path(purelib, "_hal_parent_env.pth").write_text(f"import site; site.addsitedir({str(parent)!r})\n")
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-build-isolation", str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    # pip resolved hal[triton], torch and hip-python from what the venv sees: it added the plugin only
    added = {n.split("-")[0] for n in os.listdir(purelib) if not n.startswith(("_", "."))}
    assert added == {"hal_backend_rocm"}, added
    return python


def _run(python: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("HAL_")}
    full_env.update(env)
    return subprocess.run([str(python), *args], capture_output=True, text=True, env=full_env, timeout=180)


def test_the_wheel_holds_the_plugin_and_its_entry_point(wheel: Path) -> None:
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    assert "hal_backend_rocm/__init__.py" in names and "hal_backend_rocm/launch.py" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[hal.backends]" in text and "rocm = hal_backend_rocm:plugin" in text
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert any(r.startswith("Requires-Dist: hip-python") for r in requires)
    assert any(r.startswith("Requires-Dist: hal[triton]") for r in requires)
    assert not any(r.startswith("Requires-Dist: hal-backend-") for r in requires), requires  # torch kernels: hal's hal_torch


def test_import_hal_reports_rocm_unavailable(rocm_venv: Path) -> None:
    code = textwrap.dedent(
        """
        import json, hal, hal_backend_rocm
        from hal_backend_rocm import _hip
        b = {b.name: b for b in hal.backends()}["rocm"]
        try:
            count = _hip.device_count()
            count = [count.status, count.status_name, count.count]
        except _hip.HipUnavailable as exc:
            count = str(exc)
        print(json.dumps({"file": hal_backend_rocm.__file__, "available": b.available, "reason": b.reason,
                          "load_error": b.load_error, "count": count}))
        """
    )
    r = _run(rocm_venv, "-c", code)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["file"].startswith(str(rocm_venv.parents[1])), "the plugin was not imported from the venv"
    assert got["available"] is False and got["load_error"] is None
    assert got["reason"].startswith(NOT_ROCM)
    if isinstance(got["count"], list):  # Debian's HIP runtime is installed (CI installs it)
        assert got["count"] == [100, "hipErrorNoDevice", 0]
        assert got["reason"].endswith("; no ROCm device: hipGetDeviceCount returned hipErrorNoDevice")


def test_hal_info_lists_the_plugin_and_its_reason(rocm_venv: Path) -> None:
    r = _run(rocm_venv, "-m", "hal", "info")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    rocm = [line.split() for line in r.stdout.splitlines() if line.strip().startswith("rocm ")]
    assert ["rocm", "loaded", "hal-backend-rocm"] in [words[:3] for words in rocm], rocm  # the plugin line
    backend = next(" ".join(words) for words in rocm if "priority" in words)
    assert "unavailable: " + NOT_ROCM in backend


def test_conformance_exits_with_one_line(rocm_venv: Path, tmp_path: Path) -> None:
    r = _run(rocm_venv, "-m", "hal", "conformance", "--backend", "rocm", "--report-dir", str(tmp_path / "reports"))
    assert r.returncode == 2
    assert r.stdout == "" and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hal conformance: backend 'rocm' is installed but not usable here: " + NOT_ROCM)
    assert not (tmp_path / "reports").exists()


def test_conformance_names_a_runtime_that_does_not_load(rocm_venv: Path, tmp_path: Path) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libamdhip64.so").write_text("not a library")
    r = _run(rocm_venv, "-m", "hal", "conformance", "--backend", "rocm", ROCM_PATH=str(tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert "; the ROCm runtime library could not be loaded: failed to dlopen" in line


def test_conformance_says_when_the_plugin_is_disabled(rocm_venv: Path) -> None:
    r = _run(rocm_venv, "-m", "hal", "conformance", "--backend", "rocm", HAL_DISABLE_PLUGINS="rocm")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == "hal conformance: backend 'rocm' is installed but its plugin does not serve it: it is disabled by HAL_DISABLE_PLUGINS"
