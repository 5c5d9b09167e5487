"""A runtime that runs kits/cpp kernels on the CPU: the same sources compiled by the host C++
compiler against hal_host.h, every block's threads as CPU threads (see that header).

For tests on machines without a GPU: it proves the kernels' numerics and indexing, with a warp of
32 lanes or a wavefront of 64, on CPU tensors. It is slow by design (thousands of threads per
launch), so inputs stay small. ``multiprocessors`` is small too, so that launches still spread over
several blocks and the cross-block merges run.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from .kit import CompileError, KernelSig

#: C types of the kit's parameter types, in the generated launch wrappers
_C_TYPES = {"ptr": "void*", "i32": "int", "i64": "long long", "f32": "float", "f64": "double"}


class HostRuntime:
    """Compile with ``$CXX`` (default g++) and run kernels on CPU threads; ``warp_size`` 32 or 64."""

    name = "host"
    code_suffix = ".so"

    def __init__(self, warp_size: int = 32, multiprocessors: int = 2, compiler: Optional[str] = None) -> None:
        self._warp = int(warp_size)
        self._sms = int(multiprocessors)
        self._cxx = compiler or os.environ.get("CXX", "g++")

    def unavailable_reason(self) -> Optional[str]:
        if shutil.which(self._cxx) is None:
            return f"no host C++ compiler ({self._cxx} is not on the PATH; apt-get install g++)"
        return None

    @functools.lru_cache(maxsize=None)
    def version(self) -> str:
        return subprocess.run([self._cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[0]

    def arch(self, device: Any) -> str:
        return f"host-w{self._warp}"

    def warp_size(self, device: Any) -> int:
        return self._warp

    def multiprocessors(self, device: Any) -> int:
        return self._sms

    def stream(self, device: Any) -> int:
        return 0

    def compile(self, text: str, filename: str, arch: str, defines: Mapping[str, str], kernels: Sequence[KernelSig]) -> bytes:
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / (Path(filename).stem + ".cpp")
            src.write_text(text + "\n" + "\n".join(_wrapper(k) for k in kernels))
            out = Path(tmp) / "module.so"
            # -O0: an emulated launch costs its threads, not its arithmetic; the tests wait on compiles
            cmd = [self._cxx, "-std=c++20", "-O0", "-shared", "-fPIC", "-pthread", "-w",
                   *(f"-D{k}={v}" for k, v in defines.items()), str(src), "-o", str(out)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise CompileError(f"{filename} did not compile for {arch}:\n{done.stderr[-6000:]}")
            return out.read_bytes()

    def load(self, path: Path, kernels: Sequence[KernelSig], device: Any) -> Mapping[str, Any]:
        lib = ctypes.CDLL(str(path))
        handles = {}
        for k in kernels:
            fn = getattr(lib, f"hal_host_launch_{k.name}")
            fn.argtypes = [ctypes.c_uint] * 6 + [ctypes.c_char_p]
            fn.restype = None
            handles[k.name] = fn
        handles["_lib"] = lib  # keeps the library loaded with its handles
        return handles

    def launch(self, handle: Any, grid: tuple[int, int, int], block: tuple[int, int, int], sig: KernelSig,
               values: tuple, device: Any) -> None:
        handle(*grid, *block, sig.pack(values))


def _wrapper(sig: KernelSig) -> str:
    """A C entry point that unpacks the kit's argument buffer and runs the kernel over a grid."""
    offset, lines = 0, []
    for i, kind in enumerate(sig.params):
        size = 8 if kind in ("ptr", "i64", "f64") else 4
        offset = (offset + size - 1) // size * size
        lines.append(f"  {_C_TYPES[kind]} a{i}; std::memcpy(&a{i}, args + {offset}, {size});")
        offset += size
    types = ", ".join(_C_TYPES[k] for k in sig.params)
    call = ", ".join(f"a{i}" for i in range(len(sig.params)))
    return (
        f'extern "C" void hal_host_launch_{sig.name}(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,'
        f" unsigned bz, const char* args) {{\n" + "\n".join(lines) + "\n"
        f"  auto fn = reinterpret_cast<void (*)({types})>(&{sig.name});\n"
        f"  hal::host::run(dim3{{gx, gy, gz}}, dim3{{bx, by, bz}}, [&] {{ fn({call}); }});\n}}\n"
    )
