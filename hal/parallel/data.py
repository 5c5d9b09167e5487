"""Data parallelism with hal's collectives: DDP through hal's comm hook, FSDP (``fully_shard``) through
hal's all-gather and reduce-scatter, gradient reduction overlapped with the backward or not.

* :func:`data_parallel`: ``DistributedDataParallel`` whose buckets are reduced by
  ``hal.dist.all_reduce`` (average; ``algorithm`` as :func:`hal.dist.comm_hook`). With
  ``overlap=True`` (DDP's way) a bucket's all-reduce starts as soon as its gradients are ready and
  runs while the backward computes the next ones; DDP waits for all of them at the end of the
  backward. With ``overlap=False`` each bucket's all-reduce completes before the backward goes on:
  the same buckets, the same algorithm, the communication serialised with the computation (the
  baseline that shows what the overlap is worth).
* :func:`fully_shard_model`: ``torch.distributed.fsdp.fully_shard`` with its all-gathers and
  reduce-scatters issued by ``hal.dist`` (``set_custom_all_gather`` / ``set_custom_reduce_scatter``
  where the torch version has them). With ``overlap=True`` each block is its own FSDP unit: its
  gradients are reduce-scattered when the backward leaves the block (and the next block's parameters
  gathered ahead); on a GPU those collectives run on FSDP's side streams while the backward goes on.
  With ``overlap=False`` the model is one unit: one all-gather before the forward, one
  reduce-scatter after the whole backward. (On the CPU, FSDP waits for each collective where it
  issues it, so there the two differ in granularity, not overlap.)

``benchmarks/data_overlap.py`` times the four variants.
"""

# No ``from __future__ import annotations``: DDP compares a comm hook's annotations with the real
# classes (dist.GradBucket, torch.futures.Future[torch.Tensor]).

from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

import hal.dist as hd
from hal.dist.algorithms import REGISTRY
from hal.errors import InvalidArgumentError


def _check_algorithm(where: str, algorithm: str) -> None:
    if algorithm != "auto" and algorithm not in REGISTRY["all_reduce"]:
        names = ", ".join(["auto", *REGISTRY["all_reduce"]])
        raise InvalidArgumentError(where, "algorithm", f"one of {names}", repr(algorithm))


def serial_comm_hook(algorithm: str = "auto") -> Callable[[Any, dist.GradBucket], "torch.futures.Future[torch.Tensor]"]:
    """A DDP comm hook that reduces each bucket with ``hal.dist.all_reduce`` (average) and waits for
    it before returning: the backward does not go on while a bucket is in flight (no overlap)."""
    _check_algorithm("hal.parallel.serial_comm_hook", algorithm)

    def hook(state: Optional[Any], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        group = state if isinstance(state, dist.ProcessGroup) else None
        buf = bucket.buffer()
        hd.all_reduce(buf, op="avg", group=group, algorithm=algorithm)
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buf)
        return done

    hook.__name__ = hook.__qualname__ = f"hal_serial_{algorithm}_hook"
    return hook


def data_parallel(module: nn.Module, group: Any = None, *, algorithm: str = "auto", overlap: bool = True,
                  bucket_cap_mb: float = 25.0, **ddp_options: Any) -> nn.parallel.DistributedDataParallel:
    """``DistributedDataParallel(module, process_group=group, bucket_cap_mb=...)`` reducing its
    gradient buckets with ``hal.dist.all_reduce(bucket, op="avg", algorithm=algorithm)``.

    ``overlap``: True, buckets reduced asynchronously while the backward runs (:func:`hal.dist.comm_hook`);
    False, each bucket reduced before the backward continues (:func:`serial_comm_hook`).
    ``group``: the data-parallel group (a ``DeviceMesh`` dimension's group for 2-D parallelism), None
    for the default group. Other keywords go to DDP (``find_unused_parameters``, ``static_graph``...).
    """
    if not isinstance(overlap, bool):
        raise InvalidArgumentError("hal.parallel.data_parallel", "overlap", "True or False", repr(overlap))
    _check_algorithm("hal.parallel.data_parallel", algorithm)
    ddp = nn.parallel.DistributedDataParallel(module, process_group=group, bucket_cap_mb=bucket_cap_mb, **ddp_options)
    hook = hd.comm_hook(algorithm) if overlap else serial_comm_hook(algorithm)
    ddp.register_comm_hook(group, hook)
    return ddp


