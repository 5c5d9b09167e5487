"""The full conformance suite of the cpu backend against cpu_ref: every op, every kernel forced in
turn, every dtype and case, on a fresh seed per run (printed; HAL_TEST_SEED pins it). About 30 s
on the project's 2-core machine once numba's cache is warm, plus about a minute of compilation on a
clean checkout."""

from __future__ import annotations

import os

import numpy as np

from hal.conformance.runner import Suite


def test_full_conformance_of_the_cpu_backend() -> None:
    seed = int(os.environ.get("HAL_TEST_SEED", np.random.SeedSequence().entropy % 2**31))
    print(f"seed={seed}")
    suite = Suite("cpu", seed=seed)
    results = suite.run(suite.plan())
    bad = [str(r) for r in results if r.unexpected]
    assert not bad, f"{len(bad)} unexpected results (seed {seed}):\n" + "\n".join(bad[:20])
    ran = {(r.op, r.kernel) for r in results if r.status == "pass"}
    assert ("scale_shift_act", "numba") in ran and ("fused_conv_bn_relu", "onednn") in ran, "the fused kernels must run, not only skip"
