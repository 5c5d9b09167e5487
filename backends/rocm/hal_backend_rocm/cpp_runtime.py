"""The ROCm runtime of kits/cpp: hiprtc (through hip-python, :mod:`.hiprtc`) compiles the kit's
sources for the device's gcnArchName with its target features ("gfx90a:sramecc+:xnack-") and
``HAL_WARP_SIZE`` set to the device's wavefront size (64 on CDNA), ``hipModuleLoadData`` loads the
code objects, and kernels launch with ``hipModuleLaunchKernel`` on torch's current stream (on a
ROCm build of torch ``torch.cuda.current_stream().cuda_stream`` is the hipStream_t), their
arguments packed as the C parameter list into one buffer handed over through ``extra``.

Device facts come from ``hipGetDeviceProperties`` (:mod:`._device`): gcnArchName, wavefront size,
compute units. The kit caches code objects on disk per runtime and gcnArchName, and loaded modules
per device.

Where this cannot run (torch not a ROCm build, hip-python or hiprtc missing, no device, or two HIP
runtimes in the process) :meth:`HipRuntime.unavailable_reason` says why, and every "cpp" kernel
rejects with that reason, so the dispatcher takes the plugin's Triton and torch kernels. Nothing
here calls HIP before a kernel is checked or launched.

Not run anywhere: ``load`` and ``launch`` on an AMD GPU (none was reachable). CI proves the compile
path for gfx90a and that each argument of the packed buffer lies where the code object's kernel
metadata says the kernel reads it (tests/rocm/test_cpp_runtime.py).
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch

from hal_cpp import CompileError, KernelSig

from . import _hip
from ._device import _index, probe, properties
from .hiprtc import HiprtcError, _call, _hiprtc, compile_source

#: options of every compilation besides the architecture and the defines (those tests/cpp gives hipcc)
OPTIONS = ("-std=c++17", "-O3")


class HipError(RuntimeError):
    """A HIP call of the runtime returned an error code."""


class HipRuntime:
    """kits/cpp's :class:`hal_cpp.Runtime` for AMD GPUs."""

    name = "hiprtc"
    code_suffix = ".hsaco"

    def __init__(self) -> None:
        self._modules: list[Any] = []  # loaded modules stay loaded: their kernels launch for the whole process

    @functools.lru_cache(maxsize=None)
    def unavailable_reason(self) -> Optional[str]:
        """Every reason that applies, in the order to fix them (the backend's, then hiprtc's, then
        the process's HIP runtimes)."""
        reasons = [probe(), hiprtc_problem(), runtime_copies_problem()]
        return "; ".join(r for r in reasons if r) or None

    @functools.lru_cache(maxsize=None)
    def version(self) -> str:
        """hiprtc's and the HIP runtime's versions (hiprtc's alone says little: ROCm 5.2's answers 9.0)."""
        major, minor = _ok(_hiprtc_call("hiprtcVersion"), "hiprtcVersion")
        (runtime,) = _ok(_hip._call("hipRuntimeGetVersion"), "hipRuntimeGetVersion")
        return f"hiprtc {major}.{minor}, HIP runtime {runtime}"

    def arch(self, device: Any) -> str:
        return properties(_index(device)).gcn_arch_name

    def warp_size(self, device: Any) -> int:
        return properties(_index(device)).wavefront_size

    def multiprocessors(self, device: Any) -> int:
        return properties(_index(device)).compute_units

    def stream(self, device: Any) -> int:
        return int(torch.cuda.current_stream(device).cuda_stream)

    def compile(self, text: str, filename: str, arch: str, defines: Mapping[str, str], kernels: Sequence[KernelSig]) -> bytes:
        """A code object of ``text`` for ``arch`` (needs hiprtc only, no device)."""
        options = (*OPTIONS, *(f"-D{k}={v}" for k, v in defines.items()))
        try:
            return compile_source(text, arch, name=filename, options=options).code
        except HiprtcError as exc:
            raise CompileError(f"{filename} did not compile for {arch}: {exc}") from None

    def load(self, path: Path, kernels: Sequence[KernelSig], device: Any) -> Mapping[str, Any]:
        with torch.cuda.device(_index(device)):
            module, functions = load_module(path.read_bytes(), [k.name for k in kernels])
        self._modules.append(module)
        return functions

    def launch(self, handle: Any, grid: tuple[int, int, int], block: tuple[int, int, int], sig: KernelSig,
               values: tuple, device: Any) -> None:
        with torch.cuda.device(_index(device)):  # the null stream launches on the current device
            launch_kernel(handle, grid, block, sig.pack(values), self.stream(device))