# --- FSDP -------------------------------------------------------------------------------------------

try:  # FSDP2's custom-collective interfaces (torch >= 2.8)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as _AllGatherBase
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatterBase
except ImportError:  # pragma: no cover - depends on the torch version
    _AllGatherBase = _ReduceScatterBase = object  # type: ignore[assignment,misc]

_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg"}


class _Allocate:
    def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class HalAllGather(_Allocate, _AllGatherBase):  # type: ignore[misc,valid-type]
    """FSDP's parameter all-gather through ``hal.dist.all_gather`` (done when the call returns)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False) -> None:
        output_tensor.copy_(hd.all_gather(input_tensor, group=group).view_as(output_tensor))
        return None


class HalReduceScatter(_Allocate, _ReduceScatterBase):  # type: ignore[misc,valid-type]
    """FSDP's gradient reduce-scatter through ``hal.dist.reduce_scatter`` (sum or average)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, op: Any = dist.ReduceOp.SUM,
                 async_op: bool = False) -> None:
        name = _OPS.get(op)
        if name is None:
            raise InvalidArgumentError("hal.parallel.fully_shard_model", "op", "SUM or AVG (leave FSDP's gradient divide factor unset)", str(op))
        output_tensor.copy_(hd.reduce_scatter(input_tensor, op=name, group=group).view_as(output_tensor))
        return None


def hal_collectives_available() -> bool:
    """Whether this torch's FSDP takes custom all-gather and reduce-scatter collectives."""
    from torch.distributed.fsdp import FSDPModule

    return _AllGatherBase is not object and hasattr(FSDPModule, "set_custom_reduce_scatter")


def _mesh(mesh: Any, module: nn.Module) -> Any:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if isinstance(mesh, DeviceMesh):
        return mesh
    device = next((p.device.type for p in module.parameters()), "cpu")
    if mesh is None:
        return init_device_mesh(device, (dist.get_world_size(),))
    if isinstance(mesh, dist.ProcessGroup):
        return DeviceMesh.from_group(mesh, device)
    raise InvalidArgumentError("hal.parallel.fully_shard_model", "mesh", "a DeviceMesh, a ProcessGroup or None", type(mesh).__name__)


def fully_shard_model(module: nn.Module, mesh: Any = None, *, overlap: bool = True, blocks: Optional[Iterable[str]] = None,
                      hal_collectives: bool = True, **fsdp_options: Any) -> nn.Module:
    """``fully_shard`` ``module`` (FSDP2) over ``mesh`` (a 1-D DeviceMesh or process group of the data-
    parallel ranks, None: all ranks); returns it (now an ``FSDPModule``).

    ``overlap=True``: each of ``blocks`` (submodule names; default
    :func:`hal.parallel.checkpoint.default_blocks`, the children of the largest ModuleList) is its
    own unit, then the root; ``overlap=False``: the root alone. ``hal_collectives``: FSDP's
    all-gathers and reduce-scatters go through ``hal.dist`` (where this torch has FSDP's custom
    collectives, :func:`hal_collectives_available`). Other keywords go to ``fully_shard``
    (``mp_policy``, ``reshard_after_forward``...).
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from hal.parallel.checkpoint import default_blocks

    if not isinstance(overlap, bool):
        raise InvalidArgumentError("hal.parallel.fully_shard_model", "overlap", "True or False", repr(overlap))
    device_mesh = _mesh(mesh, module)
    if device_mesh.ndim != 1:
        raise InvalidArgumentError("hal.parallel.fully_shard_model", "mesh", "a one-dimensional mesh (pass mesh['dp'] of a larger one)",
                                   f"a {device_mesh.ndim}-dimensional mesh")
    names = list(default_blocks(module) if blocks is None else blocks) if overlap else []
    units = [module.get_submodule(n) for n in names]
    for unit in units:
        fully_shard(unit, mesh=device_mesh, **fsdp_options)
    fully_shard(module, mesh=device_mesh, **fsdp_options)
    if hal_collectives and hal_collectives_available():
        gather, scatter = HalAllGather(), HalReduceScatter()
        for m in [*units, module]:
            assert isinstance(m, FSDPModule)
            m.set_custom_all_gather(gather)
            m.set_custom_reduce_scatter(scatter)
    return module


__all__ = ["data_parallel", "serial_comm_hook", "fully_shard_model", "HalAllGather", "HalReduceScatter", "hal_collectives_available"]
