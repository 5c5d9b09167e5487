"""What the kernel-against-copy-bandwidth benchmarks share (``norm_backward_bw.py``,
``fp8_transpose_bw.py``): a row of one timed launch with its columns against a copy of as many
bytes, the CUDA plugin's kernel as the dispatcher calls it, and the run around the cases: refuse
without a GPU, let the autotuner tune into a fresh cache (so its pick is measured now), run the
cases, print the table, write the rows (JSON) and the cache file to ``--out``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch


@dataclasses.dataclass
class Row:
    """One timed launch of one case (a benchmark adds its check's columns)."""

    case: str
    launch: str
    us: float = float("nan")
    gbps: float = float("nan")
    copy_fraction: float = float("nan")
    spread: float = float("nan")
    ok: bool = True
    note: str = ""

    def timed(self, t: dict[str, float], nbytes: int, copy_bytes_per_s: float) -> "Row":
        """The row with ``hal_bench.timing.Timer``'s result ``t`` of a launch moving ``nbytes``."""
        self.us, self.spread = t["median_us"], t["spread"]
        self.gbps = nbytes / (self.us * 1e-6) / 1e9
        self.copy_fraction = nbytes / (self.us * 1e-6) / copy_bytes_per_s
        return self


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plugin_kernel(op: str) -> Callable[..., Any]:
    """The CUDA plugin's Triton kernel of ``op``, as the dispatcher calls it (a tuned kernel picks
    its launch on the first call of a problem)."""
    from hal_backend_cuda import plugin

    return next(k.fn for k in plugin.kernels if k.op == op and k.name == "triton")


def run(script: str, device: torch.device, cases: Iterable[Callable[[Any], list[Row]]], table: Callable[[list[Row], str], str],
        out: Optional[Path]) -> int:
    """Each of ``cases`` called with one ``Timer`` (every case's rows, checked and timed), the table
    printed, the rows and the autotune cache written to ``out``; the exit status: 0, 1 where a row
    failed its check, 2 without a GPU (nothing measured)."""
    if not torch.cuda.is_available():
        print(f"{script}: needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured", file=sys.stderr)
        return 2
    cache = Path(os.environ.setdefault("HAL_TRITON_CACHE_DIR", tempfile.mkdtemp(prefix=f"hal-{script}-")))
    from hal_bench.timing import Timer

    start = time.perf_counter()
    timer = Timer(device, budget_s=0.1)
    rows: list[Row] = []
    for case in cases:
        rows += case(timer)
        print(f"  ({time.perf_counter() - start:.0f} s)", flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    print(table(rows, name))
    print(f"total {time.perf_counter() - start:.0f} s; autotune cache in {cache}")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{script}.json").write_text(json.dumps({"device": name, "torch": torch.__version__,
                                                        "rows": [dataclasses.asdict(r) for r in rows]}, indent=1))
        for f in cache.glob("autotune-*.json"):
            (out / f.name).write_text(f.read_text())
    return 0 if all(r.ok for r in rows) else 1
