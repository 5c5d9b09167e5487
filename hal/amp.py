"""Dynamic loss scaling for mixed-precision training, with a readable history.

:class:`DynamicLossScaler` behaves as ``torch.amp.GradScaler`` (same arguments, methods, errors and
scale arithmetic in float32) and unscales gradients with ``hal.ops.amp_unscale_``, which multiplies
by 1/scale and checks for non-finite values in one pass. With ``hal.optim.AdamW`` the overflow flag
goes to the fused optimizer step (``found_inf``), which skips the update on the device; other
optimizers are skipped on the host, as GradScaler does.

Nothing in a step reads the device from the host: the scale, the growth tracker and the overflow
flags stay on the device and ``update()`` adjusts them there (``torch._amp_update_scale_``), so a
training step with the scaler neither synchronises nor copies to the device. Its
:class:`ScalerHistory` records, per ``update()``, the scale that step used, which steps overflowed
and the run of consecutive overflows; it is read from the device when ``history`` is looked at
(a synchronisation the caller asks for). An optional :class:`ScalerPolicy` adds two habits
from large-scale practice: gradient statistics (norm, largest magnitude, share of zeros, a hint of
underflow) every N steps, and backing off only after K consecutive overflowing steps (Megatron-LM's
"hysteresis"), so that one spike does not halve the scale.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import operator
from typing import Any, Iterable, Optional, Sequence, Union

import torch

import hal
from hal import dispatch, tracing
from hal.arrays import grouped


class _Stage(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclasses.dataclass(frozen=True)
class ScalerPolicy:
    """Optional behaviour on top of GradScaler's.

    ``stats_every``: every N-th step (counting ``update()`` calls from 0), record gradient statistics
    of the unscaled gradients in the history (0: never). ``backoff_after``: multiply the scale by
    ``backoff_factor`` only once K consecutive steps have overflowed, and on each further
    consecutive overflow (1: every overflow, as GradScaler). Overflowing steps are skipped either way.
    """

    stats_every: int = 0
    backoff_after: int = 1

    def __post_init__(self) -> None:
        if self.stats_every < 0:
            raise ValueError(f"stats_every must be >= 0 (0 disables the statistics), not {self.stats_every}")
        if self.backoff_after < 1:
            raise ValueError(f"backoff_after must be >= 1 (1 backs off on every overflow), not {self.backoff_after}")


@dataclasses.dataclass(frozen=True)
class GradStats:
    """Statistics of the unscaled gradients of one step (all optimizers of the step together)."""

    step: int
    norm: float  # L2 norm over every gradient
    max_abs: float
    zero_fraction: float  # share of exact zeros: many of them hint at fp16 underflow (scale too low)


@dataclasses.dataclass
class ScalerHistory:
    """What the scaler did, one entry per ``update()``."""

    #: the scale each step's loss was multiplied by.
    scales: list[float] = dataclasses.field(default_factory=list)
    #: indices (0-based ``update()`` count) of steps whose gradients were not finite (skipped steps).
    overflow_steps: list[int] = dataclasses.field(default_factory=list)
    #: how many steps in a row have overflowed up to now (0 after a finite step).
    consecutive_overflows: int = 0
    #: the longest such run seen.
    max_consecutive_overflows: int = 0
    #: gradient statistics, every ``policy.stats_every`` steps.
    grad_stats: list[GradStats] = dataclasses.field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.scales)

    def __str__(self) -> str:
        last = f"{self.scales[-1]:g}" if self.scales else "-"
        return (
            f"{self.steps} steps, {len(self.overflow_steps)} overflowed (skipped), last step scaled by {last}, "
            f"{self.consecutive_overflows} consecutive overflows (max {self.max_consecutive_overflows})"
        )


Outputs = Union[torch.Tensor, Iterable[Any]]


class DynamicLossScaler:
    """``torch.amp.GradScaler`` for hal: scale the loss, unscale and check gradients, skip steps
    that overflowed, grow the scale after ``growth_interval`` finite steps and back off on overflow.

    Unlike GradScaler it also unscales float16 gradients: half-precision parameters are fine with
    ``hal.optim.AdamW(master_weights=True)``, which keeps float32 masters.

    Typical use (as with GradScaler)::

        scaler = hal.amp.DynamicLossScaler()
        scaler.scale(loss).backward()
        scaler.step(optimizer)      # unscale_ first if not done; skipped when gradients overflowed
        scaler.update()
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        policy: Optional[ScalerPolicy] = None,
    ) -> None:
        if growth_factor <= 1.0:
            raise ValueError(f"growth_factor must be > 1.0, not {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), not {backoff_factor}")
        if int(growth_interval) <= 0:
            raise ValueError(f"growth_interval must be a positive int, not {growth_interval}")
        self._enabled = bool(enabled)
        self._init_scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self.policy = policy or ScalerPolicy()
        self._history = ScalerHistory()
        #: (scale used, overflow flag) of each update() not yet read into the history: device tensors
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._scale: Optional[torch.Tensor] = None  # float32, on the device of the first scaled loss
        self._growth_tracker: Optional[torch.Tensor] = None  # int32, beside the scale
        self._consecutive: Optional[torch.Tensor] = None  # int32 run of overflowing steps (the backoff policy)
        self._loaded_tracker = 0
        self._per_optimizer: dict[int, dict[str, Any]] = {}
        #: per optimizer, the amp_unscale_ plan held for each (device, dtype) group (see _unscale)
        self._unscale_plans: dict[int, dict[Any, Any]] = {}

    @property
    def history(self) -> ScalerHistory:
        """What the scaler did, one entry per ``update()`` (reads the pending entries from the device)."""
        for used, found in self._pending:
            self._record(float(used), bool(found))
        self._pending.clear()
        return self._history

    # --- GradScaler's surface -----------------------------------------------------------------

    def is_enabled(self) -> bool:
        return self._enabled

    def scale(self, outputs: Outputs) -> Outputs:
        """``outputs`` (a tensor or nested lists/tuples of tensors) multiplied by the scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            return outputs * self._scale_on(outputs.device)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        if isinstance(outputs, Iterable):
            return map(self.scale, outputs)
        raise ValueError("outputs must be a Tensor or an iterable of Tensors")

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place and record whether any was not
        finite (``hal.ops.amp_unscale_``). At most once per optimizer between updates."""
        if not self._enabled:
            return
        state = self._state(optimizer)
        if state["stage"] is _Stage.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        if self._scale is None:
            raise RuntimeError("unscale_() was called before scale(): no loss has been scaled in this iteration.")
        inv_scale = self._scale.double().reciprocal().float()
        grads = _grads_by_device_and_dtype(optimizer)
        found = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        plans = self._unscale_plans.setdefault(id(optimizer), {})
        for key, group in grads.items():
            flag = _unscale(plans, key, group, inv_scale.to(key[0]))
            found = found + flag.to(found.device)
        if grads:  # as GradScaler: an optimizer without gradients records no inf check
            state["found_inf"] = found
            state["grads"] = [g for group in grads.values() for g in group]
        state["stage"] = _Stage.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (if not done), then step the optimizer unless its gradients overflowed.

        An optimizer with ``supports_found_inf`` (``hal.optim.AdamW``) always steps and receives
        ``found_inf``: its fused kernel skips the update when it is non-zero. Returns what the
        optimizer's step returned (None when skipped).
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if DynamicLossScaler is enabled.")
        state = self._state(optimizer)
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is _Stage.READY:
            self.unscale_(optimizer)
        if "found_inf" not in state:
            raise AssertionError("No inf checks were recorded for this optimizer (none of its parameters has a gradient).")
        if getattr(optimizer, "supports_found_inf", False):
            result = optimizer.step(*args, found_inf=state["found_inf"], **kwargs)
        else:
            result = None if float(state["found_inf"]) else optimizer.step(*args, **kwargs)
        state["stage"] = _Stage.STEPPED
        return result

    def update(self, new_scale: Union[float, torch.Tensor, None] = None) -> None:
        """End the iteration: record it in the history, then adjust the scale (or set ``new_scale``)."""
        if not self._enabled:
            return
        checked = [s for s in self._per_optimizer.values() if "found_inf" in s]
        if self._scale is None or (new_scale is None and not checked):
            raise AssertionError("No inf checks were recorded prior to update().")
        scale = self._scale
        found = sum((s["found_inf"].to(scale.device) for s in checked), torch.zeros((), dtype=torch.float32, device=scale.device))
        step = self._history.steps + len(self._pending)
        every = self.policy.stats_every
        if checked and every and step % every == 0:  # the policy's statistics: read now (a synchronisation it asks for)
            self._history.grad_stats.append(_grad_stats(step, [g for s in checked for g in s["grads"]]))
        self._pending.append((scale.clone(), found))
        if new_scale is not None:
            if isinstance(new_scale, torch.Tensor):
                scale.copy_(new_scale.reshape(()))
            else:
                scale.fill_(float(new_scale))
        else:
            self._adjust(found)
        self._per_optimizer.clear()

    def get_scale(self) -> float:
        """The current scale (``init_scale`` before the first ``scale()``; 1.0 when disabled)."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale)  # a synchronisation, as GradScaler's

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def state_dict(self) -> dict[str, Any]:
        """GradScaler's state_dict keys (loadable by ``torch.amp.GradScaler``) plus the run of
        consecutive overflows; empty when disabled."""
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": int(self._growth_tracker) if self._growth_tracker is not None else self._loaded_tracker,
            "consecutive_overflows": self.history.consecutive_overflows,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict of this class or of ``torch.amp.GradScaler``."""
        if not self._enabled:
            return
        if not state_dict:
            raise RuntimeError("The source state dict is empty, possibly because it was saved from a disabled instance of the scaler.")
        self._init_scale = float(state_dict["scale"])
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._loaded_tracker = int(state_dict["_growth_tracker"])
        if self._growth_tracker is not None:
            self._growth_tracker.fill_(self._loaded_tracker)
        self.history.consecutive_overflows = int(state_dict.get("consecutive_overflows", 0))
        if self._consecutive is not None:
            self._consecutive.fill_(self.history.consecutive_overflows)

    # --- internals ------------------------------------------------------------------------------

    def _scale_on(self, device: torch.device) -> torch.Tensor:
        if self._scale is None:
            self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=device)
            self._growth_tracker = torch.full((), self._loaded_tracker, dtype=torch.int32, device=device)
            self._consecutive = torch.full((), self.history.consecutive_overflows, dtype=torch.int32, device=device)
        return self._scale if self._scale.device == device else self._scale.to(device)

    def _state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return self._per_optimizer.setdefault(id(optimizer), {"stage": _Stage.READY})

    def _adjust(self, found: torch.Tensor) -> None:
        """GradScaler's update on the device, in float32: back off on overflow (with the policy's
        hysteresis: only from the K-th overflowing step in a row), grow after growth_interval finite
        steps where the grown scale stays finite. No value comes to the host."""
        scale, tracker, run = self._scale, self._growth_tracker, self._consecutive
        assert scale is not None and tracker is not None and run is not None
        if self.policy.backoff_after == 1:  # GradScaler's own update kernel
            torch._amp_update_scale_(scale, tracker, found, self._growth_factor, self._backoff_factor, self._growth_interval)
            return
        overflow = found > 0
        run.copy_(torch.where(overflow, run + 1, 0))
        backoff = overflow & (run >= self.policy.backoff_after)
        scale.copy_(torch.where(backoff, scale * self._backoff_factor, scale))
        tracker.copy_(torch.where(overflow, 0, tracker + 1))
        grow = tracker >= self._growth_interval
        grown = scale * self._growth_factor
        scale.copy_(torch.where(grow & torch.isfinite(grown), grown, scale))
        tracker.copy_(torch.where(grow, 0, tracker))

    def _record(self, used: float, overflow: bool) -> None:
        h = self._history
        step = h.steps
        h.scales.append(used)
        if overflow:
            h.overflow_steps.append(step)
            h.consecutive_overflows += 1
            h.max_consecutive_overflows = max(h.max_consecutive_overflows, h.consecutive_overflows)
        else:
            h.consecutive_overflows = 0


