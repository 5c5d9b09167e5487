"""HIP C++ compiled for gfx90a by the plugin's hiprtc function (hip-python) and by Debian's hipcc,
checked in the code objects' notes: target and a wavefront of 64.

Debian's ROCm 5.2 (scripts/install_hip.sh) keeps hiprtc inside libamdhip64.so.5, while hip-python
opens libhiprtc.so: the tests put a libhiprtc.so link to it on LD_LIBRARY_PATH of a subprocess
(the loader reads that variable at process start). Every compilation runs in a subprocess: asked
for an architecture it does not know (gfx942), that hiprtc aborts its process.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

#: a kernel of the tests' own: one block-wide reduction with wavefront shuffles
SOURCE = textwrap.dedent(
    """
    #include "wave.h"
    extern "C" __global__ void block_sum(const float* x, float* out, int n) {
      __shared__ float partial[1024 / WAVE];
      float v = 0.0f;
      for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) v += x[i];
      for (int offset = WAVE / 2; offset > 0; offset /= 2) v += __shfl_down(v, offset);
      if (threadIdx.x % WAVE == 0) partial[threadIdx.x / WAVE] = v;
      __syncthreads();
      if (threadIdx.x == 0) {
        float s = 0.0f;
        for (int w = 0; w < blockDim.x / WAVE; ++w) s += partial[w];
        atomicAdd(out, s);
      }
    }
    """
)
HEADER = "#pragma once\n#define WAVE 64\n"


def _readelf() -> str:
    found = shutil.which("llvm-readelf-15") or shutil.which("llvm-readelf")
    if found is None:
        pytest.skip("llvm-readelf is not installed (scripts/install_hip.sh installs it with hipcc)")
    return found


def _notes(path: Path) -> str:
    return subprocess.run([_readelf(), "--notes", str(path)], capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def hiprtc_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with libhiprtc.so linked to Debian's libamdhip64.so.5."""
    found = sorted(glob.glob("/usr/lib/*/libamdhip64.so.5")) + sorted(glob.glob("/opt/rocm/lib/libhiprtc.so*"))
    if not found:
        pytest.skip("no HIP runtime installed here (CI installs Debian's: scripts/install_hip.sh)")
    folder = tmp_path_factory.mktemp("hiprtc")
    (folder / "libhiprtc.so").symlink_to(found[0])
    return folder


def _compile_in_subprocess(folder: Path, arch: str, sources: dict[str, str], out: Path) -> dict:
    """Each source compiled by the plugin's hiprtc function in one subprocess: {name: result}."""
    code = f"""
        import json
        from hal_backend_rocm.hiprtc import HiprtcError, compile_source
        results = {{}}
        for name, source in {sources!r}.items():
            try:
                co = compile_source(source, {arch!r}, name=name + ".hip", options=["-O3"], headers={{"wave.h": {HEADER!r}}})
            except HiprtcError as exc:
                results[name] = {{"error": str(exc), "log": exc.log}}
                continue
            open({str(out)!r} + "/" + name + ".co", "wb").write(co.code)
            results[name] = {{"arch": co.arch, "size": len(co.code), "log": co.log}}
        print(json.dumps(results))
        """
    env = {**os.environ, "LD_LIBRARY_PATH": f"{folder}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_hiprtc_compiles_for_gfx90a_and_reports_the_log(hiprtc_dir: Path, tmp_path: Path) -> None:
    broken = SOURCE.replace("v += x[i];", "v += x[i] +;")
    results = _compile_in_subprocess(hiprtc_dir, "gfx90a", {"block_sum": SOURCE, "broken": broken}, tmp_path)
    good = results["block_sum"]
    assert good.get("arch") == "gfx90a" and good["size"] > 1000, good
    out = tmp_path / "block_sum.co"
    assert out.read_bytes()[:4] == b"\x7fELF"
    notes = _notes(out)
    assert "amdhsa.target:   amdgcn-amd-amdhsa--gfx90a" in notes and ".wavefront_size: 64" in notes
    assert ".name:           block_sum" in notes and ".group_segment_fixed_size: 64" in notes  # 16 floats of LDS
    bad = results["broken"]
    assert "hiprtcCompileProgram of broken.hip for gfx90a returned HIPRTC_ERROR_COMPILATION" in bad["error"]
    assert "error: expected expression" in bad["log"] and not (tmp_path / "broken.co").exists()


def test_hipcc_compiles_the_same_source_for_gfx90a(tmp_path: Path) -> None:
    hipcc = shutil.which("hipcc")
    if hipcc is None:
        pytest.skip("hipcc is not installed (scripts/install_hip.sh installs Debian's)")
    (tmp_path / "wave.h").write_text(HEADER)
    (tmp_path / "block_sum.hip").write_text(SOURCE)
    out = tmp_path / "block_sum.co"
    # hiprtc declares the HIP built-ins itself, hipcc needs the runtime header; without
    # --no-gpu-bundle-output hipcc 5.2 wraps the code object in a clang offload bundle
    r = subprocess.run([hipcc, "--genco", "--offload-arch=gfx90a", "--no-gpu-bundle-output", "-O3", "-include", "hip/hip_runtime.h", "-o", str(out), str(tmp_path / "block_sum.hip")],
                       capture_output=True, text=True, env={**os.environ, "HIP_PLATFORM": "amd"}, timeout=120)
    assert r.returncode == 0, r.stderr
    notes = _notes(out)
    assert "amdgcn-amd-amdhsa--gfx90a" in notes and ".wavefront_size: 64" in notes and "block_sum" in notes
