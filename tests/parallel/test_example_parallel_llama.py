"""examples/train_parallel_llama.py: 20 steps on 8 gloo ranks (dp 2 x tp 2 x pp 2, experts over dp x tp)
give the loss curve of the same model trained on one process (float64, to rounding).

The ranks start through ``hal.dist.launch`` (a fork server: seconds, not the minute 8 fresh
interpreters take on a small machine) and run the example's own training function. The script's
``torchrun`` entry is run too when ``HAL_TEST_TORCHRUN=1`` (slow here: 8 interpreters on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hal.dist.launch import launch

#: numba's parallel kernels (hal's CPU backend) in every rank would oversubscribe the cores: one thread each
ONE_THREAD = {"NUMBA_NUM_THREADS": "1"}

pytestmark = pytest.mark.timeout(400)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example():  # type: ignore[no-untyped-def]
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import train_parallel_llama

    return train_parallel_llama


def test_twenty_steps_on_eight_ranks_follow_one_process(seed: int) -> None:
    ex = _example()
    options = {"steps": 20, "dtype": "float64", "seed": seed % 10_000, "layers": 2}  # one block per stage: half the time
    results = launch(ex.train_rank, 8, (options,), timeout_s=360, env=ONE_THREAD)
    bad = [f"rank {r.rank}: {r.message}\n{r.traceback}" for r in results if not r.ok]
    assert not bad, f"HAL_TEST_SEED={seed}\n" + "\n".join(bad)
    want = ex.train_one_process(ex.Config(**options), log=False)
    print("one process:", [round(v, 4) for v in want])
    for r in results:
        assert len(r.value) == 20
        for step, (got, ref) in enumerate(zip(r.value, want)):
            assert abs(got - ref) <= 1e-9 * max(1.0, abs(ref)), f"rank {r.rank} step {step}: {got} vs {ref} (HAL_TEST_SEED={seed})"
    assert want[-1] < 0.6 * want[0], f"the loss should fall: {want}"


@pytest.mark.skipif(os.environ.get("HAL_TEST_TORCHRUN") != "1", reason="set HAL_TEST_TORCHRUN=1 to start 8 interpreters with torchrun")
def test_the_torchrun_entry(tmp_path: Path) -> None:
    ex = _example()
    out = tmp_path / "losses.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8",
           str(EXAMPLES / "train_parallel_llama.py"), "--steps", "3", "--dtype", "float64", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=380)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = json.loads(out.read_text())["losses"]
    want = ex.train_one_process(ex.Config(steps=3, dtype="float64"), log=False)
    assert got == pytest.approx(want, rel=1e-9)
