"""The kit's machinery: kernel sources and signatures, the runtime protocol, compiled modules cached
per architecture on disk, and launches with marshalled arguments.

A runtime (CUDA through CuPy/NVRTC, ROCm through hiprtc, the CPU emulation of the tests) brings four
things: ``compile`` (one self-contained translation unit to a code object, as bytes), ``load`` (a
code object file to launchable handles), ``launch`` (a handle on a device's current stream with
marshalled arguments) and a few device facts (architecture name, warp size, multiprocessors). The
kit does the rest: sources made self-contained, cache keys, the disk cache, argument marshalling.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import struct
import tempfile
import threading
from pathlib import Path
from typing import Any, Mapping, Optional, Protocol, Sequence

import torch

ROOT = Path(__file__).resolve().parent
INCLUDE_DIR = ROOT / "include"
KERNEL_DIR = ROOT / "kernels"

#: C parameter types of kernel signatures and their struct-module codes (natural alignment)
PARAM_FORMATS = {"ptr": "Q", "i32": "i", "i64": "q", "f32": "f", "f64": "d"}


@dataclasses.dataclass(frozen=True)
class KernelSig:
    """An ``extern "C"`` kernel: its name and the C types of its parameters, in order."""

    name: str
    params: tuple[str, ...]

    def __post_init__(self) -> None:
        unknown = set(self.params) - set(PARAM_FORMATS)
        if unknown:
            raise ValueError(f"kernel {self.name}: unknown parameter types {sorted(unknown)} (use {sorted(PARAM_FORMATS)})")
        object.__setattr__(self, "_convert", tuple(_CONVERT[k] for k in self.params))  # launch paths: no branching per type
        object.__setattr__(self, "_struct", struct.Struct("@" + "".join(PARAM_FORMATS[k] for k in self.params)))

    def marshal(self, args: Sequence[Any]) -> tuple:
        """Python values of the arguments: tensors become their device addresses, None a null pointer,
        numbers the parameter's type."""
        if len(args) != len(self.params):
            raise TypeError(f"kernel {self.name} takes {len(self.params)} arguments, got {len(args)}")
        return tuple([f(a) for f, a in zip(self._convert, args)])

    def pack(self, values: Sequence[Any]) -> bytes:
        """Marshalled values laid out as the C parameter list (each aligned to its size), for
        runtimes that take one argument buffer (HIP's ``extra``, the CPU emulation)."""
        return self._struct.pack(*values)


def _address(a: Any) -> int:
    return 0 if a is None else a if isinstance(a, int) else int(a.data_ptr())


_CONVERT = {"ptr": _address, "i32": int, "i64": int, "f32": float, "f64": float}


def _sig(name: str, params: str) -> KernelSig:
    return KernelSig(name, tuple(params.split()))


_BN_STATS = "ptr ptr ptr ptr ptr ptr ptr ptr ptr i32 i64 i32 i64 i64 f64 f64 f64 i32"
_BN_BWD_STATS = "ptr ptr ptr ptr ptr ptr ptr ptr ptr ptr ptr i32 i64 i32 i64 i64 f64 f64 i32"
_BN_APPLY = "ptr ptr ptr ptr i64 i32 i64 i64 i32"


@dataclasses.dataclass(frozen=True)
class Source:
    """A kernel source file of kits/cpp/kernels, the defines that pick one of its modules, and the
    kernels every module of it holds."""

    file: str
    defines: tuple[str, ...]
    kernels: tuple[KernelSig, ...]

    def text(self) -> str:
        """The source as one translation unit: kits/cpp/include headers inlined once each, so that
        no compiler needs an include path."""
        return _inline(KERNEL_DIR / self.file, set())


SOURCES: dict[str, Source] = {
    "batchnorm": Source(
        "batchnorm.cu",
        ("HAL_T", "HAL_VEC"),
        tuple(_sig(f"bn_{kind}_{layout}", params) for kind, params in (("stats", _BN_STATS), ("bwd_stats", _BN_BWD_STATS),
                                                                        ("apply", _BN_APPLY), ("bwd_apply", _BN_APPLY))
              for layout in ("rows", "planes"))
        + (_sig("bn_eval_params", "ptr ptr ptr ptr ptr ptr i32 i32 f64"),),
    ),
    "norm": Source(
        "norm.cu",
        ("HAL_T", "HAL_VEC"),
        (_sig("norm_bwd", "ptr ptr ptr ptr i32 ptr i64 i32 f64 i64 i32"), _sig("norm_bwd_columns", "ptr i32 i32 ptr ptr i32")),
    ),
    "adamw": Source(
        "adamw.cu",
        ("HAL_P", "HAL_G", "HAL_S"),
        (_sig("adamw_step", "ptr ptr i64 ptr ptr ptr f64 f64 f64 f64 f64 f64 f64 f64 i32"),),
    ),
}

