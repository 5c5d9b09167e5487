"""The decisions :func:`hal.optimize` makes before any step runs: how the model is rewritten
(``hal.nn.fuse``, else ``hal.nn.patch``) and whether the optimizer is replaced by
``hal.optim.AdamW`` (only where that computes the same update). These make the *rewritten* variant
of the step; the user's model and optimizer, untouched, are the other one, and the measurement
decides. Each returns what it did and why, in words that :meth:`hal.OptimizedStep.explain` prints."""

from __future__ import annotations

import collections
import copy
import dataclasses
import time
from typing import Any, Optional

import torch
from torch import nn

#: how the model may be rewritten: both tried in this order ("auto"), one of them, or neither
REWRITES = ("auto", "fuse", "patch", "none")


@dataclasses.dataclass(frozen=True)
class Decision:
    """One decision: what was chosen, why, and what it cost (seconds)."""

    choice: str
    reason: str
    seconds: float = 0.0


def _hal_modules(model: nn.Module) -> collections.Counter:
    """hal's module classes in ``model`` and how many of each (what a rewrite put there)."""
    return collections.Counter(type(m).__name__ for m in model.modules() if type(m).__module__.startswith("hal."))


def _counted(counts: collections.Counter) -> str:
    return ", ".join(f"{n} x{c}" for n, c in sorted(counts.items()))


