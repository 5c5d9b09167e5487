"""The cost model ``algorithm="auto"`` uses, with parameters a user can override.

A transfer step costs ``latency + bytes / bandwidth`` (the alpha-beta model), with one pair of
parameters inside a node (per rank) and one across nodes (per node: its ranks share the network).
A ring all-reduce on ``p`` ranks is ``2(p-1)`` steps of ``1/p`` of the message; across nodes every
step waits for the slowest link. Each extra collective an algorithm starts costs ``launch_us``;
compression adds its passes over the input (``compress_gbps``). NCCL and RCCL already route their
own rings and trees by topology, so for them ``native`` is costed like the hierarchical schedule
minus its extra launches (``topology_aware_native``): hal's ``hierarchical`` pays off on engines
that run flat rings, like gloo.

Defaults are per engine. gloo: loopback between 4 processes, between what a shared 2-core machine
and a 32-core host gave (0.7 and 2.1 GB/s busbw); across nodes a 10 GbE link. NCCL: inside a node as
measured on 2 H200 joined by NVLink (about 300 GB/s busbw at 256 MiB; compression passes, launches
included, about 150 GB/s); across nodes nominal for a 400 Gb/s NIC per GPU, 8 per node. RCCL:
nominal (no AMD machine was measured). Calibrate with ``hal bench --collectives`` and
:func:`set_cost_model`.

Lossy algorithms (the compressed ones) change results, so ``auto`` considers them only after
``set_cost_model(allow_lossy=True)``; naming one explicitly always works.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from hal.dist import settings
from hal.errors import InvalidArgumentError


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Parameters of the ``auto`` choice for one engine."""

    latency_us_intra: float  #: start-up of one transfer step between ranks of a node (µs)
    latency_us_inter: float  #: start-up of one transfer step between nodes (µs)
    gbps_intra: float  #: bandwidth of one rank's link inside a node (GB/s, 1e9 bytes/s)
    gbps_inter: float  #: network bandwidth of one node, shared by its ranks (GB/s)
    compress_gbps: float  #: input bytes per second through compression's casts and sums (GB/s)
    launch_us: float  #: host cost of starting one more collective (µs)
    topology_aware_native: bool = False  #: the engine's own all-reduce follows the node layout
    allow_lossy: bool = False  #: let ``auto`` pick the compressed (16-bit) algorithms

    def ring(self, nbytes: float, ranks: int, nodes: int, phases: int) -> float:
        """Seconds of ``phases`` ring passes (2: all-reduce; 1: reduce-scatter, all-gather, all-to-all).

        Across nodes each step waits for the slowest link: the node's network, which carries one
        ring edge per node at full bandwidth.
        """
        if ranks <= 1:
            return 0.0
        if nodes > 1:
            alpha, gbps = self.latency_us_inter, min(self.gbps_intra, self.gbps_inter)
        else:
            alpha, gbps = self.latency_us_intra, self.gbps_intra
        return phases * (ranks - 1) * (alpha * 1e-6 + nbytes / ranks / (gbps * 1e9))

    def two_level(self, nbytes: float, per_node: int, nodes: int, extra_launches: int) -> float:
        """Seconds of the hierarchical schedule: reduce-scatter and all-gather inside each node, and
        all-reduces of 1/per_node of the message across nodes (all of a node's share its network)."""
        inside = self.ring(nbytes, per_node, 1, 2)
        across = 2 * (nodes - 1) * (self.latency_us_inter * 1e-6 + nbytes / nodes / (self.gbps_inter * 1e9))
        return inside + across + extra_launches * self.launch_us * 1e-6

    def compute(self, nbytes: float) -> float:
        """Seconds of compression passes over ``nbytes`` of input."""
        return nbytes / (self.compress_gbps * 1e9)


DEFAULTS: dict[str, CostModel] = {
    "gloo": CostModel(
        latency_us_intra=150.0, latency_us_inter=200.0, gbps_intra=1.0, gbps_inter=1.2, compress_gbps=1.0, launch_us=100.0
    ),
    "nccl": CostModel(
        latency_us_intra=8.0, latency_us_inter=20.0, gbps_intra=300.0, gbps_inter=360.0, compress_gbps=150.0,
        launch_us=20.0, topology_aware_native=True,
    ),
    "rccl": CostModel(
        latency_us_intra=10.0, latency_us_inter=25.0, gbps_intra=100.0, gbps_inter=176.0, compress_gbps=600.0,
        launch_us=25.0, topology_aware_native=True,
    ),
}
_FIELDS = {f.name for f in dataclasses.fields(CostModel)}
_overrides: dict[Optional[str], dict[str, Any]] = {}


def set_cost_model(engine: Optional[str] = None, **params: Any) -> None:
    """Override cost-model parameters for one engine ("gloo", "nccl", "rccl") or, with None, for all.

    Example: ``hal.dist.set_cost_model("nccl", gbps_inter=25.0, allow_lossy=True)``. Every rank must
    make the same overrides (the choice must agree across ranks). ``reset_cost_model()`` undoes them.
    """
    unknown = sorted(set(params) - _FIELDS)
    if unknown:
        raise InvalidArgumentError(
            "hal.dist.set_cost_model", unknown[0], f"one of {', '.join(sorted(_FIELDS))}", repr(unknown[0])
        )
    for name, value in params.items():
        if name in ("allow_lossy", "topology_aware_native"):
            if not isinstance(value, bool):
                raise InvalidArgumentError("hal.dist.set_cost_model", name, "True or False", repr(value))
        elif not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
            raise InvalidArgumentError("hal.dist.set_cost_model", name, "a positive number", repr(value))
    _overrides.setdefault(engine, {}).update(params)
    settings.bump_version()


def reset_cost_model() -> None:
    """Back to the default parameters of every engine."""
    _overrides.clear()
    settings.bump_version()


def cost_model(engine: str) -> CostModel:
    """The parameters in effect for ``engine`` (defaults, then overrides for all, then for it)."""
    base = DEFAULTS.get(engine, DEFAULTS["gloo"])
    merged = {**_overrides.get(None, {}), **_overrides.get(engine, {})}
    return dataclasses.replace(base, **merged) if merged else base
