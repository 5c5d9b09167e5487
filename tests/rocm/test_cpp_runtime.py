"""The ROCm runtime of kits/cpp (hal_backend_rocm.cpp_runtime) on a machine without an AMD GPU:
every kernel source compiles through the runtime's own compile path for gfx90a, the code objects
say what the runtime's launches assume, and the runtime says why it cannot run here.

What these tests prove, against Debian's ROCm 5.2 (hiprtc inside libamdhip64.so.5, reached through
a libhiprtc.so link, as in test_hiprtc.py; every compilation in a subprocess, since that hiprtc
aborts its process for targets it does not know):

- each source's first variant (all of its kernels) compiles with the runtime's options and
  ``HAL_WARP_SIZE=64`` for gfx90a: target ``amdgcn-amd-amdhsa--gfx90a``, every kernel with
  ``.wavefront_size: 64``, no scratch memory, a work-group bound that admits the host's blocks;
- the argument buffer the runtime hands to ``hipModuleLaunchKernel`` (``KernelSig.pack``) puts every
  argument at the offset and size the code object's metadata gives it (HIP reads each argument
  from the ``extra`` buffer at that offset);
- the HIP calls of ``load`` and ``launch`` go through hip-python with these arguments and their
  error codes become errors (here the runtime answers hipErrorInvalidDevice);
- the runtime's reasons: torch's build and the missing device, an unloadable hiprtc, and two HIP
  runtimes in one process (a copy of Debian's libamdhip64 loaded first stands in for the one a
  torch ROCm wheel brings), and that the cure the reason names (ROCM_PATH) cures it.

Not run (no AMD GPU is reachable): loading a code object onto a device, a launch, the kernels'
results on AMD hardware (their numerics are proven on the H200 through the CUDA plugin, same
sources), and hiprtc for gfx942 (Debian's hiprtc does not know it).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from test_hiprtc import _notes

from hal_backend_rocm import _hip
from hal_backend_rocm.cpp_runtime import HipError, launch_kernel, load_module
from hal_cpp import SOURCES, KernelSig, batchnorm, norm, optim
from hal_cpp.kit import PARAM_FORMATS

DEBIAN_HIP = Path("/usr/lib/x86_64-linux-gnu/libamdhip64.so.5")
NOT_ROCM = "torch is not a ROCm build: install torch from the ROCm wheel index"
NO_DEVICE = "no ROCm device: hipGetDeviceCount returned hipErrorNoDevice"
#: the block size each source's host module launches with (kits/cpp/*.py)
THREADS = {"batchnorm": batchnorm.THREADS, "norm": norm.THREADS, "adamw": optim.THREADS}


def _debian_hip() -> Path:
    if not DEBIAN_HIP.exists():
        pytest.skip(f"{DEBIAN_HIP} is missing (scripts/install_hip.sh installs Debian's HIP runtime; .ci/run does)")
    return DEBIAN_HIP


def _start(code: str, **env: str) -> subprocess.Popen:
    """A Python snippet in a fresh interpreter (started, not waited for)."""
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env})


def _result(proc: subprocess.Popen) -> object:
    """The snippet's last line of output, as JSON."""
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])


#: what both interpreters run first: a copy of Debian's libamdhip64 stands in for the HIP runtime a
#: torch ROCm wheel carries in torch/lib, loaded (as torch loads it) before hip-python opens its own
PRELOAD = """
import ctypes, json
ctypes.CDLL({copy!r})
from hal_backend_rocm.cpp_kernels import RUNTIME
"""
COMPILE_ALL = """
import hal_cpp
code = {{}}
for source in hal_cpp.SOURCES:
    code[source] = {out!r} + "/" + source + RUNTIME.code_suffix
    open(code[source], "wb").write(hal_cpp.compile_source(RUNTIME, source, "gfx90a", hal_cpp.VARIANTS[source][0], 64))
print(json.dumps({{"reason": RUNTIME.unavailable_reason(), "code": code}}))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two interpreters run side by side (about 6 s together, 3 s of it hiprtc), each with the
    stand-in for torch's HIP runtime loaded first:

    - "one runtime": ROCM_PATH's lib/libamdhip64.so and lib/libhiprtc.so link to that copy, as the
      runtime's reason tells a user to arrange it; every source's first variant (all its kernels) is
      compiled for gfx90a through the runtime: {"reason": its reason there, "code": {source: path}};
    - "two runtimes": hip-python finds Debian's libamdhip64 beside the copy, and ROCM_PATH holds a
      libhiprtc.so that is no library: the runtime's reason there.
    """
    root = tmp_path_factory.mktemp("rocm")
    copy = root / "torch_lib" / "libamdhip64.so"
    one, two = root / "one" / "lib", root / "two" / "lib"
    for folder in (copy.parent, one, two):
        folder.mkdir(parents=True)
    shutil.copyfile(_debian_hip(), copy)
    for name in ("libamdhip64.so", "libhiprtc.so"):
        (one / name).symlink_to(copy)
    (two / "libhiprtc.so").write_text("not an ELF file")  # hip-python looks under ROCM_PATH first
    preload = PRELOAD.format(copy=str(copy))
    compile_all = _start(preload + COMPILE_ALL.format(out=str(root)), ROCM_PATH=str(one.parent))
    reasons = _start(preload + "print(json.dumps(RUNTIME.unavailable_reason()))", ROCM_PATH=str(two.parent))
    return {"one runtime": _result(compile_all), "two runtimes": _result(reasons), "copy": copy, "two": two}


