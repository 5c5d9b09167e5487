"""hal's reference backend: every op and its backward in NumPy, computed in float64.

It is the floor of CPU dispatch and the reference of the conformance suite, so it is written to be
read: one module per op family, each kernel the math of its op. Inputs arrive as NumPy arrays
(bfloat16 as ml_dtypes.bfloat16); kernels return arrays of the input dtype.
"""

from __future__ import annotations

import importlib
import platform

from hal.plugin import DeviceInfo, Plugin, family_names

__version__ = "0.1.0"

plugin = Plugin(name="cpu_ref", version=__version__, summary="NumPy reference (float64 math)")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"


def _devices() -> list[DeviceInfo]:
    name = _cpu_name()
    vendor = "Intel" if "Intel" in name else "AMD" if "AMD" in name else platform.machine()
    return [DeviceInfo(index=0, name=name, vendor=vendor, arch=platform.machine())]


plugin.define_backend(priority=0, device_types=("cpu",), devices=_devices, array_api="numpy")


def _import_families() -> None:
    """Import every family module, which registers its kernels on ``plugin``: the public modules on
    this package's ``__path__``, by name (a new family is a new file here; each op has one kernel,
    so the order changes nothing)."""
    for name in family_names(__path__):
        importlib.import_module(f"{__name__}.{name}")


_import_families()
