"""Every kits/cpp kernel compiles with no GPU: for sm_80 and sm_90 through NVRTC (the CUDA plugin's own
runtime, CuPy), and for gfx90a through Debian's hipcc (``--genco``) and through hiprtc (in a
subprocess). Each code object is checked for its target, its kernels and, on AMD, wavefront 64.

Toolchains: CuPy with NVRTC (scripts/setup.sh --test installs them), hipcc, libamdhip64 and
llvm-readelf-15 (.ci/run installs them with apt-get); a test whose toolchain is missing skips and
says which.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import hal_cpp
from hal_cpp import SOURCES, VARIANTS

HERE = Path(__file__).resolve().parent
#: every variant for the newest target; for the others each source's first variant (every kernel)
CASES = [(arch, source, i) for source, variants in VARIANTS.items() for i in range(len(variants)) for arch in ("sm_80", "sm_90", "gfx90a")
         if i == 0 or arch == "sm_90" or arch == "gfx90a"]
HIP_LIB = Path("/usr/lib/x86_64-linux-gnu/libamdhip64.so.5")


def _ids(cases) -> list[str]:
    return [f"{arch}-{source}-" + "-".join(v.replace("hal::", "") for v in VARIANTS[source][i].values()) for arch, source, i in cases]


NV_CASES = [c for c in CASES if c[0].startswith("sm_")]
AMD_CASES = [c for c in CASES if c[0] == "gfx90a"]


def _nvrtc():
    pytest.importorskip("cupy", reason="CuPy is not installed (scripts/setup.sh --test installs cupy-cuda13x)")
    from hal_backend_cuda.cpp_runtime import CupyRuntime

    rt = CupyRuntime()
    reason = rt.unavailable_reason()
    if reason:
        pytest.skip(reason)
    return rt


def _kernel_names(source: str) -> list[str]:
    return [k.name for k in SOURCES[source].kernels]


@pytest.mark.parametrize("arch,source,variant", NV_CASES, ids=_ids(NV_CASES))
def test_nvrtc_builds_a_cubin_for_the_architecture(arch, source, variant):
    code = hal_cpp.compile_source(_nvrtc(), source, arch, VARIANTS[source][variant], 32)
    assert code[:4] == b"\x7fELF", f"NVRTC gave no ELF cubin for {arch}"
    e_flags = struct.unpack_from("<I", code, 48)[0]
    assert (e_flags >> 8) & 0xFF == int(arch[3:]), f"cubin built for sm_{(e_flags >> 8) & 0xFF}, not {arch}"
    for name in _kernel_names(source):
        assert name.encode() + b"\0" in code, f"kernel {name} missing from the {arch} cubin"


def _amd_notes(code: bytes, tmp_path: Path) -> str:
    """`llvm-readelf-15 --notes` of an AMD code object (the gfx90a entry of an offload bundle)."""
    if code.startswith(b"__CLANG_OFFLOAD_BUNDLE__"):
        count, offset, found = struct.unpack_from("<Q", code, 24)[0], 32, None
        for _ in range(count):
            start, size, triple_len = struct.unpack_from("<QQQ", code, offset)
            triple = code[offset + 24 : offset + 24 + triple_len].decode()
            offset += 24 + triple_len
            if triple.startswith("hip") and triple.endswith("gfx90a"):
                found = code[start : start + size]
        assert found is not None, "the offload bundle has no gfx90a code object"
        code = found
    path = tmp_path / "kernels.co"
    path.write_bytes(code)
    return subprocess.run(["llvm-readelf-15", "--notes", str(path)], capture_output=True, text=True, check=True).stdout


def _check_amd(notes: str, source: str) -> None:
    assert "amdhsa.target:   amdgcn-amd-amdhsa--gfx90a" in notes, "code object not built for gfx90a"
    names = _kernel_names(source)
    assert notes.count(".wavefront_size: 64") == len(names), "every kernel should be built for wavefront 64"
    for name in names:
        assert f".name:           {name}\n" in notes, f"kernel {name} missing from the gfx90a code object"
    assert notes.count(".private_segment_fixed_size: 0\n") == len(names), "a kernel uses scratch memory (spills or a local array)"


def _need(tool: str) -> None:
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} is not installed (apt-get install --no-install-recommends hipcc libamdhip64-dev; .ci/run does)")


def _translation_unit(tmp_path: Path, source: str) -> Path:
    path = tmp_path / (Path(SOURCES[source].file).stem + ".hip")
    path.write_text(SOURCES[source].text())
    return path


def _defines(source: str, variant: int) -> list[str]:
    return [f"-D{k}={v}" for k, v in {**VARIANTS[source][variant], "HAL_WARP_SIZE": "64"}.items()]


@pytest.mark.parametrize("arch,source,variant", AMD_CASES, ids=_ids(AMD_CASES))
def test_hipcc_builds_gfx90a_code_objects(tmp_path, arch, source, variant):
    _need("hipcc")
    _need("llvm-readelf-15")
    out = tmp_path / "out.co"
    cmd = ["hipcc", "--genco", f"--offload-arch={arch}", "-std=c++17", "-O3", *_defines(source, variant),
           str(_translation_unit(tmp_path, source)), "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HIP_PLATFORM": "amd"})
    assert done.returncode == 0, done.stderr[-4000:]
    _check_amd(_amd_notes(out.read_bytes(), tmp_path), source)


@pytest.mark.parametrize("source", list(VARIANTS))
def test_hiprtc_builds_gfx90a_code_objects_in_a_subprocess(tmp_path, source):
    if not HIP_LIB.exists():
        pytest.skip(f"{HIP_LIB} is missing (apt-get install --no-install-recommends libamdhip64-dev; .ci/run does)")
    _need("llvm-readelf-15")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libhiprtc.so").symlink_to(HIP_LIB)  # Debian's hiprtc lives in libamdhip64
    out = tmp_path / "out.co"
    env = {**os.environ, "LD_LIBRARY_PATH": str(tmp_path / "lib")}
    cmd = [sys.executable, str(HERE / "hiprtc_compile.py"), str(_translation_unit(tmp_path, source)), str(out),
           "--offload-arch=gfx90a", "-std=c++17", *_defines(source, 0)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    _check_amd(_amd_notes(out.read_bytes(), tmp_path), source)


def _c_kind(param: str) -> str:
    decl = param.strip().rsplit(" ", 1)[0]
    if "*" in param:
        return "ptr"
    return {"int": "i32", "i64": "i64", "hal::i64": "i64", "double": "f64", "float": "f32"}[decl.replace("const ", "").strip()]


def test_kernel_table_matches_the_sources_entry_points():
    """The argument types the kit marshals are those of each extern "C" kernel in the source (a
    mismatch would launch with misplaced arguments)."""
    import re

    for name, src in SOURCES.items():
        text = src.text()
        for sig in src.kernels:
            found = re.findall(r"(?:HAL_KERNEL|HAL_REDUCTION|__launch_bounds__\([^()]*\))\s+" + sig.name + r"\(([^)]*)\)", text)
            assert len(found) == 1, f"{src.file}: {len(found)} entry points named {sig.name}"
            params = tuple(_c_kind(p) for p in found[0].split(","))
            assert params == sig.params, f"{src.file}: {sig.name} takes {params}, the kit declares {sig.params}"
