"""The one device of the CPU backend: this machine's processor, with the vector ISA torch uses."""

from __future__ import annotations

import functools
import os
import platform
import re
from typing import Optional

import torch

from hal.plugin import DeviceInfo


@functools.lru_cache(maxsize=None)
def _cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def _model_name() -> str:
    found = re.search(r"^model name\s*:\s*(.+)$", _cpuinfo(), re.MULTILINE)
    return found.group(1).strip() if found else (platform.processor() or platform.machine())


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """The ISA flags of the first processor in /proc/cpuinfo (empty where there is none)."""
    found = re.search(r"^flags\s*:\s*(.+)$", _cpuinfo(), re.MULTILINE)
    return frozenset(found.group(1).split()) if found else frozenset()


#: ISA extensions oneDNN's half-precision primitives need (any one group of them), as torch says
#: when it refuses: bfloat16 "needs the cpu support avx512bw, avx512vl and avx512dq" (or the
#: AVX-NE-CONVERT of newer cores), float16 "avx_ne_convert or avx512_fp16".
ONEDNN_ISA = {
    "bfloat16": ({"avx512bw", "avx512vl", "avx512dq"}, {"avx_ne_convert"}),
    "float16": ({"avx512_fp16"}, {"avx_ne_convert"}),
}


def onednn_dtype_reason(dtype: str) -> Optional[str]:
    """Why oneDNN cannot run ``dtype`` on this CPU (None when it can)."""
    groups = ONEDNN_ISA.get(dtype)
    if groups is None or any(g <= cpu_flags() for g in groups):
        return None
    need = " or ".join("+".join(sorted(g)) for g in groups)
    return f"oneDNN's {dtype} primitives need {need}, which this CPU lacks"


def devices() -> list[DeviceInfo]:
    """One DeviceInfo; arch is the machine and the CPU capability torch dispatches to (AVX512 ...)."""
    name = _model_name()
    vendor = next((v for v in ("Intel", "AMD", "Apple") if v in name), platform.machine())
    arch = f"{platform.machine()}, {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores"
    return [DeviceInfo(index=0, name=name, vendor=vendor, arch=arch)]
