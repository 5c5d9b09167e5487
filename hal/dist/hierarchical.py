"""all_reduce in three stages that follow the node layout (``hierarchical``).

1. reduce-scatter inside each node: local rank ``i`` of a node holds block ``i`` reduced over the node;
2. all-reduce of block ``i`` across the nodes, between the ranks with local index ``i``;
3. all-gather inside each node.

Only ``1/k`` of the data (``k`` ranks per node) crosses the network, in ``2(N-1)`` steps for ``N``
nodes instead of the flat ring's ``2(n-1)``: it pays where links between nodes are much slower than
inside them. The node layout comes from :func:`hal.dist.set_topology` or ``LOCAL_WORLD_SIZE``.
"""

from __future__ import annotations

import torch.distributed as dist

from hal.dist import engine, groups
from hal.dist.algorithms import C10D_OP, Algorithm, Call, contiguous
from hal.dist.cost import CostModel
from hal.dist.engine import Steps


def _reasons(call: Call) -> list[str]:
    gi = call.gi
    if not gi.topology_known:
        return [
            "the node layout is unknown: set LOCAL_WORLD_SIZE (torchrun does) or call "
            "hal.dist.set_topology(ranks_per_node=N)"
        ]
    if gi.node_count < 2:
        return [f"all {gi.size} ranks of the group are on one node: there is no network stage to save"]
    if gi.per_node is None:
        sizes = ", ".join(str(len(n)) for n in gi.nodes)
        return [f"the nodes hold different numbers of the group's ranks ({sizes}); it needs the same number on each"]
    if gi.per_node < 2:
        return ["one rank per node: the stages inside a node would be empty (native is the same ring)"]
    return []


def _cost(call: Call, m: CostModel) -> float:
    return m.two_level(call.nbytes, call.gi.per_node or 1, call.gi.node_count, extra_launches=2)


def hierarchical(call: Call) -> Steps:
    """Reduce-scatter in each node, all-reduce across nodes, all-gather in each node."""
    t, gi = call.tensor, call.gi
    intra, inter = groups.hierarchy(gi)
    intra_info = groups.info("all_reduce", intra, t.device)
    k = intra_info.size
    buf = contiguous(t)
    flat = buf.view(-1)
    total = flat.numel()
    if total == 0:
        return t
    block = -(-total // k)
    work = flat
    if block * k != total:
        work = flat.new_zeros(block * k)
        work[:total].copy_(flat)
    op = C10D_OP[call.op]  # avg: sums in every stage, one division at the end
    shard = flat.new_empty(block)
    yield engine.reduce_scatter_into(shard, work, op, intra)
    yield dist.all_reduce(shard, op=op, group=inter, async_op=True)
    yield engine.exchange_all_gather(work, shard, intra_info)
    if work is not flat:
        flat.copy_(work[:total])
    if call.op == "avg":
        flat.div_(gi.size)
    if buf is not t:
        t.copy_(buf)
    return t


#: this module's algorithm, which :func:`hal.wiring.wire` installs (:func:`hal.dist.algorithms.install`)
ALGORITHMS = (Algorithm("hierarchical", "all_reduce", hierarchical, _reasons, _cost),)