def load_module(image: bytes, names: Sequence[str]) -> tuple[Any, dict[str, Any]]:
    """(module, its functions by name) of a code object, loaded on the current device."""
    (module,) = _ok(_hip._call("hipModuleLoadData", image), "hipModuleLoadData")
    functions = {}
    try:
        for name in names:
            (functions[name],) = _ok(_hip._call("hipModuleGetFunction", module, name.encode()), f"hipModuleGetFunction({name})")
    except HipError:
        _hip._call("hipModuleUnload", module)
        raise
    return module, functions


def launch_kernel(function: Any, grid: tuple[int, int, int], block: tuple[int, int, int], args: bytes, stream: int) -> None:
    """Launch ``function`` on ``stream`` (0: the current device's null stream) with ``args``, the
    packed parameter list, through ``extra`` (HIP copies the buffer before it returns)."""
    hip = _hip.bindings()
    buffer = ctypes.create_string_buffer(args, len(args))
    size = ctypes.c_size_t(len(args))
    extra = (ctypes.c_void_p * 5)(hip.HIP_LAUNCH_PARAM_BUFFER_POINTER, ctypes.addressof(buffer),
                                  hip.HIP_LAUNCH_PARAM_BUFFER_SIZE, ctypes.addressof(size), hip.HIP_LAUNCH_PARAM_END)
    _ok(_hip._call("hipModuleLaunchKernel", function, *grid, *block, 0, stream, None, extra), "hipModuleLaunchKernel")


def hiprtc_problem() -> Optional[str]:
    """Why hiprtc cannot compile here (None when ``hiprtcVersion`` answers). A missing hip-python
    is the backend's reason already."""
    try:
        from hip import hiprtc  # noqa: F401
    except ImportError:
        return None
    try:
        _ok(_hiprtc_call("hiprtcVersion"), "hiprtcVersion")
    except (HiprtcError, HipError) as exc:
        return str(exc)
    return None


def runtime_copies_problem(maps: Path = Path("/proc/self/maps")) -> Optional[str]:
    """Why kernels cannot launch on torch's streams: two different HIP runtime libraries mapped in
    this process (a torch ROCm wheel brings its own libamdhip64, while hip-python opens the one
    under $ROCM_PATH or /opt/rocm; a stream of one is no stream of the other). None with one."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:  # not Linux: nothing to read
        return None
    files: dict[tuple[int, int], str] = {}
    for line in lines:
        fields = line.split(None, 5)
        if len(fields) == 6 and os.path.basename(fields[5]).startswith("libamdhip64.so"):
            try:
                st = os.stat(fields[5])
            except OSError:
                continue
            files.setdefault((st.st_dev, st.st_ino), fields[5])
    if len(files) < 2:
        return None
    return (f"two HIP runtimes are loaded in this process ({', '.join(sorted(files.values()))}), and kernels launched "
            "through hip-python's would not run on torch's streams: give both one runtime (set ROCM_PATH to a folder "
            "whose lib/libamdhip64.so links torch's copy, or install a torch built on this ROCm)")


def _hiprtc_call(fn: str, *args: object) -> tuple:
    return _call(_hiprtc(), fn, *args)


def _ok(result: tuple, what: str) -> tuple:
    """The values of a HIP or hiprtc call's result; HipError when its status is not success."""
    code, name = _hip._status(result[0])
    if code != 0:
        raise HipError(f"{what} returned {name} ({code})")
    return result[1:]
