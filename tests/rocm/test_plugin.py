"""The ROCm plugin as installed here (no AMD GPU, torch a CPU build): discovered, unavailable with
its reasons, every op covered with architecture data, and the HIP runtime answering through
hip-python. No test here stands in for torch's ROCm build."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hal
from hal_backend_rocm import _device, _hip, plugin
from hal_backend_rocm._device import ANY_GFX, ARCHS, FP8, TRITON_ARCHS, XF32, base_arch, gfx, probe_reason, torch_problem

NO_DEVICE = "no ROCm device: hipGetDeviceCount returned hipErrorNoDevice"
NOT_ROCM = "torch is not a ROCm build: install torch from the ROCm wheel index"


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, **env})


def test_entry_point_is_installed() -> None:
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="hal.backends")}
    assert eps.get("rocm") == "hal_backend_rocm:plugin"
    assert plugin.api_version.split(".")[0] == hal.API_VERSION.split(".")[0]
    requires = importlib.metadata.requires("hal-backend-rocm") or []
    assert any(r.startswith("hip-python") for r in requires) and any(r.startswith("hal[triton]") for r in requires)
    assert not any(r.startswith("hal-backend-") for r in requires), "no backend depends on another (its torch kernels are hal_torch's)"


@pytest.mark.skipif(getattr(torch.version, "hip", None) is not None, reason="torch here is a ROCm build")
def test_reports_itself_unavailable_with_both_reasons() -> None:
    record = {b.name: b for b in hal.backends()}["rocm"]
    assert record.available is False and record.load_error is None
    assert record.reason.startswith(NOT_ROCM)
    assert f"torch {torch.__version__} here is a" in record.reason
    if _hip.runtime_problem() == NO_DEVICE:  # Debian's libamdhip64 is installed (CI installs it)
        assert record.reason.endswith("; " + NO_DEVICE)


def test_hip_get_device_count_answers_no_device() -> None:
    """Through hip-python, against the HIP runtime installed here (Debian's ROCm 5.2 in CI)."""
    try:
        found = _hip.device_count()
    except _hip.HipUnavailable as exc:
        pytest.skip(f"no HIP runtime here: {exc} (CI installs one: scripts/install_hip.sh)")
    assert (found.status, found.status_name, found.count) == (100, "hipErrorNoDevice", 0)
    assert _hip.runtime_problem() == NO_DEVICE


def test_unloadable_runtime_is_a_reason(tmp_path: Path) -> None:
    """A libamdhip64.so that is not a library (under ROCM_PATH, where hip-python looks first)."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libamdhip64.so").write_text("not an ELF file")
    r = _run("from hal_backend_rocm import _device; print(_device.probe())", ROCM_PATH=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert f"the ROCm runtime library could not be loaded: failed to dlopen '{tmp_path}/lib/libamdhip64.so'" in r.stdout
    assert "libamdhip64.so: file too short" in r.stdout and "LD_LIBRARY_PATH" in r.stdout


def test_probe_reasons() -> None:
    assert torch_problem("6.2.41133", None) is None
    assert torch_problem(None, None).startswith(NOT_ROCM) and "a CPU build" in torch_problem(None, None)
    assert "a CUDA 12.4 build" in torch_problem(None, "12.4")
    assert probe_reason(None, None) is None
    assert probe_reason("a", None) == "a" and probe_reason(None, "b") == "b" and probe_reason("a", "b") == "a; b"


def test_import_touches_neither_hip_nor_triton_and_a_missing_hip_python_is_a_reason() -> None:
    r = _run("""
        import sys
        import hal_backend_rocm
        print('triton' in sys.modules, 'hip' in sys.modules)
        sys.modules["hip"] = None  # as if hip-python were not installed (it was not imported yet)
        from hal_backend_rocm import _hip
        print(_hip.runtime_problem())
        """)
    assert r.returncode == 0, r.stderr
    imported, problem = r.stdout.splitlines()
    assert imported.split() == ["False", "False"]
    assert problem.startswith("hip-python is not installed") and "pip install hip-python" in problem


def test_architecture_names_and_predicates() -> None:
    assert base_arch("gfx90a:sramecc+:xnack-") == "gfx90a" and base_arch("gfx942") == "gfx942"
    assert set(ARCHS) == {"gfx90a", "gfx942"} and all(a.wavefront == 64 for a in ARCHS.values())
    assert TRITON_ARCHS.accepts("gfx90a") and TRITON_ARCHS.accepts("gfx942") and not TRITON_ARCHS.accepts("gfx1100")
    assert TRITON_ARCHS.reason("gfx1100") == "device architecture gfx1100 not supported (this kernel needs gfx90a or gfx942)"
    assert not TRITON_ARCHS.accepts("sm_90") and not ANY_GFX.accepts("sm_90") and ANY_GFX.accepts("gfx1100")
    # matrix-core number formats: xf32 and fp8 (FNUZ) on CDNA 3 only
    assert XF32.accepts("gfx942") and not XF32.accepts("gfx90a") and XF32.text == "gfx942 (xf32 matrix instructions)"
    assert FP8.accepts("gfx942") and not FP8.accepts("gfx90a")
    assert gfx("gfx90a").reason(None) == "device architecture unknown (this kernel needs gfx90a)"


def test_every_op_has_a_rocm_kernel_with_architecture_data() -> None:
    ops = {d.name for d in hal.list_ops()}
    kernels = [k for k in plugin.kernels if k.backend == "rocm"]
    assert {k.op for k in kernels} == ops
    for k in kernels:
        assert k.archs is not None and k.archs.accepts("gfx942") and k.archs.accepts("gfx90a"), k.qualname
        assert not k.archs.accepts("sm_90"), k.qualname
    # and every op runs on an AMD GPU without tuned tables (torch's own kernels at least)
    assert {k.op for k in kernels if k.archs.accepts("gfx1100")} == ops


def test_device_slug() -> None:
    assert _device.model_slug("AMD Instinct MI250X/MI250", "gfx90a:sramecc+:xnack-") == "amd-instinct-mi250x-mi250-gfx90a"
    assert _device.model_slug("AMD Instinct MI300X", "gfx942:sramecc+:xnack-") == "amd-instinct-mi300x-gfx942"