def _metadata(path: Path) -> dict:
    """The AMDGPU metadata of a code object (``llvm-readelf --notes``), parsed."""
    yaml = pytest.importorskip("yaml", reason="PyYAML parses the code object's metadata (pip install pyyaml)")
    notes = _notes(path)
    return yaml.safe_load(notes[notes.index("---") + 3 : notes.rindex("\n...")])


def _explicit_args(kernel: dict) -> list[dict]:
    return [a for a in kernel[".args"] if not a[".value_kind"].startswith("hidden_")]


@pytest.mark.parametrize("source", list(SOURCES))
def test_every_kernel_compiles_for_gfx90a_with_wavefront_64(runs: dict, source: str) -> None:
    meta = _metadata(Path(runs["one runtime"]["code"][source]))
    assert meta["amdhsa.target"] == "amdgcn-amd-amdhsa--gfx90a"
    kernels = {k[".name"]: k for k in meta["amdhsa.kernels"]}
    assert set(kernels) == {sig.name for sig in SOURCES[source].kernels}
    for name, k in kernels.items():
        assert k[".wavefront_size"] == 64, name
        assert k[".private_segment_fixed_size"] == 0, f"{name} uses scratch memory (spills or a local array)"
        assert k[".max_flat_workgroup_size"] >= THREADS[source], f"{name} cannot take the host's blocks of {THREADS[source]}"


def _sentinels(sig: KernelSig) -> tuple:
    """A distinct, exactly representable value per parameter."""
    return tuple((0x1000_0000_0000 + 0x100 * i) if kind == "ptr" else (i + 0.5) if kind.startswith("f") else (1000 + i)
                 for i, kind in enumerate(sig.params))


@pytest.mark.parametrize("source", list(SOURCES))
def test_the_packed_arguments_lie_where_the_kernels_read_them(runs: dict, source: str) -> None:
    """HIP copies each argument of an ``extra`` buffer from the offset the kernel's metadata gives it."""
    kernels = {k[".name"]: k for k in _metadata(Path(runs["one runtime"]["code"][source]))["amdhsa.kernels"]}
    for sig in SOURCES[source].kernels:
        args = _explicit_args(kernels[sig.name])
        assert len(args) == len(sig.params), sig.name
        values = _sentinels(sig)
        packed = sig.pack(values)
        assert len(packed) <= kernels[sig.name][".kernarg_segment_size"], sig.name
        for kind, value, arg in zip(sig.params, values, args):
            fmt = "<" + PARAM_FORMATS[kind]
            assert arg[".size"] == struct.calcsize(fmt), (sig.name, arg)
            assert struct.unpack_from(fmt, packed, arg[".offset"])[0] == value, (sig.name, arg)


def test_with_one_hip_runtime_only_torch_and_the_device_are_reasons(runs: dict) -> None:
    """There hiprtc loads, and torch's HIP runtime and hip-python's are one file."""
    reason = runs["one runtime"]["reason"]
    assert reason.startswith(NOT_ROCM) and reason.endswith("; " + NO_DEVICE)
    assert "hiprtc" not in reason and "two HIP runtimes" not in reason


def test_an_unloadable_hiprtc_and_two_hip_runtimes_are_reasons(runs: dict) -> None:
    reason, lib = runs["two runtimes"], runs["two"]
    assert reason.startswith(NOT_ROCM)
    device = reason.index("; " + NO_DEVICE)
    hiprtc = reason.index(f"; the hiprtc library could not be loaded: failed to dlopen '{lib}/libhiprtc.so': "
                          f"{lib}/libhiprtc.so: file too short; install ROCm's hiprtc (libhiprtc.so)")
    copies = reason.index(f"; two HIP runtimes are loaded in this process ({runs['copy']}, {DEBIAN_HIP.parent}/")
    assert device < hiprtc < copies
    assert reason.endswith("give both one runtime (set ROCM_PATH to a folder whose lib/libamdhip64.so links torch's copy, "
                           "or install a torch built on this ROCm)")


def _hip_here() -> None:
    try:
        _hip.device_count()
    except _hip.HipUnavailable as exc:
        pytest.skip(f"no HIP runtime here: {exc} (CI installs one: scripts/install_hip.sh)")


def test_load_and_launch_reach_hip_and_raise_its_error(runs: dict) -> None:
    """The real HIP calls with the runtime's arguments: without a device HIP answers an error code,
    which is raised with its name (on an AMD GPU these calls load and launch: not run here)."""
    _hip_here()
    code = Path(runs["one runtime"]["code"]["adamw"]).read_bytes()
    with pytest.raises(HipError, match=r"^hipModuleLoadData returned hipError\w+ \(\d+\)$"):
        load_module(code, ["adamw_step"])
    sig = SOURCES["adamw"].kernels[0]
    with pytest.raises(HipError, match=r"^hipModuleLaunchKernel returned hipError\w+ \(\d+\)$"):
        launch_kernel(None, (1, 1, 1), (optim.THREADS, 1, 1), sig.pack(_sentinels(sig)), 0)
