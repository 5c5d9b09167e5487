"""What hal.dist needs to know about a process group: its ranks, its engine, and its node layout.

Nodes follow torchrun's layout: global rank ``r`` lives on node ``r // ranks_per_node``, with
``ranks_per_node`` from :func:`hal.dist.set_topology` or ``LOCAL_WORLD_SIZE``. The sub-groups the
``hierarchical`` algorithm uses (the ranks of one node; the ranks with the same local index on every
node) are created once per group, by the member ranks only, on the group's own engine.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Optional

import torch
import torch.distributed as dist

from hal.dist import settings
from hal.errors import BackendUnavailableError, InvalidArgumentError


@dataclasses.dataclass(frozen=True)
class GroupInfo:
    """A process group as seen from this rank."""

    group: Any  # the torch ProcessGroup
    rank: int  # this rank's index in the group
    size: int
    global_ranks: tuple[int, ...]  # ordered by group rank
    engine: str  # "gloo", "nccl", "rccl", or the backend name torch reports
    #: the group's ranks (group indices) per node, nodes in order; one node when the topology is unknown.
    nodes: tuple[tuple[int, ...], ...]
    topology_known: bool

    @property
    def node_count(self) -> int:
        return len(self.nodes)

    @property
    def per_node(self) -> Optional[int]:
        """Ranks of the group on each node when every node holds the same number, else None."""
        counts = {len(n) for n in self.nodes}
        return counts.pop() if len(counts) == 1 else None

    def describe(self) -> str:
        layout = f"{self.node_count} node(s) x {self.per_node} rank(s)" if self.per_node else "uneven nodes"
        if not self.topology_known:
            layout = "topology unknown (one node assumed)"
        return f"{self.size} rank{'s' if self.size != 1 else ''} on {self.engine}, {layout}"


_lock = threading.Lock()
_infos: dict[tuple[Any, ...], GroupInfo] = {}
_subgroups: dict[tuple[Any, ...], tuple[Any, Any]] = {}


def require_initialized(what: str) -> None:
    """Raise when torch.distributed has no default process group (hal.dist never creates one)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise BackendUnavailableError(
            f"{what}: torch.distributed is not initialized. hal.dist runs on an existing process group: "
            "call torch.distributed.init_process_group(...) first (torchrun sets up the environment it reads)."
        )


def engine_name(backend: str, device_type: str, hip_version: Optional[str]) -> str:
    """The engine serving ``device_type`` under torch.distributed's backend name (``"nccl"``,
    ``"cpu:gloo,cuda:nccl"``): "nccl" is RCCL on a ROCm build of torch (``torch.version.hip``),
    whose devices are "cuda" too."""
    name = backend.lower()
    if ":" in name:  # "cpu:gloo,cuda:nccl"
        per_device = dict(part.split(":", 1) for part in name.split(","))
        name = per_device.get(device_type, "")
    if name == "nccl" and hip_version:
        return "rccl"
    return name


def _engine(group: Any, device: torch.device) -> str:
    """The engine serving ``device`` in ``group``: "nccl" / "rccl" for GPUs, "gloo" for the CPU."""
    return engine_name(str(dist.get_backend(group)), device.type, getattr(torch.version, "hip", None))


def gpu_group_name() -> str:
    """How error messages name a GPU process group on this build of torch."""
    return "nccl (RCCL)" if getattr(torch.version, "hip", None) else "nccl"


def _check_device(collective: str, engine: str, device: torch.device, group: Any) -> None:
    if device.type == "cpu" and engine in ("nccl", "rccl"):
        raise InvalidArgumentError(
            collective, "t", f"a GPU tensor for this {engine} group (or a gloo group for CPU tensors)", f"a tensor on {device}"
        )
    if device.type == "cuda" and engine == "gloo":
        raise InvalidArgumentError(
            collective, "t", f"a CPU tensor for this gloo group (or an {gpu_group_name()} group for GPU tensors)", f"a tensor on {device}"
        )
    if not engine:
        raise InvalidArgumentError(
            collective, "t", f"a tensor on a device the group serves ({dist.get_backend(group)})", f"a tensor on {device}"
        )


def _layout(global_ranks: tuple[int, ...], ranks_per_node: Optional[int]) -> tuple[tuple[int, ...], ...]:
    if not ranks_per_node:
        return (tuple(range(len(global_ranks))),)
    by_node: dict[int, list[int]] = {}
    for group_rank, g in enumerate(global_ranks):
        by_node.setdefault(g // ranks_per_node, []).append(group_rank)
    return tuple(tuple(by_node[k]) for k in sorted(by_node))


def info(collective: str, group: Any, device: torch.device) -> GroupInfo:
    """The :class:`GroupInfo` of ``group`` (None: the default group) for a tensor on ``device``."""
    pg = group if group is not None else dist.GroupMember.WORLD
    if pg is None:
        require_initialized(f"hal.dist.{collective}")
    key = (pg, device.type, settings.version)
    found = _infos.get(key)
    if found is not None:
        return found
    rpn = settings.ranks_per_node()
    if dist.get_rank(pg) < 0:
        raise InvalidArgumentError(
            collective, "group", "a group this rank belongs to", f"a group of global ranks {dist.get_process_group_ranks(pg)}"
        )
    engine = _engine(pg, device)
    _check_device(collective, engine, device, pg)
    ranks = tuple(dist.get_process_group_ranks(pg))
    made = GroupInfo(
        group=pg,
        rank=dist.get_rank(pg),
        size=dist.get_world_size(pg),
        global_ranks=ranks,
        engine=engine,
        nodes=_layout(ranks, rpn),
        topology_known=rpn is not None,
    )
    with _lock:
        _infos[key] = made
    return made


def hierarchy(gi: GroupInfo) -> tuple[Any, Any]:
    """(intra-node group, cross-node group) of this rank for ``gi``.

    The intra-node group holds the group's ranks on this rank's node; the cross-node group holds the
    ranks with this rank's local index on every node. Created on first use by the members only
    (``use_local_synchronization``), so every member must reach its first hierarchical call.
    """
    node = next(i for i, members in enumerate(gi.nodes) if gi.rank in members)
    local = gi.nodes[node].index(gi.rank)
    key = (gi.group, gi.nodes)
    found = _subgroups.get(key)
    if found is None:
        backend = dist.get_backend(gi.group)
        intra_ranks = [gi.global_ranks[r] for r in gi.nodes[node]]
        inter_ranks = [gi.global_ranks[members[local]] for members in gi.nodes]
        intra = dist.new_group(intra_ranks, backend=backend, use_local_synchronization=True)
        inter = dist.new_group(inter_ranks, backend=backend, use_local_synchronization=True)
        found = (intra, inter)
        with _lock:
            _subgroups[key] = found
    return found
