"""The HIP runtime through AMD's ``hip-python`` bindings: device count and device properties.

hip-python imports without ROCm and opens ``libamdhip64.so`` on its first call (it looks in
``$ROCM_PATH/lib`` or ``/opt/rocm/lib``, then asks the system loader). Everything here turns the
three ways that can go wrong into values the probe can phrase: the bindings are not installed, the
runtime library cannot be loaded, or a call returns an error code. Nothing here runs at import.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from types import ModuleType
from typing import Optional

#: hipErrorNoDevice, what hipGetDeviceCount answers on a machine with the runtime and no GPU
HIP_ERROR_NO_DEVICE = 100


class HipUnavailable(Exception):
    """The HIP runtime cannot be reached; the message says why and what to do."""


@dataclasses.dataclass(frozen=True)
class DeviceCount:
    """What ``hipGetDeviceCount`` answered: its status code, the code's name, and the count."""

    status: int
    status_name: str
    count: int


@dataclasses.dataclass(frozen=True)
class DeviceProperties:
    """The facts of one device that the plugin uses, as ``hipGetDeviceProperties`` reports them."""

    name: str
    gcn_arch_name: str  # "gfx90a:sramecc+:xnack-"
    compute_units: int
    total_memory: int
    wavefront_size: int
    lds_per_block: int


@functools.lru_cache(maxsize=None)
def bindings() -> ModuleType:
    """hip-python's ``hip`` module (HipUnavailable when the package is missing)."""
    try:
        from hip import hip
    except ImportError as exc:
        raise HipUnavailable(
            f"hip-python is not installed ({exc}): pip install hip-python (the release matching your ROCm, "
            "for ROCm 6.2: pip install 'hip-python~=6.2.0')"
        ) from None
    return hip


def _call(fn_name: str, *args: object) -> tuple:
    """Call a HIP function; HipUnavailable when its library cannot be opened (hip-python raises
    RuntimeError from its lazy loader then)."""
    hip = bindings()
    try:
        return getattr(hip, fn_name)(*args)
    except RuntimeError as exc:
        raise HipUnavailable(
            f"the ROCm runtime library could not be loaded: {plain(exc)}; install ROCm's HIP runtime (libamdhip64.so in "
            "/opt/rocm/lib or $ROCM_PATH/lib) or put the folder holding it on LD_LIBRARY_PATH"
        ) from None


def plain(exc: BaseException) -> str:
    """An exception's message with the bytes reprs hip-python's loader puts in it undone
    ("failed to dlopen 'b'/x.so''" -> "failed to dlopen '/x.so'")."""
    return re.sub(r"b'([^']*)'", r"\1", str(exc))


def _status(err: object) -> tuple[int, str]:
    code = int(err)  # type: ignore[call-overload]
    return code, getattr(err, "name", f"hipError {code}")


def device_count() -> DeviceCount:
    """``hipGetDeviceCount`` as it answers here (hipErrorNoDevice with count 0 on a machine
    without an AMD GPU)."""
    err, count = _call("hipGetDeviceCount")
    code, name = _status(err)
    return DeviceCount(code, name, int(count) if code == 0 else 0)


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, (bytes, bytearray)) else str(value)


def device_properties(index: int) -> DeviceProperties:
    """``hipGetDeviceProperties`` of device ``index`` (HipUnavailable on an error code)."""
    err, props = _call("hipGetDeviceProperties", index)
    code, name = _status(err)
    if code != 0:
        raise HipUnavailable(f"hipGetDeviceProperties({index}) returned {name}")
    return DeviceProperties(
        name=_text(props.name).strip(),
        gcn_arch_name=_text(props.gcnArchName).strip(),
        compute_units=int(props.multiProcessorCount),
        total_memory=int(props.totalGlobalMem),
        wavefront_size=int(props.warpSize),
        lds_per_block=int(props.sharedMemPerBlock),
    )


def runtime_problem() -> Optional[str]:
    """Why HIP cannot serve a device here (None when hipGetDeviceCount finds one or more)."""
    try:
        found = device_count()
    except HipUnavailable as exc:
        return str(exc)
    if found.status == HIP_ERROR_NO_DEVICE:
        return f"no ROCm device: hipGetDeviceCount returned {found.status_name}"
    if found.status != 0:
        return f"no ROCm device: hipGetDeviceCount returned {found.status_name} ({found.status})"
    if found.count == 0:
        return "no ROCm device: hipGetDeviceCount found none (check HIP_VISIBLE_DEVICES and ROCR_VISIBLE_DEVICES)"
    return None
