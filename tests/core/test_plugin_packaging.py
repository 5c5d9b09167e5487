"""Plugins for real: tiny plugin distributions built in a temporary folder and pip-installed into a
temporary virtual environment; then `import hal`, `hal info` and dispatch are checked in it.

The venv sees this environment's packages (torch, numpy, hal, cpu_ref) through a .pth file, so only
the three plugins are installed, as a user would install them: `pip install <folder>`.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest

HEALTHY = '''
"""A toy backend: priority above cpu_ref, a softmax kernel only."""
import numpy as np
from hal.plugin import Plugin

plugin = Plugin("toy", "0.3.0")
plugin.define_backend(priority=50, device_types=("cpu",), array_api="numpy")

@plugin.kernel("softmax", name="toy_softmax")
def softmax(x, dim):
    e = np.exp(x - x.max(axis=dim, keepdims=True))
    return (e / e.sum(axis=dim, keepdims=True)).astype(x.dtype)
'''

BROKEN = '''
"""A plugin whose import fails."""
raise RuntimeError("libwidget.so.3: cannot open shared object file")
'''

FUTURE = '''
"""A plugin built for the next major plugin API."""
from hal.plugin import Plugin

plugin = Plugin("future", "9.0.0", api_version="2.0")
plugin.define_backend(priority=99, device_types=("cpu",))
'''


def _write_distribution(root: Path, dist: str, module: str, entry: str, source: str) -> Path:
    folder = root / dist
    (folder / module).mkdir(parents=True)
    (folder / module / "__init__.py").write_text(textwrap.dedent(source))
    (folder / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""
            [build-system]
            requires = ["setuptools>=61"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "{dist}"
            version = "0.3.0"
            dependencies = ["hal"]

            [project.entry-points."hal.backends"]
            {entry} = "{module}:plugin"

            [tool.setuptools]
            packages = ["{module}"]
            """
        )
    )
    return folder


@pytest.fixture(scope="module")
def plugin_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with three real plugin distributions installed by pip."""
    root = tmp_path_factory.mktemp("plugins")
    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    parents = [p for p in site.getsitepackages() if os.path.isdir(p)]
    # addsitedir also processes the parent's .pth files (editable installs of hal and cpu_ref).
    Path(purelib, "_hal_parent_env.pth").write_text("".join(f"import site; site.addsitedir({p!r})\n" for p in parents))
    dists = [
        _write_distribution(root, "hal-backend-toy", "hal_backend_toy", "toy", HEALTHY),
        _write_distribution(root, "hal-backend-broken", "hal_backend_broken", "broken", BROKEN),
        _write_distribution(root, "hal-backend-future", "hal_backend_future", "future", FUTURE),
    ]
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
         "--no-build-isolation", *map(str, dists)],
        check=True, capture_output=True, text=True,
    )
    return python


def _run(python: Path, code: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` in the plugins' venv, the fast CPU backend disabled so that cpu_ref is the CPU floor
    these tests fall back to."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("HAL_")}
    full_env["HAL_DISABLE_PLUGINS"] = "cpu"
    full_env.update(env)
    return subprocess.run([str(python), "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full_env, timeout=120)


def test_import_hal_survives_broken_and_skewed_plugins(plugin_venv: Path) -> None:
    r = _run(
        plugin_venv,
        """
        import json, hal
        print(json.dumps([{"name": b.name, "available": b.available, "reason": b.reason,
                           "load_error": b.load_error, "priority": b.priority} for b in hal.backends()]))
        """,
    )
    assert r.returncode == 0, r.stderr
    records = {b["name"]: b for b in json.loads(r.stdout)}
    assert records["toy"]["available"] and records["toy"]["priority"] == 50
    assert records["cpu_ref"]["available"]
    assert not records["broken"]["available"]
    assert "libwidget.so.3: cannot open shared object file" in records["broken"]["load_error"]
    future = records["future"]["load_error"]
    assert "built for hal plugin API 2.0" in future and "plugin API 1.0" in future
    assert "pip install --upgrade hal" in future


def test_dispatch_uses_the_plugin_by_priority_and_falls_back_for_missing_ops(plugin_venv: Path) -> None:
    r = _run(
        plugin_venv,
        """
        import numpy as np, hal
        x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
        y = hal.ops.softmax(x)
        assert np.allclose(y.sum(-1), 1, atol=1e-6)
        d = hal.explain("softmax", x)
        print(d.backend, d.kernel)
        z = hal.ops.layer_norm(x, 4)  # toy has no layer_norm: cpu_ref runs it, as a counted fallback
        print(hal.explain("layer_norm", x, 4).fallback)
        print(hal.stats()[("layer_norm", "cpu_ref", "numpy")]["fallbacks"])
        """,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["toy", "toy_softmax", "backend", "1"]


def test_errors_mention_the_broken_plugins(plugin_venv: Path) -> None:
    r = _run(
        plugin_venv,
        """
        import torch, hal
        try:
            hal.ops.softmax(torch.ones(2, device="meta"))
        except hal.BackendUnavailableError as e:
            print(e)
        """,
    )
    assert r.returncode == 0, r.stderr
    assert "plugins not loaded" in r.stdout and "broken" in r.stdout and "libwidget" in r.stdout


def test_hal_info_reports_every_plugin(plugin_venv: Path) -> None:
    r = _run(plugin_venv, "import sys; from hal.cli import main; sys.exit(main(['info', '--json']))")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    status = {p["name"]: p["status"] for p in info["plugins"]}
    assert status["toy"] == "loaded" and status["broken"] == "failed" and status["future"] == "failed"
    assert info["coverage"]["softmax"]["toy"]["kernels"] == ["toy_softmax"]
    assert info["coverage"]["layer_norm"]["toy"]["status"] == "missing"
    assert info["coverage"]["fused_conv_bn_relu"]["toy"]["status"] == "composite"
    text = _run(plugin_venv, "import sys; from hal.cli import main; sys.exit(main(['info']))")
    assert text.returncode == 0 and "libwidget.so.3" in text.stdout and "failed" in text.stdout


def test_disable_plugins_env(plugin_venv: Path) -> None:
    r = _run(
        plugin_venv,
        """
        import numpy as np, hal
        print(hal.explain("softmax", np.ones((2, 2), np.float32)).backend)
        print([b.reason for b in hal.backends() if b.name == "toy"][0])
        """,
        HAL_DISABLE_PLUGINS="toy,broken,cpu",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["cpu_ref", "disabled by HAL_DISABLE_PLUGINS"]