def twin(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s module tree that shares everything but the tree: each module is copied
    shallowly (its parameters, buffers and hook dictionaries are the model's own objects, so steps on
    either train both, and hooks registered on either run in both), its children are twins.
    :func:`rewrite` patches a twin, so that the model itself stays as the user gave it."""
    twins: dict[int, nn.Module] = {}

    def copy_tree(m: nn.Module) -> nn.Module:
        if id(m) not in twins:
            new = twins[id(m)] = copy.copy(m)
            new.__dict__["_modules"] = {name: None if c is None else copy_tree(c) for name, c in m._modules.items()}
        return twins[id(m)]

    return copy_tree(model)


def rewrite(model: nn.Module, how: str) -> tuple[nn.Module, Decision]:
    """The rewritten model and the decision; ``model`` itself is not changed. ``hal.nn.fuse(model,
    inplace=True)`` (a GraphModule sharing the model's modules and parameters) when it traces and
    fuses something, else ``hal.nn.patch`` of a :func:`twin` of the model (the same function, the
    same parameters); ``model`` itself where neither changes anything."""
    if how not in REWRITES:
        raise ValueError(f"hal.optimize: rewrite must be one of {', '.join(map(repr, REWRITES))}, not {how!r}")
    if how == "none":
        return model, Decision("none", "rewrite='none': the model runs as it is")
    import hal.nn
    from hal.nn.fuse import fuse_notes

    started = time.perf_counter()
    before = _hal_modules(model)
    why_not_fuse = "rewrite='patch'"
    if how in ("auto", "fuse"):
        try:
            fused = hal.nn.fuse(model, inplace=True)
        except Exception as exc:  # noqa: BLE001 - whatever fuse raises, patch is the fallback ("auto")
            why_not_fuse = str(exc).split("; fuse the traceable")[0]
            if not isinstance(exc, ValueError):
                why_not_fuse = f"hal.nn.fuse failed ({type(exc).__name__}: {why_not_fuse})"
            if how == "fuse":
                raise ValueError(f"hal.optimize(rewrite='fuse'): {exc}; pass rewrite='auto' to fall back to hal.nn.patch") from exc
        else:
            added = _hal_modules(fused) - before
            if added or how == "fuse":
                what = _counted(added) or "nothing to fuse"
                notes = "".join(f"; {n}" for n in fuse_notes(fused))
                return fused, Decision("fuse", f"hal.nn.fuse traced the model (torch.fx): {what}{notes}", time.perf_counter() - started)
            why_not_fuse = "hal.nn.fuse traced the model but found no chain to fuse"
    patched = hal.nn.patch(twin(model))
    added = _hal_modules(patched) - before
    if not added:
        return model, Decision("patch", f"{why_not_fuse}; hal.nn.patch found no module it knows", time.perf_counter() - started)
    return patched, Decision("patch", f"{why_not_fuse}; hal.nn.patch swapped {_counted(added)}", time.perf_counter() - started)


def recompute(model: nn.Module, rewritten: nn.Module, policy: Optional[str]) -> tuple[nn.Module, Decision]:
    """The ``hal`` variant's model with its repeated blocks recomputing their activations
    (``hal.nn.recompute`` with ``policy``), and the decision. ``model`` itself is not changed: where
    the rewrite left it as it is, a :func:`twin` is made to recompute."""
    from hal.nn.recompute import POLICIES, blocks, recompute as recompute_blocks

    if policy is None:
        return rewritten, Decision("none", "activations held from forward to backward (recompute=None)")
    if policy not in POLICIES:
        raise ValueError(f"hal.optimize: recompute must be None or one of {', '.join(map(repr, POLICIES))}, not {policy!r}")
    found = blocks(rewritten)
    if not found:
        return rewritten, Decision("none", f"recompute={policy!r}, but the {'fused ' if rewritten is not model else ''}model has no "
                                           "repeated blocks (an nn.ModuleList of two or more modules of one class): nothing recomputed")
    target = twin(model) if rewritten is model else rewritten  # a twin has the same blocks, as copies
    count = recompute_blocks(target, policy)
    kinds = _counted(collections.Counter(type(b).__name__ for b in found))
    what = ("keep the outputs of GEMMs and attention and recompute the rest (norms, activations, rotary embeddings)"
            if policy == "selective" else "keep their inputs only and run their forward again")
    return target, Decision(policy, f"{count} blocks ({kinds}) {what} in the backward, in the 'hal' variant (hal.nn.recompute)")


def fp8(model: nn.Module, rewritten: nn.Module, recipe: Any) -> tuple[nn.Module, Decision]:
    """The ``hal`` variant's model with its linear layers in FP8 (``hal.fp8.convert(...,
    within="auto")``: those of its repeated blocks, else all but the first and last), and the
    decision. ``model`` itself is not changed: where the rewrite left it as it is, a :func:`twin` is
    converted (a fused GraphModule is converted itself: its containers are its own). A device without
    FP8 keeps the autocast dtype, with the reason."""
    import hal.fp8
    from hal.errors import UnsupportedError
    from hal.nn.recompute import blocks

    if recipe is None:
        return rewritten, Decision("none", "linear layers in the autocast dtype (fp8=None)")
    if not isinstance(recipe, hal.fp8.Recipe):
        raise TypeError(f"hal.optimize: fp8 must be None or a hal.fp8 recipe (hal.fp8.CurrentScaling(), "
                        f"hal.fp8.DelayedScaling(), hal.fp8.RowwiseScaling(), ...), not {type(recipe).__name__}")
    target = twin(model) if rewritten is model else rewritten
    where = ("inside its repeated blocks (embeddings, LM head and layers outside the blocks stay in the autocast dtype)"
             if blocks(target) else "all but the first and last (the model has no repeated blocks)")
    try:
        hal.fp8.convert(target, recipe, within="auto")
    except UnsupportedError as exc:
        return rewritten, Decision("none", f"fp8={recipe} asked, but {str(exc).splitlines()[0]} (kept in the autocast dtype)")
    converted = sum(isinstance(m, hal.fp8.Linear) for m in target.modules())
    if not converted:
        return rewritten, Decision("none", f"fp8={recipe} asked, but the model has no nn.Linear to convert")
    # decoder layers whose FP8 projections take their inputs' amaxes from the norms and the SwiGLU (hal.nn.patch_hf_amax)
    passing = sum(bool(getattr(type(m), "_hal_passes_amaxes", False)) for m in target.modules())
    amaxes = (f"; {passing} decoder layers hand their FP8 projections the amaxes of their inputs, reduced by "
              "rms_norm_amax and swiglu_amax as they write them (each input's cast reads it once)") if passing else ""
    return target, Decision("fp8", f"{converted} nn.Linear layers {where} run their GEMMs in FP8 with {recipe}, "
                                   f"in the 'hal' variant (hal.fp8.convert){amaxes}")


# --- the optimizer ---------------------------------------------------------------------------------

#: the hyperparameters hal.optim.AdamW reads from a group (all others must be at their AdamW defaults)
HYPER = ("lr", "betas", "eps", "weight_decay")


def _why_not_adamw(opt: torch.optim.Optimizer) -> Optional[str]:
    """Why ``opt``'s update differs from hal.optim.AdamW's (None: the same update, to rounding)."""
    kind = type(opt)
    if kind not in (torch.optim.AdamW, torch.optim.Adam):
        return f"{kind.__module__}.{kind.__qualname__} is not torch.optim.AdamW or torch.optim.Adam (hal has a fused AdamW only)"
    for i, group in enumerate(opt.param_groups):
        why = _why_not_adamw_group(kind, i, group)
        if why is not None:
            return why
    return None


def _why_not_adamw_group(kind: type, i: int, group: dict[str, Any]) -> Optional[str]:
    """Why param group ``i`` of a torch.optim.AdamW or Adam is not hal.optim.AdamW's update (None: it is)."""
    for flag in ("amsgrad", "maximize", "differentiable"):
        if group.get(flag, False):
            return f"param group {i} sets {flag}=True, which hal.optim.AdamW does not implement"
    if isinstance(group["lr"], torch.Tensor) or isinstance(group["betas"][0], torch.Tensor):
        return f"param group {i} has a tensor learning rate or betas (hal.optim.AdamW takes numbers)"
    decoupled = kind is torch.optim.AdamW or group.get("decoupled_weight_decay", False)
    if not decoupled and group["weight_decay"] != 0:
        return (f"torch.optim.Adam with weight_decay={group['weight_decay']} adds L2 to the gradient, while "
                "AdamW decays the weights (decoupled): not the same update")
    if any(p.is_sparse for p in group["params"]):
        return f"param group {i} has sparse parameters"
    return None


