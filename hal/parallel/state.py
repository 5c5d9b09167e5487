"""State dicts and optimizer groups of a parallelized model.

:func:`full_state_dict` gathers every shard through ``hal.dist`` into the unparallelized model's
state_dict (same keys, plain tensors), so a checkpoint written from a parallel run loads into the
model on one device; :func:`load_full_state_dict` gives each rank its block of one.
:func:`param_groups` separates ``DTensor`` parameters from plain ones for torch's optimizers.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from hal.errors import InvalidArgumentError
from hal.parallel.comm import gather_from_parallel, group_size
from hal.parallel.tensor import DTensor, _Sharded, local_tensor

__all__ = ["full_state_dict", "load_full_state_dict", "param_groups"]


def _shards(model: nn.Module) -> dict[str, tuple[Optional[int], Any]]:
    """{state_dict key: (split dimension or None, group)} of the parallel modules' parameters."""
    out = {}
    for prefix, m in model.named_modules():
        if isinstance(m, _Sharded):
            for name, dim in m.shard_dims.items():
                out[f"{prefix}.{name}" if prefix else name] = (dim, m.group)
    return out


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unparallelized model's state_dict: every shard gathered through ``hal.dist`` (a
    collective: call it on every rank of the group), plain tensors, the original keys."""
    shards = _shards(model)
    out = {}
    with torch.no_grad():
        for key, value in model.state_dict().items():
            value = local_tensor(value)
            dim, group = shards.get(key, (None, None))
            if dim is not None:
                value = gather_from_parallel(value.contiguous(), dim, group)
            out[key] = value.detach().clone()
    return out


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load the unparallelized model's state_dict (every rank passes the same one): each parallel
    parameter takes its rank's block. Keys must match exactly."""
    shards = _shards(model)
    mine = model.state_dict(keep_vars=True)
    missing, unexpected = sorted(set(mine) - set(state_dict)), sorted(set(state_dict) - set(mine))
    if missing or unexpected:
        raise InvalidArgumentError("hal.parallel.load_full_state_dict", "state_dict", "the model's keys",
                                   f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for key, target in mine.items():
            src = state_dict[key]
            dim, group = shards.get(key, (None, None))
            if dim is not None:
                src = src.chunk(group_size(group), dim)[dist.get_rank(group)]
            local_tensor(target).copy_(src)


def param_groups(model: nn.Module, **options: Any) -> list[dict[str, Any]]:
    """The model's trainable parameters in two optimizer groups, DTensor ones and plain ones (torch's
    foreach and fused optimizers reject a list mixing both), each with ``options``."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    return [dict(options, params=g) for g in groups if g]
