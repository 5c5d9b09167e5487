"""benchmarks/fp8_convergence.py at its tiny CPU size: the bfloat16 and FP8 runs of the Llama-style
decoder from the same seed on the same batches both learn, and their loss curves stay close step by
step (the H200 run at the full size checks the 1% target over 300 steps)."""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fp8_convergence.py"


def load():
    spec = importlib.util.spec_from_file_location("fp8_convergence", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_curves_fall_together_on_the_cpu(tmp_path):
    conv = load()
    out = tmp_path / "conv.json"
    assert conv.main(["--size", "cpu", "--steps", "30", "--device", "cpu", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    bf16, fp8 = result["runs"]["bfloat16"]["losses"], result["runs"]["fp8"]["losses"]
    assert len(bf16) == len(fp8) == 30 and all(map(torch.isfinite, torch.tensor(bf16 + fp8)))
    assert bf16[0] == fp8[0] or abs(bf16[0] - fp8[0]) < 1e-2  # same seed, same first batch
    for losses in (bf16, fp8):
        assert statistics.fmean(losses[-5:]) < 0.6 * statistics.fmean(losses[:3]), losses  # ln 64 = 4.16 -> ~1.9
    assert max(abs(a - b) for a, b in zip(bf16, fp8)) < 0.05 * bf16[0]
    assert abs(result["final_loss_ratio"] - 1) < 0.02
    assert result["runs"]["fp8"]["final_loss"] == statistics.fmean(fp8[-conv.TAIL:])
    assert result["learned"] and result["ln_vocab"] == math.log(64)  # both below 0.7 ln 64 = 2.91
