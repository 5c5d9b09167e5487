"""Published figures of peers that cannot be measured in the run: quack-kernels.

quack-kernels (CuTe DSL kernels from Tri Dao's lab) needs NVIDIA's CuTe DSL runtime, a 92 MB wheel,
more than can travel to this workplace's H200, so it is never timed here. Its README publishes model
memory throughput (bytes read + written over time) for bf16 RMSNorm, softmax and cross-entropy
forward on one H100 80GB HBM3 (3.35 TB/s datasheet bandwidth); the figures below are the data
coordinates of that chart's points, converted with its axis ticks. They appear next to the rows of
the same op and shape, marked as published and not measured here, and are never used as a
measured peer or to judge a target.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

QUACK = "quack-kernels"
_COMMIT = "c8ec3170057987da0ec99883736f381ea1937cf3"
CHART = f"https://github.com/Dao-AILab/quack/blob/{_COMMIT}/media/bf16_kernel_benchmarks_single_row.svg"
BLOG = f"https://github.com/Dao-AILab/quack/blob/{_COMMIT}/media/2025-07-10-membound-sol.md"
H100 = "one H100 80GB HBM3 (3.35 TB/s datasheet), quack's README chart (July 2025)"


@dataclasses.dataclass(frozen=True)
class Published:
    peer: str
    figure: Optional[str]  # None: the peer has the kernel, no figure was found
    setting: str  # op, direction, dtype, shape and device the figure was measured on
    source: str

    def line(self) -> str:
        what = self.figure if self.figure else "no published figure found"
        return f"{self.peer}: {what} ({self.setting}; published, not measured here)"


def _fig(setting: str, tb_s: float) -> Published:
    return Published(QUACK, f"{tb_s:.2f} TB/s = {tb_s / 3.35:.0%} of the H100's bandwidth", f"{setting}, {H100}", CHART)


def _none(setting: str) -> Published:
    return Published(QUACK, None, f"{setting}: quack-kernels lists this kernel in its README", BLOG)


_BY_OP: dict[str, tuple[Published, ...]] = {
    "rms_norm": (_fig("RMSNorm forward, bf16, (M, N) = (32768, 4096)", 2.900),),
    "softmax": (_fig("softmax forward, bf16, (M, N) = (32768, 4096)", 2.889),),
    "cross_entropy": (_fig("cross-entropy forward, bf16, (M, N) = (32768, 32768), its nearest shape", 3.021),),
    "rms_norm_backward": (_none("RMSNorm backward"),),
    "softmax_backward": (_none("softmax backward"),),
    "cross_entropy_backward": (_none("cross-entropy backward"),),
    "layer_norm": (_none("LayerNorm forward"),),
    "layer_norm_backward": (_none("LayerNorm backward"),),
}


def quack(op: str) -> tuple[Published, ...]:
    """quack-kernels' published figures for ``op`` (its README's chart), or notes that it has the
    kernel without a figure; empty where it lists no such kernel."""
    return _BY_OP.get(op, ())