#: C storage types of torch dtype names (the HAL_T / HAL_P / HAL_G / HAL_S defines)
C_TYPES = {"float16": "hal::f16", "bfloat16": "hal::bf16", "float32": "float", "float64": "double"}
#: dtype codes of per-channel parameters read at run time (hal_cpp.cuh's enum DType)
DTYPE_CODES = {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3}
#: hal's names of the torch dtypes the kernels take
DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float64: "float64"}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)

#: the variants CI compiles: every kernel of every source, each dtype's vector path and a scalar one
VARIANTS: dict[str, tuple[dict[str, str], ...]] = {
    "batchnorm": tuple({"HAL_T": C_TYPES[d], "HAL_VEC": str(v)} for d, v in
                       (("bfloat16", 8), ("float16", 1), ("float32", 4), ("float64", 2))),
    "norm": tuple({"HAL_T": C_TYPES[d], "HAL_VEC": str(v)} for d, v in
                  (("bfloat16", 8), ("float16", 1), ("float32", 4), ("float64", 2))),
    "adamw": tuple({"HAL_P": C_TYPES[p], "HAL_G": C_TYPES[g], "HAL_S": C_TYPES[s]} for p, g, s in
                   (("bfloat16", "bfloat16", "float32"), ("bfloat16", "float32", "float32"), ("float16", "float16", "float16"),
                    ("float32", "float32", "float32"), ("float64", "float64", "float64"))),
}


def _inline(path: Path, seen: set[Path]) -> str:
    lines = []
    for line in path.read_text().splitlines():
        if line.strip() == "#pragma once":  # each header is inlined once anyway
            continue
        m = re.match(r'\s*#include "([^"]+)"', line)
        if m:
            header = INCLUDE_DIR / m.group(1)
            if header not in seen:
                seen.add(header)
                lines.append(_inline(header, seen))
            continue
        lines.append(line)
    return "\n".join(lines) + "\n"


class Runtime(Protocol):
    """What a vendor runtime gives the kit (see the module docstring)."""

    #: names the cache folder and the toolchain: "nvrtc", "hiprtc", "host"
    name: str
    #: file suffix of its code objects in the cache (".cubin", ".hsaco", ".so")
    code_suffix: str

    def unavailable_reason(self) -> Optional[str]:
        """Why kernels cannot run through this runtime here (None when they can)."""

    def version(self) -> str:
        """The toolchain's version, part of every cache key."""

    def arch(self, device: Any) -> str:
        """The architecture to compile for: "sm_90", "gfx90a" ..."""

    def warp_size(self, device: Any) -> int: ...

    def multiprocessors(self, device: Any) -> int: ...

    def stream(self, device: Any) -> int:
        """The handle of the device's current stream (kernels of one stream run in order)."""

    def compile(self, text: str, filename: str, arch: str, defines: Mapping[str, str], kernels: Sequence[KernelSig]) -> bytes:
        """A code object of ``text`` for ``arch``; raises CompileError with the compiler's log."""

    def load(self, path: Path, kernels: Sequence[KernelSig], device: Any) -> Mapping[str, Any]:
        """Launchable handles on ``device``, by kernel name, of the code object file at ``path``."""

    def launch(self, handle: Any, grid: tuple[int, int, int], block: tuple[int, int, int], sig: KernelSig,
               values: tuple, device: Any) -> None:
        """Launch on ``device``'s current stream with marshalled ``values``."""


class CompileError(RuntimeError):
    """A kernel source did not compile; the message holds the compiler's log."""


