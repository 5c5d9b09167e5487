"""Helpers of the conformance suite's own tests: test-only backends and running the suite."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
from hal.conformance.runner import Result, Suite
from hal_backend_cpu_ref.attention import softmax as ref_softmax

from hal.plugin import DeviceInfo, Plugin


def make_backend(name: str = "buggy") -> Plugin:
    """A CPU backend plugin below cpu_ref's priority, so it runs only when forced."""
    plugin = Plugin(name=name, version="0.0.1")
    plugin.define_backend(
        priority=-10,
        device_types=("cpu",),
        devices=lambda: [DeviceInfo(0, "test CPU", "test vendor", "test arch")],
        array_api="numpy",
    )
    return plugin


def run_suite(backend: str, seed: int, ops: Sequence[str], dtypes: Optional[Sequence[str]] = None, **kw: object) -> dict[str, Result]:
    """Run a backend's cases of ``ops`` (full mode unless quick=True is passed); results by id."""
    suite = Suite(backend, seed=seed, ops=ops, dtypes=dtypes, **kw)  # type: ignore[arg-type]
    return {r.id: r for r in suite.run(suite.plan())}


def odd_rows_wrong(x, dim):
    """softmax that adds 0.01 to the last probability of rows of odd length (a deliberate bug)."""
    y = ref_softmax(x, dim)
    if y.size and x.ndim and x.shape[dim] % 2:  # rows of odd length that hold something
        np.moveaxis(y, dim, -1)[..., -1] += 0.01
    return y


def softmax_backend() -> Plugin:
    """The test backend "buggy" with a correct float32 softmax ("good") and one wrong for odd row
    lengths ("odd_bug")."""
    plugin = make_backend()
    plugin.kernel("softmax", name="good", dtypes=["float32"])(ref_softmax)
    plugin.kernel("softmax", name="odd_bug", dtypes=["float32"])(odd_rows_wrong)
    return plugin