_GRAD = operator.attrgetter("grad")
_IS_SPARSE = operator.attrgetter("is_sparse")
_DEVICE_DTYPE = operator.attrgetter("device", "dtype")


def _unscale(plans: dict[Any, dispatch.Held], key: tuple[Any, torch.dtype], grads: Sequence[torch.Tensor],
             inv_scale: torch.Tensor) -> torch.Tensor:
    """hal.ops.amp_unscale_ of one (device, dtype) group through the plan kept for that group: held
    while the gradients have the same shapes and strides (their dtype and device are the group's),
    instead of the cache key over every tensor (about 0.1 ms per 161 tensors on the CPU VM)."""
    if tracing.is_compiling():
        return hal.ops.amp_unscale_(grads, inv_scale)
    held = plans.get(key)
    if held is None:
        held = plans[key] = dispatch.Held()
    return held.get(dispatch.layout_of(grads), lambda: dispatch.bind("amp_unscale_", grads, inv_scale))(grads, inv_scale)


def _grads_by_device_and_dtype(optimizer: torch.optim.Optimizer) -> dict[tuple[Any, torch.dtype], Sequence[torch.Tensor]]:
    """The gradients of every parameter group, by (device, dtype): C-level passes over the
    parameters (a model's hundreds of tensors in microseconds), one group in the common case."""
    grads = [g for group in optimizer.param_groups for g in map(_GRAD, group["params"]) if g is not None]
    if any(map(_IS_SPARSE, grads)):
        raise ValueError("DynamicLossScaler does not unscale sparse gradients; use dense gradients")
    return grouped(grads, _DEVICE_DTYPE)


def _grad_stats(step: int, grads: list[torch.Tensor]) -> GradStats:
    if not grads:
        return GradStats(step, 0.0, 0.0, 0.0)
    with torch.no_grad():
        sq = sum(torch.sum(g.detach().float() ** 2).cpu() for g in grads)
        max_abs = max(float(g.detach().abs().max()) for g in grads)
        zeros = sum(int((g == 0).sum()) for g in grads)
        total = sum(g.numel() for g in grads)
    return GradStats(step, math.sqrt(float(sq)), max_abs, zeros / max(total, 1))