def cache_dir() -> Path:
    """Where compiled code objects live: $HAL_CPP_CACHE_DIR, else ~/.cache/hal/cpp."""
    env = os.environ.get("HAL_CPP_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "hal" / "cpp"


def _prepare(runtime: Runtime, source: str, arch: str, defines: Mapping[str, str], warp_size: int) -> tuple[str, dict[str, str], str]:
    """(translation unit, every define, cache key) of one module of ``source``."""
    src = SOURCES[source]
    missing = set(src.defines) - set(defines)
    if missing:
        raise ValueError(f"source {source} needs the defines {sorted(missing)}")
    full = {**defines, "HAL_WARP_SIZE": str(warp_size)}
    text = src.text()
    key = hashlib.sha256(repr((text, arch, sorted(full.items()), runtime.name, runtime.version())).encode()).hexdigest()[:20]
    return text, full, key


def compile_source(runtime: Runtime, source: str, arch: str, defines: Mapping[str, str], warp_size: int) -> bytes:
    """A code object of one module of ``source`` for ``arch`` through ``runtime``'s compiler; no
    device is needed (CI compiles every kernel this way)."""
    text, full, _ = _prepare(runtime, source, arch, defines, warp_size)
    src = SOURCES[source]
    return runtime.compile(text, src.file, arch, full, src.kernels)


class Kernel:
    """A launchable kernel of a loaded module."""

    __slots__ = ("_runtime", "_handle", "sig")

    def __init__(self, runtime: Runtime, handle: Any, sig: KernelSig) -> None:
        self._runtime, self._handle, self.sig = runtime, handle, sig

    def __call__(self, grid: Sequence[int], block: int, *args: Any, device: Any) -> None:
        """Launch a grid of 1-3 dimensions (Python ints) of ``block`` threads with ``args``."""
        g = (*grid, 1, 1) if len(grid) == 1 else (*grid, 1) if len(grid) == 2 else tuple(grid)
        self._runtime.launch(self._handle, g, (block, 1, 1), self.sig, self.sig.marshal(args), device)


class KernelModule:
    """One source compiled for one architecture and one set of defines, loaded: ``module[name]`` is
    a :class:`Kernel`. Code objects are cached on disk per runtime and architecture."""

    def __init__(self, runtime: Runtime, source: str, device: Any, defines: Mapping[str, str]) -> None:
        self.source = SOURCES[source]
        arch, warp_size = runtime.arch(device), runtime.warp_size(device)
        text, full, key = _prepare(runtime, source, arch, defines, warp_size)
        folder = cache_dir() / f"{runtime.name}-{arch}"
        path = folder / f"{Path(self.source.file).stem}-{key}{runtime.code_suffix}"
        handles = None
        if path.is_file():
            try:
                handles = runtime.load(path, self.source.kernels, device)
            except Exception:  # a truncated or foreign file: rebuild it
                handles = None
        if handles is None:
            code = runtime.compile(text, self.source.file, arch, full, self.source.kernels)
            path = _write(folder, path.name, code)
            handles = runtime.load(path, self.source.kernels, device)
        self._kernels = {sig.name: Kernel(runtime, handles[sig.name], sig) for sig in self.source.kernels}

    def __getitem__(self, name: str) -> Kernel:
        return self._kernels[name]


def _write(folder: Path, name: str, code: bytes) -> Path:
    """Write a code object atomically into the cache (a private temporary folder when the cache
    cannot be written); returns its path."""
    for target in (folder, Path(tempfile.gettempdir()) / f"hal-cpp-{os.getuid()}" / folder.name):
        try:
            target.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(code)
            os.replace(tmp, target / name)
            return target / name
        except OSError:
            continue
    raise CompileError(f"could not write a compiled kernel into {folder} or the temporary folder (set HAL_CPP_CACHE_DIR)")


class Kit:
    """A runtime's modules (compiled and loaded on first use, per device architecture and defines)
    and per-stream scratch: the zeroed completion counters of the reductions."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._modules: dict[tuple, KernelModule] = {}
        self._counters: dict[tuple, Any] = {}
        self._lock = threading.Lock()

    def module(self, source: str, device: Any, **defines: str) -> KernelModule:
        key = (source, device, tuple(defines.items()))
        mod = self._modules.get(key)
        if mod is None:  # compiled outside the lock: several modules may build at once
            mod = KernelModule(self.runtime, source, device, defines)
            with self._lock:
                mod = self._modules.setdefault(key, mod)
        return mod

    def counters(self, device: Any, n: int) -> Any:
        """At least n int32 counters, zero between launches, for kernels on the current stream of
        ``device`` (each reduction's last block resets the counters it used)."""
        key = (str(device), self.runtime.stream(device))
        buf = self._counters.get(key)
        if buf is None or buf.numel() < n:
            buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
            self._counters[key] = buf
        return buf
