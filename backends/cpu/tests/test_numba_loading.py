"""numba, for real, in fresh interpreters: importing the plugin imports no numba; numba kernels
cache into HAL_CPU_NUMBA_CACHE_DIR; with numba missing or broken the torch kernels still serve and
the numba kernels decline with the reason."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

#: a sitecustomize that makes ``import numba`` fail the way a missing or a broken install does
BLOCKER = '''
import importlib.abc, sys
MODE = {mode!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "numba" or name.startswith("numba."):
            if MODE == "missing":
                raise ModuleNotFoundError("No module named 'numba'", name="numba")
            raise RuntimeError("numba was built against another NumPy (simulated by the test)")
        return None
sys.meta_path.insert(0, Block())
'''


def _run(code: str, tmp_path: Path, block: str = "", **env: str) -> subprocess.CompletedProcess:
    run_env = {**os.environ, **env}
    if block:
        site = tmp_path / f"site_{block}"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(BLOCKER.format(mode=block))
        run_env["PYTHONPATH"] = os.pathsep.join([str(site), run_env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=run_env, timeout=300)


def test_plugin_import_and_torch_kernels_import_no_numba(tmp_path: Path) -> None:
    r = _run(
        """
        import sys, torch, hal
        assert any(b.name == "cpu" and b.available for b in hal.backends())
        import hal_backend_cpu
        x = torch.randn(2, 3, 8, 8)
        hal.ops.conv2d(x, torch.randn(4, 3, 3, 3), padding=1)  # no numba kernel for conv2d
        print("numba" in sys.modules)
        x, scale, shift = torch.randn(4, 64), torch.rand(64), torch.randn(64)
        hal.ops.scale_shift_act(x, scale, shift, "relu")  # the numba kernel (a feature-wise bias): imported now
        print("numba" in sys.modules, hal.explain("scale_shift_act", x, scale, shift, "relu").kernel)
        """,
        tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "True", "numba"]


def test_cache_directory_from_the_environment(tmp_path: Path) -> None:
    """The variable reaches numba before its import, and the kernels' caches point into it
    (checked on numba's cache objects: compiling into a fresh directory would take seconds)."""
    cache = tmp_path / "numba-cache"
    r = _run(
        """
        import os
        from hal_backend_cpu import _numba
        assert _numba.unavailable_reason() is None
        import numba
        nb = _numba.family("elementwise")
        print(os.environ["NUMBA_CACHE_DIR"] == numba.config.CACHE_DIR)
        print(nb.affine_rows._cache._cache_path)
        """,
        tmp_path,
        HAL_CPU_NUMBA_CACHE_DIR=str(cache),
    )
    assert r.returncode == 0, r.stderr
    same, path = r.stdout.splitlines()
    assert same == "True" and path.startswith(str(cache)), r.stdout


@pytest.mark.parametrize(
    "mode, reason",
    [("missing", "numba is not installed"), ("broken", "numba failed to import (RuntimeError: numba was built against another NumPy")],
)
def test_without_a_working_numba_the_torch_kernels_serve(tmp_path: Path, mode: str, reason: str) -> None:
    r = _run(
        """
        import numpy as np, torch, hal
        x = torch.randn(4, 16, dtype=torch.float32)
        y = hal.ops.scale_shift_act(x, 1.5, -0.25, "silu")
        torch.testing.assert_close(y, torch.nn.functional.silu(x * 1.5 - 0.25))
        a = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
        hal.ops.rms_norm(a, 8)
        d = hal.explain("scale_shift_act", x, 1.5, -0.25, "silu")
        print(d.backend, d.kernel)
        print([c.reasons for c in d.candidates if c.kernel == "numba"][0][0])
        """,
        tmp_path,
        block=mode,
    )
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.splitlines()[:2]
    assert first == "cpu torch"
    assert second.startswith(reason), second


@pytest.mark.parametrize("mode", ["missing", "broken", ""])
def test_hal_info_says_when_the_numba_kernels_are_off(tmp_path: Path, mode: str) -> None:
    """``hal info`` keeps the backend available and adds a note with numba's reason (none when it works)."""
    r = _run("import sys\nfrom hal.cli import main\nsys.exit(main(['info']))", tmp_path, block=mode)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("  cpu ") and "priority 50" in line)
    assert lines[row].endswith("available")
    notes = [line.strip() for line in lines[row + 1 : row + 4] if line.strip().startswith("note:")]
    if mode:
        assert len(notes) == 1 and "numba kernels off: numba" in notes[0] and "torch's kernels run those ops" in notes[0], notes
    else:
        assert notes == []
