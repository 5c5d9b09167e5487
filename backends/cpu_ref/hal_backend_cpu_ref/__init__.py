"""hal's reference backend: every op and its backward in NumPy, computed in float64.

It is the floor of CPU dispatch and the reference of the conformance suite, so it is written to be
read: one module per op family, each kernel the math of its op. Inputs arrive as NumPy arrays
(bfloat16 as ml_dtypes.bfloat16); kernels return arrays of the input dtype.
"""

from __future__ import annotations

import platform

from hal.plugin import DeviceInfo, Plugin

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

# Importing the families registers their kernels on `plugin`.
from . import attention, conv, elementwise, fp8, gemm, loss, mixed_precision, norm, quant, transformer  # noqa: E402,F401
