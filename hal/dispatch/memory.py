"""Between selection and the route: can the call's results be allocated at all?

API.md: "a valid call whose result cannot be allocated raises UnsupportedError before allocating".
A call whose results alone exceed the memory its device has free would otherwise reach a kernel
that asks torch's allocator for them and fails with torch's ``RuntimeError`` (or, on the CPU, gets
the process killed by the kernel's out-of-memory killer). The results' sizes come from the op's
fake rule run on meta stand-ins of the arguments (nothing allocated; about 17 us on the CI machine,
paid once per input signature, since the decision is cached); the free memory is asked only when
the results are large (:data:`ASK_FROM_BYTES`): on the CPU what ``/proc/meminfo`` calls available,
bounded by the address-space limit of the process (``RLIMIT_AS``) where one is set, on a GPU what
the driver reports free plus what torch's caching allocator holds unused.

Besides the results, the dense copy of each broadcast input (a tensor whose view repeats elements
through a zero stride, as ``expand`` makes): a kernel that needs its input dense makes that copy,
as large as the view (torch's softmax of a (1, 8192) row expanded to 15730 rows asked for 1 GiB,
output and copy, where the results alone are 0.5 GiB). Kernels' other workspaces are not counted
(they are each kernel's own); a kernel that would need one beyond memory declines in its
capability check.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import numpy as np
import torch

from hal import arrays
from hal.errors import UnsupportedError
from hal.plugin import Inputs
from hal.registry import OpDecl
from hal.types import ARRAY_KINDS

from .adapt import map_outputs

#: results smaller than this are not compared with free memory (no file or driver is read for them)
ASK_FROM_BYTES = 256 << 20


def results_bytes(decl: OpDecl, inputs: Inputs) -> Optional[int]:
    """The bytes of the call's results by the op's fake rule (None: the op has none, or it could
    not run on meta stand-ins)."""
    if decl.fake is None:
        return None
    try:
        named = {p.name: _meta(a) if p.kind in ARRAY_KINDS else a for p, a in zip(decl.params, inputs.args)}
        out = decl.fake(named)
    except Exception:  # noqa: BLE001 - a fake rule that needs real data: no answer, not an error
        return None
    total = [0]

    def count(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            total[0] += t.numel() * t.element_size()
        return t

    map_outputs(out, count)
    return total[0]


def _meta(a: Any) -> Any:
    if isinstance(a, (list, tuple)):
        return type(a)(_meta(x) for x in a)
    if isinstance(a, torch.Tensor):
        return torch.empty_strided(tuple(a.shape), tuple(a.stride()), dtype=a.dtype, device="meta")
    if isinstance(a, np.ndarray):
        return torch.empty(a.shape, dtype=arrays.torch_dtype(arrays.dtype_name(a)), device="meta")
    return a


def free_bytes(inputs: Inputs) -> Optional[int]:
    """What the call's device has free for its results (None: not known)."""
    if inputs.device_kind == "cpu":
        return _host_free()
    device = inputs.device
    try:
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    except Exception:  # noqa: BLE001 - no answer from the driver: no check
        return None
    return int(free + max(0, cached))


def _host_free() -> Optional[int]:
    """MemAvailable of /proc/meminfo, bounded by the room left under RLIMIT_AS (Linux)."""
    free: Optional[int] = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
                    break
    except OSError:
        return None
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        if limit != resource.RLIM_INFINITY:
            with open("/proc/self/statm") as f:
                used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            room = max(0, limit - used)
            free = room if free is None else min(free, room)
    except (ImportError, OSError, ValueError):
        pass
    return free


def densified_bytes(inputs: Inputs) -> int:
    """The bytes of dense copies of the call's broadcast tensor inputs (module docstring)."""
    total = 0
    for a in inputs.args:
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, torch.Tensor) and any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride())):
                total += t.numel() * t.element_size()
    return total


def check(decl: OpDecl, inputs: Inputs) -> Optional[UnsupportedError]:
    """The error of a call whose results (and the dense copies of its broadcast inputs) cannot fit in
    its device's free memory (None: they can, or it cannot be told)."""
    results = results_bytes(decl, inputs)
    if results is None:
        return None
    need = results + densified_bytes(inputs)
    if need < ASK_FROM_BYTES:
        return None
    free = free_bytes(inputs)
    if free is None or need <= free:
        return None
    device = "cpu (numpy)" if inputs.array_type == "numpy" else str(inputs.device)
    copies = need - results
    what = f"its results need {_size(results)}" + (f" and dense copies of its broadcast inputs {_size(copies)}" if copies else "")
    return UnsupportedError(
        f"{decl.name}: {what} but {device} has {_size(free)} free; nothing was allocated. "
        "Split the call (a smaller batch or sequence), or free memory first."
    )


def _size(n: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"
