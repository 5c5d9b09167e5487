"""The eager backend is a distribution of its own (hal-backend-eager, backends/eager): its entry
point comes from it and no longer from the core, its kernels are the functions of the hal_torch kit
(shipped with the core, which the other plugins build on instead of this backend), and the core and
the other plugins work without it, saying what to install where it is needed."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap

import pytest

import hal


def test_the_entry_point_is_the_eager_distributions() -> None:
    eps = [ep for ep in importlib.metadata.entry_points(group="hal.backends") if ep.name == "eager"]
    assert [(ep.value, ep.dist.name if ep.dist else None) for ep in eps] == [("hal_backend_eager:plugin", "hal-backend-eager")]
    core = importlib.metadata.distribution("hal").entry_points
    assert not [ep for ep in core if ep.group == "hal.backends"], "the core ships no backend"
    record = {b.name: b for b in hal.backends()}["eager"]
    assert record.available and record.priority == -10


def test_its_kernels_are_the_kits_functions() -> None:
    """Every function of hal_torch is this backend's ``torch`` kernel of its op, with the kit's check."""
    from hal_backend_eager import plugin
    from hal_torch.table import CHECKS, FUNCTIONS

    assert [(k.op, k.name, k.fn, k.check) for k in plugin.kernels] == [(op, "torch", fn, CHECKS.get(op)) for op, fn in FUNCTIONS.items()]


@pytest.mark.parametrize("dist", ["hal-backend-cpu", "hal-backend-cuda", "hal-backend-rocm"])
def test_the_plugins_built_on_its_functions_do_not_depend_on_it(dist: str) -> None:
    """They import the functions from hal_torch, which ships with hal: no backend depends on another."""
    try:
        requires = importlib.metadata.requires(dist) or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{dist} is not installed here")
    assert not any(r.startswith("hal-backend-") for r in requires), requires


def test_without_it_the_eval_fold_of_hal_nn_still_runs() -> None:
    """hal.nn.FusedConvBN2d folds with the plugin SDK's FoldCache (it used to import
    hal_backend_eager.fold, and failed without the eager distribution)."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["hal_backend_eager"] = None  # as if hal-backend-eager were not installed
        import torch
        import hal.nn
        torch.manual_seed(int(sys.argv[1]))
        conv, bn = torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4)
        bn.running_mean.normal_(); bn.running_var.uniform_(0.5, 2.0); bn.weight.data.normal_(); bn.bias.data.normal_()
        fused = hal.nn.FusedConvBN2d.from_modules(conv, bn).eval()
        x = torch.randn(2, 3, 6, 5)
        with torch.no_grad():
            torch.testing.assert_close(fused(x), bn.eval()(conv(x)), rtol=1e-4, atol=1e-5)
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAL_")}
    seed = str(int.from_bytes(os.urandom(2), "little"))
    r = subprocess.run([sys.executable, "-c", code, seed], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.split() == ["ok"], r.stdout + r.stderr


def test_without_it_the_core_imports_and_the_cpu_backend_dispatches() -> None:
    """The cpu backend builds on hal_torch, not on this backend: it loads and runs without it."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["hal_backend_eager"] = None  # as if hal-backend-eager were not installed
        import numpy as np
        import hal, hal.nn
        x = np.ones((2, 3), np.float32)
        assert hal.explain("softmax", x).backend == "cpu"
        eager = {b.name: b for b in hal.backends()}["eager"]
        assert not eager.available and "hal_backend_eager" in (eager.load_error or ""), eager
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAL_")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.split() == ["ok"], r.stdout + r.stderr


def test_without_it_the_conformance_of_cpu_ref_names_the_distribution(tmp_path) -> None:
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["hal_backend_eager"] = None  # as if hal-backend-eager were not installed
        from hal.cli import main
        sys.exit(main(["conformance", "--backend", "cpu_ref", "--ops", "softmax", "--report-dir", {str(tmp_path / "reports")!r}]))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAL_")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "the reference backend eager" in r.stderr and "pip install hal-backend-eager` (./backends/eager" in r.stderr, r.stderr
