"""numba's thread pool and torch's intra-op thread count, in fresh interpreters (numba starts its
pool once per process): a numba kernel leaves torch's setting as the user made it, so the CPU's
tune cache (its device slug holds torch's thread count) stays one file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("numba")

CODE = """
import json, sys
import numpy as np, torch, hal
torch.set_num_threads(1)
seed = int(sys.argv[1])
rng = np.random.default_rng(seed)
x = rng.standard_normal((48, 96), dtype=np.float32)
w = rng.standard_normal(96, dtype=np.float32)
counts = [torch.get_num_threads()]
with hal.use(kernel={"rms_norm": "numba"}):
    forced = hal.ops.rms_norm(x, (96,), w, 1e-6)
counts.append(torch.get_num_threads())
tuned = hal.ops.rms_norm(x, (96,), w, 1e-6)          # measured: numba against torch
counts.append(torch.get_num_threads())
x64 = x.astype(np.float64)
want = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-6) * w
error = max(float(np.abs(forced - want).max()), float(np.abs(tuned - want).max()))
print(json.dumps({"counts": counts, "error": error, "types": [type(forced).__name__, type(tuned).__name__]}))
"""


def test_a_numba_kernel_leaves_torchs_thread_count_and_one_tune_cache_file(tmp_path: Path, rng: np.random.Generator) -> None:
    """Before: torch.set_num_threads(1), then a numba rms_norm on NumPy arrays, and torch read 2
    threads (numba's OpenMP layer set every core when it started its pool), and the process wrote
    two tune-cache files, cpu-...-1t and cpu-...-2t."""
    env = {**os.environ, "HAL_TUNE": "on", "HAL_TUNE_CACHE": str(tmp_path / "tune")}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(CODE), str(int(rng.integers(2**31)))], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["counts"] == [1, 1, 1]
    assert result["types"] == ["ndarray", "ndarray"] and result["error"] < 1e-4
    files = sorted(p.name for p in (tmp_path / "tune").glob("*.json"))
    assert len(files) == 1 and files[0].split("-")[-2] == "1t", files
