"""Activation checkpointing for hal's ops, modules and parallel layers, full or selective.

``torch.utils.checkpoint`` (non-reentrant) drops a region's activations in the forward and runs the
region again inside the backward. Three things go wrong with that on their own, and this module
mends them:

* **Running statistics written twice.** The recomputation runs a batch norm's training forward
  again (``hal.nn.FusedConvBNReLU2d``, ``nn.BatchNorm2d``, ``hal.ops.batch_norm``), which updates
  its running mean and variance and ``num_batches_tracked`` a second time. Here the recomputation
  runs on copies of those buffers (the module's buffers are swapped for clones while it runs, then
  swapped back), and raw tensors passed as ``state=`` are restored after it; the step's statistics
  are written exactly once. :func:`is_recomputing` tells any other code that it runs in a recomputation.
* **hal's measured kernel choice.** A call whose route is not decided yet is timed once on its
  first run (``HAL_TUNE=on``), which runs kernels and draws random gradients. Had that happened in
  the forward and not in the recomputation, the random stream replayed for dropout would differ,
  and a selective policy's cache of saved outputs (indexed by call order) would not line up. Inside a
  checkpointed region hal takes cached measurements only (``HAL_TUNE=cached`` for the region:
  measured choices from ``hal.tune`` or from earlier calls outside, else by priority), the same way
  in both runs.
* **Selective recomputation.** :func:`selective_policy` keeps the outputs of the expensive ops
  (matrix products, attention, convolutions: torch's and hal's own ``torch.ops.hal`` operators)
  and recomputes the cheap ones (norms, activations, elementwise), via
  ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.

:func:`checkpoint` runs one region; :func:`checkpoint_blocks` makes a model's blocks checkpoint
their forward (state_dict keys unchanged), :func:`remove_checkpointing` undoes it.
Collectives inside a region (the parallel layers' all-reduces and gathers) are issued again by the
recomputation, in the same order on every rank.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import torch
from torch import nn
from torch.utils import checkpoint as _ckpt

from hal import config
from hal.errors import InvalidArgumentError

Policy = Union[str, Callable[..., Any]]


class _State(threading.local):
    recomputing = 0
    no_save = 0


_STATE = _State()


def is_recomputing() -> bool:
    """Whether this thread runs a checkpointed region's recomputation (inside the backward) now."""
    return _STATE.recomputing > 0


# --- the ops a selective policy keeps -------------------------------------------------------------

#: torch operators whose outputs the selective policy saves (names that a torch version lacks are skipped)
EXPENSIVE_ATEN = (
    "aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._addmm_activation", "aten._scaled_mm", "aten._grouped_mm",
    "aten._int_mm", "aten.convolution", "aten._convolution", "aten.mkldnn_convolution", "aten.cudnn_convolution",
    "aten.miopen_convolution", "aten.cudnn_convolution_relu", "aten.cudnn_convolution_add_relu",
    "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._flash_attention_forward", "aten._efficient_attention_forward", "mkldnn._linear_pointwise",
    "mkldnn._convolution_pointwise",
)
#: hal operators (``torch.ops.hal.<name>``, what torch.compile and the dispatch modes see) whose outputs it saves
EXPENSIVE_HAL = ("linear", "matmul", "grouped_gemm", "scaled_dot_product_attention", "conv2d", "int8_linear")


def _resolve(names: Iterable[str]) -> frozenset:
    """The OpOverloadPackets of ``names`` ("namespace.op") that exist in this torch."""
    found = set()
    for name in names:
        space, _, op = name.partition(".")
        packet = getattr(getattr(torch.ops, space, None), op, None)
        if packet is not None:
            found.add(packet)
    return frozenset(found)


@functools.lru_cache(maxsize=None)
def _expensive_aten() -> frozenset:
    return _resolve(EXPENSIVE_ATEN)


def saves(op: Any, extra: frozenset = frozenset()) -> bool:
    """Whether the selective policy keeps the output of ``op`` (an OpOverload): a GEMM, an
    attention or a convolution of torch's, one of hal's EXPENSIVE_HAL operators, or in ``extra``
    (packets or "namespace.op" names). Ops that write their inputs are always recomputed."""
    packet = getattr(op, "overloadpacket", op)
    schema = getattr(op, "_schema", None)
    if schema is not None and schema.is_mutable:
        return False
    if packet in _expensive_aten() or packet in extra or str(packet) in extra:
        return True
    return getattr(op, "namespace", None) == "hal" and str(packet).split(".")[-1] in EXPENSIVE_HAL


