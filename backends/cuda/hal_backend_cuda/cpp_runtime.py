"""The CUDA runtime of kits/cpp: NVRTC through CuPy compiles the kit's sources to cubins for the
device's architecture (``sm_90`` on an H200), ``cupy.RawModule`` loads them, and kernels launch on
torch's current stream (``cupy.cuda.ExternalStream``) with the tensors' device addresses (no copies).

CuPy is optional: without it the plugin still loads and every "cpp" kernel rejects with the reason
below, so the dispatcher picks the plugin's Triton and torch kernels. Nothing here imports CuPy
before a kernel is checked or launched.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch

from hal_cpp import CompileError, KernelSig

#: numpy scalar types of the kit's parameter types (CuPy passes them by value)
_NUMPY = {"ptr": "uint64", "i32": "int32", "i64": "int64", "f32": "float32", "f64": "float64"}


class CupyRuntime:
    """kits/cpp's :class:`hal_cpp.Runtime` for NVIDIA GPUs."""

    name = "nvrtc"
    code_suffix = ".cubin"

    @functools.lru_cache(maxsize=None)
    def unavailable_reason(self) -> Optional[str]:
        try:
            import cupy  # noqa: F401
            from cupy.cuda import nvrtc

            nvrtc.getVersion()
        except ImportError:
            return "cupy is not installed: pip install cupy-cuda12x/13x (the one matching torch.version.cuda)"
        except Exception as exc:  # a CuPy that cannot find NVRTC or the driver
            return f"cupy cannot compile kernels here: {type(exc).__name__}: {exc}"
        return None

    @functools.lru_cache(maxsize=None)
    def version(self) -> str:
        from cupy.cuda import nvrtc

        major, minor = nvrtc.getVersion()
        return f"nvrtc {major}.{minor}"

    def arch(self, device: Any) -> str:
        major, minor = _capability(_index(device))
        return f"sm_{major}{minor}"

    def warp_size(self, device: Any) -> int:
        return 32

    def multiprocessors(self, device: Any) -> int:
        return _multiprocessors(_index(device))

    def stream(self, device: Any) -> int:
        return int(torch.cuda.current_stream(device).cuda_stream)

    def compile(self, text: str, filename: str, arch: str, defines: Mapping[str, str], kernels: Sequence[KernelSig]) -> bytes:
        """A cubin of ``text`` for ``arch`` (needs NVRTC only, no GPU)."""
        from cupy.cuda import nvrtc

        options = (f"-arch={arch}", "-std=c++17", *(f"-D{k}={v}" for k, v in defines.items()))
        prog = nvrtc.createProgram(text, filename, (), ())
        try:
            try:
                nvrtc.compileProgram(prog, options)
            except nvrtc.NVRTCError as exc:
                raise CompileError(f"{filename} did not compile for {arch} ({exc}):\n{nvrtc.getProgramLog(prog)}") from None
            return bytes(nvrtc.getCUBIN(prog))
        finally:
            nvrtc.destroyProgram(prog)

    def load(self, path: Path, kernels: Sequence[KernelSig], device: Any) -> Mapping[str, Any]:
        import cupy

        with _cupy_device(_index(device)):
            module = cupy.RawModule(path=str(path))
            return {k.name: module.get_function(k.name) for k in kernels}

    def launch(self, handle: Any, grid: tuple[int, int, int], block: tuple[int, int, int], sig: KernelSig,
               values: tuple, device: Any) -> None:
        args = tuple(convert(v) for convert, v in zip(_converters(sig), values))
        index = _index(device)
        with _cupy_device(index), _external_stream(self.stream(device), index):  # the launch's stream
            handle(grid, block, args)


@functools.lru_cache(maxsize=None)
def _converters(sig: KernelSig) -> tuple:
    """numpy scalar types of a kernel's parameters, in order."""
    import numpy

    return tuple(getattr(numpy, _NUMPY[k]) for k in sig.params)


def _index(device: Any) -> int:
    if isinstance(device, torch.device) and device.index is not None:
        return device.index
    return torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))  # type: ignore[return-value]


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


@functools.lru_cache(maxsize=None)
def _cupy_device(index: int) -> Any:
    import cupy

    return cupy.cuda.Device(index)


@functools.lru_cache(maxsize=64)
def _external_stream(handle: int, index: int) -> Any:
    """torch's stream as a CuPy stream (ExternalStream: CuPy 13 and 14; deprecated in 14)."""
    import warnings

    import cupy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(handle, index)