def choose_optimizer(model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                     replace: bool) -> tuple[torch.optim.Optimizer, Decision]:
    """The optimizer the step uses, and why. None: ``hal.optim.AdamW`` over the model's parameters
    with ``torch.optim.AdamW``'s defaults. A ``torch.optim.AdamW`` (or ``Adam`` without coupled
    weight decay) becomes ``hal.optim.AdamW`` over the same parameter groups and hyperparameters,
    its state (a resumed run's moments and step counts) loaded; anything else is kept."""
    import hal.optim

    if optimizer is None:
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("hal.optimize: the model has no parameter that requires grad; there is nothing to train")
        return hal.optim.AdamW(params), Decision(
            "hal.optim.AdamW", "no optimizer given: hal.optim.AdamW over the model's parameters with torch.optim.AdamW's "
            "defaults (lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"hal.optimize: optimizer must be a torch.optim.Optimizer or None, not {type(optimizer).__name__}")
    name = type(optimizer).__name__
    if isinstance(optimizer, hal.optim.AdamW):
        return optimizer, Decision("hal.optim.AdamW", "already hal.optim.AdamW: kept")
    if not replace:
        return optimizer, Decision(f"{name} (kept)", "replace_optimizer=False")
    why = _why_not_adamw(optimizer)
    if why is not None:
        return optimizer, Decision(f"{name} (kept)", f"kept: {why}")
    groups = [{**{k: g[k] for k in HYPER}, "params": list(g["params"])} for g in optimizer.param_groups]
    new = hal.optim.AdamW(groups)
    if optimizer.state:
        state = optimizer.state_dict()
        for g in state["param_groups"]:
            g.setdefault("master_weights", False)
        new.load_state_dict(state)
    decay = "weight_decay=0" if all(g["weight_decay"] == 0 for g in optimizer.param_groups) else "decoupled weight decay"
    return new, Decision("hal.optim.AdamW", (
        f"replaced {name}: the same update ({decay}, no amsgrad/maximize) as one fused hal.ops.fused_adamw_ per step; "
        f"{len(groups)} param group(s) and their hyperparameters carried over"
        + (", state loaded" if optimizer.state else "")
        + "; learning rates set on your optimizer (a scheduler) are copied in before each step"))


def hyperparameters(optimizer: torch.optim.Optimizer) -> tuple:
    """The groups' hyperparameters that the step reads, and how many parameters each group has, as
    one comparable value (a group added, or parameters added to one, change it)."""
    return tuple((len(g["params"]), *(_plain(g.get(k)) for k in HYPER)) for g in optimizer.param_groups)


def _plain(v: Any) -> Any:
    if isinstance(v, torch.Tensor):  # updated in place, which a graph sees; reading it would synchronise
        return ("tensor", id(v))
    if isinstance(v, (tuple, list)):
        return tuple(_plain(x) for x in v)
    return v


def sync_optimizer(source: torch.optim.Optimizer, target: torch.optim.Optimizer) -> list[str]:
    """Make ``target`` (hal's AdamW standing in for ``source``) follow ``source``: its groups'
    hyperparameters copied, and groups added to ``source`` since (``add_param_group``) added to
    ``target``, so that they are trained (their gradients, accumulated while no optimizer zeroed
    them, cleared as a plain loop's ``zero_grad()`` would). Returns what was added, in words. Raises RuntimeError where
    ``target`` cannot follow (a group's parameters changed, a new group with another update)."""
    def params_of(group: dict[str, Any]) -> list[int]:
        return [id(p) for p in group["params"]]

    if len(source.param_groups) < len(target.param_groups) or any(
            params_of(s) != params_of(t) for s, t in zip(source.param_groups, target.param_groups)):
        raise RuntimeError(
            f"hal.optimize: the parameters of your {type(source).__name__}'s param groups changed after hal.optimize replaced "
            "it by hal.optim.AdamW, which steps the groups it was given; add parameters with optimizer.add_param_group, "
            "or call hal.optimize again (pass replace_optimizer=False to keep your optimizer)")
    added = []
    for i in range(len(target.param_groups), len(source.param_groups)):
        group = source.param_groups[i]
        why = _why_not_adamw_group(type(source), i, group)
        if why is not None:
            raise RuntimeError(f"hal.optimize: a param group was added to your {type(source).__name__} after hal.optimize replaced it "
                               f"by hal.optim.AdamW, and {why}; call hal.optimize again, or pass replace_optimizer=False")
        target.add_param_group({**{k: group[k] for k in HYPER}, "params": list(group["params"])})
        for p in group["params"]:  # gradients accumulated while no optimizer held them: a plain loop's zero_grad() clears them
            p.grad = None
        added.append(f"param group {i} ({len(group['params'])} parameter(s))")
    for s, t in zip(source.param_groups, target.param_groups):
        for k in HYPER:
            t[k] = s[k]
    return added
