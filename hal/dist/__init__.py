"""hal.dist: collectives on torch.distributed process groups, with algorithms chosen like kernels.

    import torch.distributed as dist, hal
    dist.init_process_group("gloo")                    # or NCCL / RCCL: hal.dist never opens sockets
    hal.dist.all_reduce(t)                             # in place; algorithm="auto"
    hal.dist.all_reduce(t, op="avg", algorithm="compressed_fp16")
    print(hal.explain("all_reduce", t))                # the choice, every algorithm and why
    model.register_comm_hook(None, hal.dist.comm_hook("compressed_fp16"))   # DDP

Collectives: :func:`all_reduce`, :func:`all_gather`, :func:`reduce_scatter`, :func:`all_to_all`,
:func:`broadcast`, :func:`send`, :func:`recv` (``async_op=True`` returns a :class:`Work`).
all_reduce algorithms: ``native`` (the engine's own), ``hierarchical`` (needs the node layout:
``LOCAL_WORLD_SIZE`` or :func:`set_topology`), ``compressed_fp16`` / ``compressed_bf16`` (16-bit
transfers, fp32 sums). ``auto`` asks the cost model (:func:`set_cost_model`). Settings:
:func:`set_timeout` (``HAL_DIST_TIMEOUT``), :func:`set_debug` (``HAL_DIST_CHECK=1``: cross-rank
argument check); the environment is read once (``hal.dist.settings.refresh()`` re-reads it).
:data:`EXPLAINERS` explains each collective's choice; ``import hal`` makes them ``hal.explain``'s,
lets ``hal.use(kernel={"all_reduce": ...})`` force an algorithm, and installs the algorithms beside
the native ones (:func:`hal.wiring.wire`).
Failures of the transfer raise :class:`CommError`, bad arguments :class:`hal.InvalidArgumentError`.
"""

from __future__ import annotations

from hal.dist.algorithms import algorithms
from hal.dist.collectives import EXPLAINERS
from hal.dist.collectives import all_gather, all_reduce, all_to_all, broadcast, recv, reduce_scatter, send
from hal.dist.compressed import clear_workspaces
from hal.dist.cost import CostModel, cost_model, reset_cost_model, set_cost_model
from hal.dist.ddp import comm_hook
from hal.dist.engine import Work
from hal.dist.errors import CommError
from hal.dist.settings import set_debug, set_timeout, set_topology

__all__ = [
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "send",
    "recv",
    "comm_hook",
    "set_topology",
    "set_timeout",
    "set_debug",
    "set_cost_model",
    "reset_cost_model",
    "cost_model",
    "CostModel",
    "algorithms",
    "EXPLAINERS",
    "clear_workspaces",
    "Work",
    "CommError",
]
