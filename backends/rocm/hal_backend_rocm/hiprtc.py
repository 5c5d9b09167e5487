"""Run-time compilation of HIP C++ with hiprtc, through hip-python, for an AMD GPU architecture.

``compile_source(source, "gfx90a")`` returns the code object (an ELF for ``amdgcn-amd-amdhsa``, what
``hipModuleLoadData`` takes) and hiprtc's log; :func:`for_device` compiles for a device's own
gcnArchName (target features included, "gfx90a:sramecc+:xnack-") and keeps the result per device
and source, so each kernel compiles once per process and device. Headers are given by name and text
(the portable header of hal's C++ kernels), never read from include paths.

hiprtc is opened on the first compilation (``libhiprtc.so``, found as hip-python finds the HIP
runtime). Nothing happens at import.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping, Optional, Sequence

import torch

from ._device import properties
from ._hip import plain


class HiprtcError(RuntimeError):
    """A compilation failed, or hiprtc cannot be reached; ``log`` holds hiprtc's log (may be empty)."""

    def __init__(self, message: str, log: str = "") -> None:
        super().__init__(f"{message}\n{log}".rstrip())
        self.log = log


@dataclasses.dataclass(frozen=True)
class CodeObject:
    """A compiled program: the architecture it was built for, its code object and hiprtc's log."""

    arch: str
    code: bytes
    log: str


def _hiprtc():
    try:
        from hip import hiprtc
    except ImportError as exc:
        raise HiprtcError(f"hip-python is not installed ({exc}): pip install hip-python") from None
    return hiprtc


def _check(result: tuple, what: str, log: str = "") -> tuple:
    status = result[0]
    if int(status) != 0:
        raise HiprtcError(f"{what} returned {getattr(status, 'name', status)}", log)
    return result[1:]


def _call(hiprtc, fn: str, *args: object) -> tuple:
    try:
        return getattr(hiprtc, fn)(*args)
    except RuntimeError as exc:  # hip-python's lazy loader could not open libhiprtc.so
        raise HiprtcError(f"the hiprtc library could not be loaded: {plain(exc)}; install ROCm's hiprtc (libhiprtc.so) "
                          "or put the folder holding it on LD_LIBRARY_PATH") from None


def compile_source(source: str, arch: str, *, name: str = "kernel.hip", options: Sequence[str] = (),
                   headers: Optional[Mapping[str, str]] = None) -> CodeObject:
    """Compile HIP C++ ``source`` for ``arch`` ("gfx90a", or a full gcnArchName); raises
    :class:`HiprtcError` with the log when it does not compile."""
    hiprtc = _hiprtc()
    heads = dict(headers or {})
    # hiprtc may read these buffers until the compilation ends: they stay referenced here until then
    text, label = source.encode(), name.encode()
    head_texts, head_names = [t.encode() for t in heads.values()], [n.encode() for n in heads]
    flags = [f"--offload-arch={arch}".encode(), *(o.encode() for o in options)]
    (prog,) = _check(_call(hiprtc, "hiprtcCreateProgram", text, label, len(heads), head_texts, head_names), "hiprtcCreateProgram")
    try:
        compiled = _call(hiprtc, "hiprtcCompileProgram", prog, len(flags), flags)
        (size,) = _check(_call(hiprtc, "hiprtcGetProgramLogSize", prog), "hiprtcGetProgramLogSize")
        buf = bytearray(size)
        _check(_call(hiprtc, "hiprtcGetProgramLog", prog, buf), "hiprtcGetProgramLog")
        log = bytes(buf).rstrip(b"\0").decode(errors="replace")
        _check(compiled, f"hiprtcCompileProgram of {name} for {arch}", log)
        (size,) = _check(_call(hiprtc, "hiprtcGetCodeSize", prog), "hiprtcGetCodeSize")
        code = bytearray(size)
        _check(_call(hiprtc, "hiprtcGetCode", prog, code), "hiprtcGetCode")
        return CodeObject(arch, bytes(code), log)
    finally:
        _call(hiprtc, "hiprtcDestroyProgram", prog.createRef())  # it takes the address of the handle


def for_device(device: torch.device, source: str, *, name: str = "kernel.hip", options: Sequence[str] = (),
               headers: Optional[Mapping[str, str]] = None) -> CodeObject:
    """``source`` compiled for ``device``'s gcnArchName, once per process, device model and source."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    heads = tuple(sorted((headers or {}).items()))
    return _cached(properties(index).gcn_arch_name, source, name, tuple(options), heads)


@functools.lru_cache(maxsize=256)
def _cached(arch: str, source: str, name: str, options: tuple[str, ...], headers: tuple) -> CodeObject:
    return compile_source(source, arch, name=name, options=options, headers=dict(headers))
