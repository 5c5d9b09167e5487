"""hal.optim.AdamW: ``torch.optim.AdamW`` on ``hal.ops.fused_adamw_``, with fp32 master weights.

One fused step per group of tensors sharing (device, dtype, step count, master weights), instead of
one small op per tensor and per formula term. With ``master_weights=True``, float16 and bfloat16
parameters get a float32 master copy in the optimizer state (``state["master_param"]``) and float32
moments: the update is applied to the master and rounded into the parameter, so updates smaller
than the parameter's precision are not lost. Without it, moments have the parameter's dtype, as in
``torch.optim.AdamW``.

With ``hal.amp.DynamicLossScaler`` the step receives ``found_inf``: the kernel skips the update when
it is non-zero, and the step count does not advance (as a step that GradScaler skips).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Union

import torch

import hal

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class AdamW(torch.optim.Optimizer):
    """AdamW with decoupled weight decay; arguments as ``torch.optim.AdamW`` (plus ``master_weights``)."""

    #: tells hal.amp.DynamicLossScaler to pass ``found_inf`` to :meth:`step` (skipped on the device).
    supports_found_inf = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        master_weights: bool = False,
    ) -> None:
        if not 0.0 <= float(lr):
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, master_weights=master_weights)
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Also when loading a state_dict of torch.optim.AdamW, whose groups lack master_weights."""
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("master_weights", self.defaults.get("master_weights", False))

    def _state_of(self, p: torch.Tensor, master: bool, fresh_step: dict[Any, torch.Tensor]) -> dict[str, Any]:
        """The state of ``p``, created on its first step: float32 moments and a master copy where the
        group asks for master weights and p is half precision, and the step count, a 0-d float32
        tensor on p's device that every parameter starting in the same step and group shares (one
        count per fused launch: the kernel reads it on the device)."""
        state = self.state[p]
        wants_master = master and p.dtype in _LOW_PRECISION
        if not state:
            moment_dtype = torch.float32 if wants_master else p.dtype
            if p.device not in fresh_step:
                fresh_step[p.device] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["step"] = fresh_step[p.device]
            state["exp_avg"] = torch.zeros_like(p, dtype=moment_dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=moment_dtype, memory_format=torch.preserve_format)
        if wants_master and "master_param" not in state:
            state["master_param"] = p.detach().to(torch.float32, copy=True)
        return state

    def _share_steps(self) -> None:
        """After loading a state_dict (one step tensor per parameter, perhaps on the CPU): the counts
        moved to their parameters' devices and shared by the parameters of a group at one count, so
        that they step in one launch again. Reads the counts once (on a load, not in a step)."""
        for group in self.param_groups:
            shared: dict[tuple[Any, float], torch.Tensor] = {}
            for p in group["params"]:
                state = self.state.get(p)
                if not state or "step" not in state:
                    continue
                step = state["step"]
                value = float(step)
                key = (p.device, value)
                if key not in shared:
                    shared[key] = torch.full((), value, dtype=torch.float32, device=p.device)
                state["step"] = shared[key]
        self._steps_shared = True

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._steps_shared = False

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, *, found_inf: Union[torch.Tensor, float, None] = None) -> Any:
        """One AdamW step over every parameter with a gradient.

        ``found_inf``: a non-zero value (a 0-d tensor from ``hal.ops.amp_unscale_``, or a number)
        means the gradients overflowed: nothing is updated and step counts stay. Nothing is read
        back to the host and nothing is copied to the device: the step counts live on the device
        (incremented there, by 1 or, with a tensor ``found_inf``, by ``found_inf == 0``), so a step
        can be captured in a CUDA graph and replayed.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not getattr(self, "_steps_shared", True):
            self._share_steps()
        skip_all = found_inf is not None and not isinstance(found_inf, torch.Tensor) and float(found_inf) != 0.0
        if skip_all:
            return loss
        for group in self.param_groups:
            buckets: dict[tuple, list[tuple[torch.Tensor, dict[str, Any]]]] = {}
            fresh_step: dict[Any, torch.Tensor] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("hal.optim.AdamW does not support sparse gradients; use dense gradients")
                state = self._state_of(p, group["master_weights"], fresh_step)
                key = (p.device, p.dtype, "master_param" in state, state["exp_avg"].dtype, id(state["step"]))
                buckets.setdefault(key, []).append((p, state))
            for (device, _, has_master, _, _), members in buckets.items():
                states = [s for _, s in members]
                step = states[0]["step"]
                skip = found_inf.to(device) if isinstance(found_inf, torch.Tensor) else None
                step.add_(1.0 if skip is None else (skip == 0).to(step.dtype))
                hal.ops.fused_adamw_(
                    [p for p, _ in members],
                    [p.grad for p, _ in members],
                    [s["exp_avg"] for s in states],
                    [s["exp_avg_sq"] for s in states],
                    lr=float(group["lr"]),
                    beta1=float(group["betas"][0]),
                    beta2=float(group["betas"][1]),
                    eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]),
                    step=step,
                    master_params=[s["master_param"] for s in states] if has_master else None,
                    found_inf=skip,
                )
        return loss