def selective_policy(extra_saved: Sequence[Any] = ()) -> Callable[..., Any]:
    """A policy for ``create_selective_checkpoint_contexts``: MUST_SAVE for :func:`saves` where
    autograd records the op, PREFER_RECOMPUTE for everything else. ``extra_saved``: more ops to
    keep (OpOverloadPackets such as ``torch.ops.aten.gelu`` or names such as ``"aten.gelu"``).

    Ops that run with gradients off are the insides of a fused kernel (a hal autograd node, a
    custom ``autograd.Function`` such as the vocabulary-parallel loss): they are recomputed, never
    kept, since keeping them would keep what the fused kernel exists not to keep (the chunks of
    an LM head's logits). :func:`recompute_only` marks more such regions."""
    extra = frozenset(extra_saved) | frozenset(str(e) for e in extra_saved)
    Checkpoint = _ckpt.CheckpointPolicy

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if _STATE.no_save or not torch.is_grad_enabled():
            return Checkpoint.PREFER_RECOMPUTE
        return Checkpoint.MUST_SAVE if saves(op, extra) else Checkpoint.PREFER_RECOMPUTE

    return policy


@contextlib.contextmanager
def recompute_only() -> Iterator[None]:
    """Ops run inside are never kept by :func:`selective_policy` (a chunked computation whose
    intermediates must not pile up), even with gradients on."""
    _STATE.no_save += 1
    try:
        yield
    finally:
        _STATE.no_save -= 1


# --- what a region's recomputation must not write -------------------------------------------------


