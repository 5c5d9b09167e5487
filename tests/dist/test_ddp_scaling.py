"""benchmarks/ddp_scaling.py on 2 gloo ranks (tiny models, a step each): its rank function runs every
variant, and hal's comm hooks reduce DDP's gradients as DDP's own all-reduce does (compressed: within
the documented rounding bound)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from tests.dist.workers import compressed_bound

pytestmark = pytest.mark.timeout(120)

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "ddp_scaling.py"


def _load() -> ModuleType:
    """The script as module ``ddp_scaling`` (registered, so that the ranks can import its rank function)."""
    spec = importlib.util.spec_from_file_location("ddp_scaling", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["ddp_scaling"] = module
    spec.loader.exec_module(module)
    return module


def test_ddp_scaling_ranks_run_and_hal_hooks_match_ddp(seed: int) -> None:
    script = _load()
    cfg = {
        "models": list(script.MODELS), "variants": list(script.VARIANTS), "size": "tiny", "device": "cpu",
        "seed": seed % 2**31, "warmup": 1, "steps": 1, "rounds": 2, "threads": 1, "record": True,
    }
    results = script.measure(2, cfg, timeout_s=100)
    for name in cfg["models"]:
        entries = [r["models"][name] for r in results]
        for e in entries:
            for v in cfg["variants"]:
                assert len(e["times"][v]) == 2 and all(math.isfinite(t) and t > 0 for t in e["times"][v]), (name, v, e["times"])
        local = [[g.double().numpy() for g in e["local"]] for e in entries]  # per rank, per parameter
        assert any(not np.allclose(a, b) for a, b in zip(*local)), f"{name}: both ranks drew the same batch"
        for e in entries:
            grads = {v: [g.double().numpy() for g in e["grads"][v]] for v in cfg["variants"]}
            for i, ref in enumerate(grads["ddp"]):
                mine = [rank[i] for rank in local]
                np.testing.assert_allclose(ref, np.mean(mine, 0), rtol=1e-5, atol=1e-7, err_msg=f"{name} ddp param {i}")
                np.testing.assert_allclose(grads["hal_auto"][i], ref, rtol=1e-5, atol=1e-7, err_msg=f"{name} hal_auto param {i}")
                err = np.abs(grads["hal_fp16"][i] - np.mean(mine, 0))
                bound = compressed_bound(mine, 2.0**-11, avg=True)
                assert np.all(err <= bound), f"{name} hal_fp16 param {i}: {int((err > bound).sum())} elements beyond the bound"
                # the peer reduces the same gradients (fp16 sums, no pre-scaling: subnormal steps of 2**-24)
                err = np.abs(grads["torch_fp16"][i] - np.mean(mine, 0))
                assert np.all(err <= compressed_bound(mine, 2.0**-11, avg=True) + 3 * 2.0**-24), f"{name} torch_fp16 param {i}"
        for v in cfg["variants"]:  # every rank ends with the same average
            for a, b in zip(entries[0]["grads"][v], entries[1]["grads"][v]):
                assert torch.equal(a, b), (name, v)
    text = script.table({2: results[0]}, cfg, cores=2)
    for v in cfg["variants"]:
        assert f"\n{v:<11}     2" in text, text
