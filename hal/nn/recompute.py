"""``hal.nn.recompute(model, policy)``: a model's repeated blocks recompute their activations in the
backward instead of holding them from the forward, trading arithmetic for memory.

A training step holds, between forward and backward, what each op's backward reads. In a decoder
most of those bytes come from cheap ops (norms, SwiGLU, rotary embeddings, casts): recomputing them
in the backward costs a pass over memory, while a GEMM's or attention's output is worth keeping.
Two policies, both on torch's activation checkpointing (``torch.utils.checkpoint``, non-reentrant,
so that it also runs inside ``torch.compile`` graphs and CUDA graph captures):

- ``"selective"``: each block keeps the outputs of its compute-bound ops and recomputes the rest.
  Compute-bound are hal's ops whose declaration says so (``OpDecl.compute_bound``: those that
  ``torch.autocast`` lowers, i.e. linear, matmul, grouped GEMM, attention, convolutions, the fused LM
  head + loss, and the FP8 and int8 GEMMs) and torch's GEMM, convolution and attention operators. hal's ops are operators that the policy sees
  under ``torch.compile``; in eager code they are autograd nodes of their own, which checkpointing
  records only as the torch operators their kernels call, so there the policy keeps torch's GEMMs
  and recomputes hal's ops. torch's selective activation checkpointing
  (``create_selective_checkpoint_contexts``) applies the policy.
- ``"full"``: each block keeps its inputs only and runs its forward again in the backward (about a
  third more arithmetic for a decoder; the least memory).

The blocks are the children of ``nn.ModuleList`` containers holding two or more modules of one
class (a decoder's layers, a ResNet stage's blocks). Each changes class, in place, to a subclass
whose forward runs the original through ``torch.utils.checkpoint``: parameters, buffers, state_dict
keys and hooks are untouched, and ``recompute(model, None)`` changes them back. Gradients are the
same as without recomputation: the same ops run on the same inputs; random ops (dropout) draw the
same numbers again (checkpointing restores the generators' state).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional

import torch
import torch.utils.checkpoint as checkpointing
from torch import nn

log = logging.getLogger("hal")

#: what recompute(model, policy) accepts (None undoes it)
POLICIES = ("selective", "full")


def _torch_compute_bound() -> frozenset:
    """torch's operators whose outputs selective recomputation keeps: GEMMs, convolutions and the
    fused attention kernels (those this torch build has)."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_int_mm", "_grouped_mm", "_scaled_grouped_mm", "convolution",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_flash_attention_forward", "_efficient_attention_forward")
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n) and hasattr(getattr(aten, n), "default"))


@functools.lru_cache(maxsize=None)
def _hal_compute_bound() -> frozenset:
    """hal's operators (``torch.ops.hal.<op>``) whose declaration makes them compute-bound (an op
    autocast lowers, or one declared ``compute_bound``: the FP8 and int8 GEMMs)."""
    from hal.integration.library import NAMESPACE
    from hal.registry import OPS

    namespace = getattr(torch.ops, NAMESPACE)
    return frozenset(getattr(namespace, d.name).default for d in OPS.values()
                     if d.compute_bound and hasattr(namespace, d.name))


@functools.lru_cache(maxsize=None)
def compute_bound() -> frozenset:
    """The operators whose outputs selective recomputation keeps (module docstring)."""
    return _torch_compute_bound() | _hal_compute_bound()


def _keep_compute_bound(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> checkpointing.CheckpointPolicy:
    if op in compute_bound():
        return checkpointing.CheckpointPolicy.MUST_SAVE
    return checkpointing.CheckpointPolicy.PREFER_RECOMPUTE


def _selective() -> Any:
    return checkpointing.create_selective_checkpoint_contexts(_keep_compute_bound)


class _Recomputed(nn.Module):
    """A block whose activations are recomputed in the backward (``hal.nn.recompute``)."""

    _hal_policy: str = "full"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        run = super().forward  # type: ignore[misc]
        if not torch.is_grad_enabled():
            return run(*args, **kwargs)
        if not getattr(self, "_can_checkpoint_with_cache", False):
            _drop_cache(type(self).__name__, kwargs)
        if self._hal_policy == "selective":
            return checkpointing.checkpoint(run, *args, use_reentrant=False, context_fn=_selective, **kwargs)
        return checkpointing.checkpoint(run, *args, use_reentrant=False, **kwargs)  # torch.compile takes no context_fn but SAC's


#: the keyword arguments of a Hugging Face layer that write a key/value cache, and what stops them
_CACHE_ARGUMENTS = {"use_cache": False, "past_key_values": None, "past_key_value": None, "layer_past": None}
_warned: set[str] = set()


def _drop_cache(name: str, kwargs: dict[str, Any]) -> None:
    """A block that writes a key/value cache in its forward would write it again when recomputed
    (and then compute on twice the keys): as Hugging Face's own gradient checkpointing does, the
    cache is not written by a block whose activations are recomputed (a training step never reads
    it; generation runs without grad and keeps it)."""
    dropped = [k for k, off in _CACHE_ARGUMENTS.items() if kwargs.get(k, off) is not off]
    for k in dropped:
        kwargs[k] = _CACHE_ARGUMENTS[k]
    if dropped and name not in _warned:
        _warned.add(name)
        log.warning("hal.nn.recompute: %s is recomputed in the backward, so it cannot write a key/value cache: %s (as "
                    "transformers' gradient checkpointing does)",
                    name, ", ".join(f"{k}={_CACHE_ARGUMENTS[k]}" for k in dropped))


_CLASSES: dict[tuple[type, str], type] = {}


def _recomputed_class(cls: type, policy: str) -> type:
    key = (cls, policy)
    if key not in _CLASSES:
        _CLASSES[key] = type(cls.__name__, (_Recomputed, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                                                "_hal_policy": policy, "_hal_original": cls})
    return _CLASSES[key]


def blocks(model: nn.Module) -> list[nn.Module]:
    """``model``'s repeated blocks: the children of each ``nn.ModuleList`` that holds two or more
    modules of one class (already recomputed ones included), outermost lists first (a block inside
    a block is left to its outer one)."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for m in model.modules():
        if id(m) in inside or not isinstance(m, nn.ModuleList):
            continue
        kinds: dict[type, list[nn.Module]] = {}
        for child in m:
            kinds.setdefault(getattr(type(child), "_hal_original", type(child)), []).append(child)
        for same in kinds.values():
            if len(same) >= 2:
                found += same
                inside.update(id(sub) for block in same for sub in block.modules())
    return found


def recompute(model: nn.Module, policy: Optional[str] = "selective") -> int:
    """Make ``model``'s repeated blocks (:func:`blocks`) recompute their activations in the backward
    with ``policy`` (``"selective"`` or ``"full"``, module docstring), or, with ``None``, hold them
    again. Changes the blocks in place; returns how many blocks it set."""
    if policy is not None and policy not in POLICIES:
        raise ValueError(f"hal.nn.recompute: policy must be one of {', '.join(map(repr, POLICIES))} or None, not {policy!r}")
    found = blocks(model)
    for block in found:
        original = getattr(type(block), "_hal_original", type(block))
        block.__class__ = original if policy is None else _recomputed_class(original, policy)
    return len(found)


def policy_of(model: nn.Module) -> Optional[str]:
    """The policy ``model``'s blocks recompute with (None: they hold their activations)."""
    return next((type(m)._hal_policy for m in model.modules() if isinstance(m, _Recomputed)), None)


__all__ = ["POLICIES", "blocks", "compute_bound", "policy_of", "recompute"]