def _statistics_modules(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """The batch-norm-like modules (``_NormBase``: BatchNorm, SyncBatchNorm, InstanceNorm with
    running statistics; hal.nn's fused conv modules hold one) under ``modules``."""
    found: dict[int, nn.Module] = {}
    for m in modules:
        for sub in m.modules():
            if isinstance(sub, nn.modules.batchnorm._NormBase) and sub.track_running_stats:
                found[id(sub)] = sub
    return list(found.values())


_STAT_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


@contextlib.contextmanager
def _recomputation(modules: Sequence[nn.Module], state: Sequence[torch.Tensor]) -> Iterator[None]:
    """A recomputation: the statistics modules run on clones of their buffers, ``state`` tensors
    get their values back afterwards, :func:`is_recomputing` is True, measurement off."""
    swapped = []
    for m in _statistics_modules(modules):
        for name in _STAT_BUFFERS:
            buf = m._buffers.get(name)
            if buf is not None:
                swapped.append((m, name, buf))
                m._buffers[name] = buf.clone()
    kept = [t.detach().clone() for t in state]
    _STATE.recomputing += 1
    try:
        with config.scope(tune="cached"):
            yield
    finally:
        _STATE.recomputing -= 1
        for m, name, buf in swapped:
            m._buffers[name] = buf
        with torch.no_grad():
            for t, v in zip(state, kept):
                t.copy_(v)


@contextlib.contextmanager
def _first_run() -> Iterator[None]:
    with config.scope(tune="cached"):
        yield


def _contexts(policy: Policy, modules: Sequence[nn.Module], state: Sequence[torch.Tensor]) -> Callable[[], tuple[Any, Any]]:
    """``context_fn`` for torch.utils.checkpoint: (the forward's context, the recomputation's)."""
    if policy == "full":
        sac = None
    elif policy == "selective":
        sac = selective_policy()
    elif callable(policy):
        sac = policy
    else:
        raise InvalidArgumentError("hal.parallel.checkpoint", "policy", "'full', 'selective' or a policy function (ctx, op, *args)", repr(policy))
    if sac is not None and not hasattr(_ckpt, "create_selective_checkpoint_contexts"):
        raise InvalidArgumentError("hal.parallel.checkpoint", "policy", "'full' (this torch has no selective checkpointing)", repr(policy))

    def context_fn() -> tuple[Any, Any]:
        if sac is None:
            return _first_run(), _recomputation(modules, state)
        forward, recompute = _ckpt.create_selective_checkpoint_contexts(sac)
        return _Stacked(_first_run(), forward), _Stacked(_recomputation(modules, state), recompute)

    return context_fn


class _Stacked:
    """Two context managers entered as one (outer first)."""

    def __init__(self, outer: Any, inner: Any) -> None:
        self.outer, self.inner, self.stack = outer, inner, contextlib.ExitStack()

    def __enter__(self) -> None:
        self.stack.enter_context(self.outer)
        self.stack.enter_context(self.inner)

    def __exit__(self, *exc: Any) -> Optional[bool]:
        return self.stack.__exit__(*exc)


def checkpoint(fn: Callable[..., Any], *args: Any, policy: Policy = "full", modules: Sequence[nn.Module] = (),
               state: Sequence[torch.Tensor] = (), preserve_rng_state: bool = True, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with its activations recomputed in the backward.

    ``policy``: "full" (every activation recomputed), "selective" (:func:`selective_policy`: the
    outputs of GEMMs, attention and convolutions kept) or a policy function for
    ``create_selective_checkpoint_contexts``. ``modules``: the modules whose running statistics the
    recomputation must leave alone (``fn`` itself when it is a module); ``state``: tensors written
    in the region (e.g. running statistics passed to ``hal.ops.batch_norm``) whose values the
    recomputation must not change. The random state is replayed (``preserve_rng_state``) so
    dropout draws the same masks.
    """
    mods = list(modules) + ([fn] if isinstance(fn, nn.Module) else [])
    return _ckpt.checkpoint(fn, *args, use_reentrant=False, context_fn=_contexts(policy, mods, list(state)),
                            preserve_rng_state=preserve_rng_state, **kwargs)


# --- applying it to a model's blocks ------------------------------------------------------------------

Selector = Union[type, tuple, Callable[[str, nn.Module], bool], Sequence[str]]


def _selected(selector: Selector) -> Callable[[str, nn.Module], bool]:
    if isinstance(selector, type) or (isinstance(selector, tuple) and all(isinstance(t, type) for t in selector)):
        return lambda name, m: isinstance(m, selector)
    if callable(selector):
        return selector  # type: ignore[return-value]
    names = set(selector)
    return lambda name, m: name in names


def default_blocks(model: nn.Module) -> list[str]:
    """The repeated blocks of ``model``: the children of its largest ``nn.ModuleList`` (a
    transformer's layers, e.g. ``model.layers`` or ``model.model.layers``)."""
    best: Optional[tuple[str, nn.ModuleList]] = None
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) and (best is None or len(m) > len(best[1])):
            best = (name, m)
    if best is None:
        return []
    prefix = f"{best[0]}." if best[0] else ""
    return [f"{prefix}{i}" for i in range(len(best[1]))]


def checkpoint_blocks(model: nn.Module, blocks: Optional[Selector] = None, *, policy: Policy = "full", every: int = 1) -> list[str]:
    """Make every ``every``-th selected block of ``model`` checkpoint its forward; returns their names.

    ``blocks``: a module class (or tuple of classes), a predicate ``(name, module) -> bool``, or
    names; default :func:`default_blocks`. Nested matches inside a selected block are left alone.
    The block's forward is replaced on the instance (parameters, hooks and state_dict keys stay);
    its running statistics are written once per step (see :func:`checkpoint`).
    """
    if not isinstance(every, int) or every < 1:
        raise InvalidArgumentError("checkpoint_blocks", "every", "a positive int", repr(every))
    _contexts(policy, [], [])  # validates the policy now
    pick = _selected(blocks) if blocks is not None else _selected(default_blocks(model))
    chosen: list[str] = []
    covered: list[str] = []
    for name, m in model.named_modules():
        if m is model or any(name.startswith(c + ".") for c in covered) or not pick(name, m):
            continue
        covered.append(name)
        if (len(covered) - 1) % every:
            continue
        _wrap(m, policy)
        chosen.append(name)
    return chosen


def _wrap(module: nn.Module, policy: Policy) -> None:
    if "_hal_checkpoint" in module.__dict__:
        remove_checkpointing(module)
    inner = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, policy=policy, modules=[module], **kwargs)

    module.forward = forward  # type: ignore[method-assign]
    module.__dict__["_hal_checkpoint"] = (inner, policy)


def remove_checkpointing(model: nn.Module) -> int:
    """Undo :func:`checkpoint_blocks` on ``model`` and its submodules; returns how many were undone."""
    undone = 0
    for m in model.modules():
        entry = m.__dict__.pop("_hal_checkpoint", None)
        if entry is not None:
            m.__dict__.pop("forward", None)
            undone += 1
    return undone


__all__ = ["checkpoint", "checkpoint_blocks", "remove_checkpointing", "default_blocks", "selective_policy", "saves", "is_recomputing",
           "recompute_only",
           "EXPENSIVE_ATEN", "EXPENSIVE_HAL"]
