"""The decisions :func:`hal.optimize` makes before any step runs: how the model is rewritten
(``hal.nn.fuse``, else ``hal.nn.patch``) and whether the optimizer is replaced by
``hal.optim.AdamW`` (only where that computes the same update). Each returns what it did and why,
in words that :meth:`hal.OptimizedStep.explain` prints."""

from __future__ import annotations

import collections
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


def rewrite(model: nn.Module, how: str) -> tuple[nn.Module, Decision]:
    """The model to run and the decision: ``hal.nn.fuse(model, inplace=True)`` (a GraphModule
    sharing the model's modules and parameters; the user's model object is not changed) when it
    traces and fuses something, else ``hal.nn.patch(model)`` (the model itself, modules swapped in
    place; the same function, the same state_dict keys)."""
    if how not in REWRITES:
        raise ValueError(f"hal.optimize: rewrite must be one of {', '.join(map(repr, REWRITES))}, not {how!r}")
    if how == "none":
        return model, Decision("none", "rewrite='none': the model runs as it is")
    import hal.nn

    started = time.perf_counter()
    before = _hal_modules(model)
    why_not_fuse = "rewrite='patch'"
    if how in ("auto", "fuse"):
        try:
            fused = hal.nn.fuse(model, inplace=True)
        except ValueError as exc:
            why_not_fuse = str(exc).split("; fuse the traceable")[0]
            if how == "fuse":
                raise ValueError(f"hal.optimize(rewrite='fuse'): {exc}; pass rewrite='auto' to fall back to hal.nn.patch") from exc
        else:
            added = _hal_modules(fused) - before
            if added or how == "fuse":
                what = _counted(added) or "nothing to fuse"
                return fused, Decision("fuse", f"hal.nn.fuse traced the model (torch.fx): {what}", time.perf_counter() - started)
            why_not_fuse = "hal.nn.fuse traced the model but found no chain to fuse"
    hal.nn.patch(model)
    added = _hal_modules(model) - before
    what = _counted(added) or "no module it knows"
    return model, Decision("patch", f"{why_not_fuse}; hal.nn.patch swapped {what}", time.perf_counter() - started)


# --- the optimizer ---------------------------------------------------------------------------------

#: the hyperparameters hal.optim.AdamW reads from a group (all others must be at their AdamW defaults)
HYPER = ("lr", "betas", "eps", "weight_decay")


def _why_not_adamw(opt: torch.optim.Optimizer) -> Optional[str]:
    """Why ``opt``'s update differs from hal.optim.AdamW's (None: the same update, to rounding)."""
    kind = type(opt)
    if kind not in (torch.optim.AdamW, torch.optim.Adam):
        return f"{kind.__module__}.{kind.__qualname__} is not torch.optim.AdamW or torch.optim.Adam (hal has a fused AdamW only)"
    for i, group in enumerate(opt.param_groups):
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
    """The groups' hyperparameters that the step reads, as one comparable value."""
    return tuple(tuple(_plain(g.get(k)) for k in HYPER) for g in optimizer.param_groups)


def _plain(v: Any) -> Any:
    if isinstance(v, torch.Tensor):  # updated in place, which a graph sees; reading it would synchronise
        return ("tensor", id(v))
    if isinstance(v, (tuple, list)):
        return tuple(_plain(x) for x in v)
    return v


def copy_hyperparameters(source: torch.optim.Optimizer, target: torch.optim.Optimizer) -> None:
    """Set ``target``'s group hyperparameters to ``source``'s (same groups, in order)."""
    for s, t in zip(source.param_groups, target.param_groups):
        for k in HYPER:
            t[k] = s[k]
