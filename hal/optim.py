"""hal.optim.AdamW: ``torch.optim.AdamW`` on ``hal.ops.fused_adamw_``, with fp32 master weights.

One fused step per group of tensors sharing (device, dtype, step count, master weights), instead of
one small op per tensor and per formula term. With ``master_weights=True``, float16 and bfloat16
parameters get a float32 master copy in the optimizer state (``state["master_param"]``) and float32
moments: the update is applied to the master and rounded into the parameter, so updates smaller
than the parameter's precision are not lost. Without it, moments have the parameter's dtype, as in
``torch.optim.AdamW``.

With ``hal.amp.DynamicLossScaler`` the step receives ``found_inf``: the kernel skips the update when
it is non-zero, and the step count does not advance (as a step that GradScaler skips).

:meth:`AdamW.write_copies` hands the optimizer half-precision copies of float32 parameters
(``hal.nn.weight_copies``: the copies autocast's linears read): the step then writes each copy from
its updated parameter in the update's own pass, the parameter being the copy's float32 master in
``fused_adamw_``. Measured on an H100 (2026-12-07) at Llama-3.2-1B's shape, hal.optimize's step spent
11.63 ms in the update and 2.1 ms in a separate pass writing the copies; in the update's pass they
cost 2 more bytes written per element instead of a pass reading 4 and writing 2 (about 1.4 ms less,
estimated by the bytes moved).

Checkpoints move both ways between this class and ``torch.optim.AdamW``: :meth:`AdamW.state_dict`
gives torch's layout (one step count per parameter), and :meth:`AdamW.load_state_dict` takes
torch's, keeping float32 masters and moments where master weights are on.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any, Callable, Iterable, Optional, Union

import torch

import hal
from hal import dispatch, tracing

_LOW_PRECISION = (torch.float16, torch.bfloat16)
#: torch.optim.AdamW options that change its update and that hal's AdamW does not have: a state saved
#: with one of them on is refused by load_state_dict
_TORCH_ONLY = ("amsgrad", "maximize")


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
        self._launch_cache: dict[tuple, list[_Launch]] = {}
        self._copies: dict[torch.Tensor, torch.Tensor] = {}  # parameter -> the copy its step writes
        self._unsettled = False  # step counts to share anew by launch at the next step (_settle_state)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Also when loading a state_dict of torch.optim.AdamW, whose groups lack master_weights
        (which calls this with the state and groups only: the copies handed over stay)."""
        super().__setstate__(state)
        self._launch_cache = {}
        self.__dict__.setdefault("_copies", {})
        self.__dict__.setdefault("_unsettled", False)
        for group in self.param_groups:
            group.setdefault("master_weights", self.defaults.get("master_weights", False))

    def write_copies(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """From the next step on, write half-precision copies of float32 parameters in the step's
        own kernel; returns the parameters whose copies it writes.

        ``pairs``: (parameter, copy), the parameter a float32 one of this optimizer's and the copy a
        float16 or bfloat16 tensor of its shape on its device (other pairs are left out: their
        copies are not written). Such parameters step in one ``hal.ops.fused_adamw_`` call per
        launch with the copies as its params and the parameters as their float32 masters: each
        parameter gets the same update as without a copy, from its float32 gradient, and its copy
        the updated value rounded, in the same pass. A step skipped (``found_inf``) writes neither,
        and a parameter without a gradient is not stepped: its copy stays what it was. Replaces the
        pairs of an earlier call (no pairs: no copies). Nothing is kept in the state_dict. Where
        parameters have stepped already, the next step reads their step counts once (a host
        synchronisation, as after load_state_dict): parameters with and without copies step in
        separate launches, each with its own count."""
        own = {id(p) for group in self.param_groups for p in group["params"]}
        self._copies = {p: copy for p, copy in pairs
                        if id(p) in own and p.dtype == torch.float32 and copy.dtype in _LOW_PRECISION
                        and copy.shape == p.shape and copy.device == p.device}
        self._launch_cache.clear()
        self._unsettled = self._unsettled or bool(self.state)
        return list(self._copies)

    def _launch_kind(self, p: torch.Tensor, master: bool) -> tuple[Any, ...]:
        """What the parameters of one fused launch share: device, dtype, a float32 master (where the
        group asks for master weights and p is half precision) and the dtype of the copy the step
        writes (None: none)."""
        copy = self._copies.get(p)
        return p.device, p.dtype, master and p.dtype in _LOW_PRECISION, None if copy is None else copy.dtype

    def _state_of(self, p: torch.Tensor, master: bool, fresh_step: dict[tuple[Any, ...], torch.Tensor]) -> dict[str, Any]:
        """The state of ``p``, created on its first step: float32 moments and a master copy where the
        group asks for master weights and p is half precision, and the step count, a 0-d float32
        tensor on p's device that every parameter starting in the same step and group and going
        into the same fused launch (:meth:`_launch_kind`) shares: the kernel reads it on the
        device, and each launch increments its own count once per step."""
        state = self.state[p]
        wants_master = master and p.dtype in _LOW_PRECISION
        if not state:
            moment_dtype = torch.float32 if wants_master else p.dtype
            launch = self._launch_kind(p, master)
            if launch not in fresh_step:
                fresh_step[launch] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["step"] = fresh_step[launch]
            state["exp_avg"] = torch.zeros_like(p, dtype=moment_dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=moment_dtype, memory_format=torch.preserve_format)
        if wants_master and "master_param" not in state:
            state["master_param"] = p.detach().to(torch.float32, copy=True)
        return state

    def _settle_state(self) -> None:
        """At the first step after loading a state_dict (one step tensor per parameter, perhaps on
        the CPU) or handing over copies (:meth:`write_copies`): the counts moved to their
        parameters' devices and shared by the parameters of a group at one count that go into one
        launch (:meth:`_launch_kind`), so that they step in one launch again and each count is
        incremented once per step; and a master weight that no
        longer rounds to its parameter is made again from the parameter. Such a master is stale:
        the parameter was updated without it (by torch.optim.AdamW, which carries hal's master
        along untouched, or by weights loaded since). Done at the step, not in the load, so that
        model weights loaded after the optimizer's state count. Reads the counts once."""
        for group in self.param_groups:
            shared: dict[tuple[Any, ...], torch.Tensor] = {}
            for p in group["params"]:
                state = self.state.get(p)
                if not state:
                    continue
                master = state.get("master_param")
                if master is not None and not torch.equal(master.to(p.dtype), p.detach()):
                    state["master_param"] = p.detach().to(torch.float32, copy=True)
                if "step" not in state:
                    continue
                value = float(state["step"])
                key = (*self._launch_kind(p, group["master_weights"]), value)  # one launch
                if key not in shared:
                    shared[key] = torch.full((), value, dtype=torch.float32, device=p.device)
                state["step"] = shared[key]
        self._unsettled = False

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.AdamW``'s layout: each parameter's state with its own step count, a 0-d
        float32 tensor on the CPU. hal shares one count among the parameters of a launch; a shared
        tensor handed out would be incremented once per parameter by torch's AdamW after loading.
        The other tensors are the optimizer's own, not copies, as in torch's state_dict."""
        packed = super().state_dict()
        on_host: dict[int, torch.Tensor] = {}  # one device-to-host copy per shared count

        def own_step(state: dict[str, Any]) -> dict[str, Any]:
            step = state.get("step")
            if not isinstance(step, torch.Tensor):
                return state
            if id(step) not in on_host:
                on_host[id(step)] = step.detach().to("cpu", torch.float32)
            return {**state, "step": on_host[id(step)].clone()}

        packed["state"] = {index: own_step(state) for index, state in packed["state"].items()}
        return packed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict of this class or of ``torch.optim.AdamW``. torch's loader casts every
        state tensor to its parameter's dtype; where a group keeps master weights for a half
        precision parameter, its float32 master and moments are put back in float32 (moments
        saved in half precision, from torch's AdamW, are widened; a missing master is made from
        the parameter at its next step), and where it does not, a saved master is dropped."""
        for group in state_dict.get("param_groups", ()):
            for option in _TORCH_ONLY:
                if group.get(option):
                    raise hal.InvalidArgumentError(
                        "hal.optim.AdamW.load_state_dict", "state_dict", f"the state of an AdamW without {option} (hal's "
                        f"AdamW has no {option}: it would continue another optimization than the one saved; keep "
                        "torch.optim.AdamW for this run)", f"a param group saved with {option}={group[option]!r}")
        saved = _saved_states_by_param(self.param_groups, state_dict)
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # master_weights set by __setstate__, which the load calls
            for p in group["params"]:
                state, kept = self.state.get(p), saved.get(p)
                if not state or kept is None:
                    continue
                if group["master_weights"] and p.dtype in _LOW_PRECISION:
                    for key in ("master_param", "exp_avg", "exp_avg_sq"):
                        value = kept.get(key)
                        if isinstance(value, torch.Tensor) and value.is_floating_point():
                            state[key] = value.to(device=p.device, dtype=torch.float32)
                else:
                    state.pop("master_param", None)
        self._unsettled = True
        self._launch_cache.clear()

    def _launches(self, group: dict[str, Any], params: list[torch.Tensor]) -> list["_Launch"]:
        """The fused launches of a group's parameters that have gradients: built on their first
        step (states created), reused while the same parameters step with the same state objects
        (checked at C speed each step: a state replaced from outside is noticed)."""
        key = (id(group), group["master_weights"], tuple(map(id, params)))
        cached = self._launch_cache.get(key)
        if cached is not None and all(launch.still_valid(self.state) for launch in cached):
            return cached
        buckets: dict[tuple, list[torch.Tensor]] = {}
        fresh_step: dict[tuple[Any, ...], torch.Tensor] = {}
        idle = self._idle_counts(params)
        own_count: dict[int, torch.Tensor] = {}
        for p in params:
            state = self._state_of(p, group["master_weights"], fresh_step)
            if id(state["step"]) in idle:  # shared with a parameter that does not step now: each keeps its own count
                state["step"] = own_count.setdefault(id(state["step"]), state["step"].clone())
            copy = self._copies.get(p)
            key_p = (p.device, p.dtype, "master_param" in state, None if copy is None else copy.dtype, state["exp_avg"].dtype,
                     id(state["step"]))
            buckets.setdefault(key_p, []).append(p)
        launches = [_Launch(members, [self.state[p] for p in members], has_master, [self._copies[p] for p in members] if copies else None)
                    for (_, _, has_master, copies, _, _), members in buckets.items()]
        if len(self._launch_cache) > 64:
            self._launch_cache.clear()
        self._launch_cache[key] = launches
        return launches

    def _idle_counts(self, stepping: list[torch.Tensor]) -> set[int]:
        """The ids of the step counts held by parameters with state that do not step now (no
        gradient). A count shared with one of them must not be incremented for the others (torch
        counts each parameter's steps: a parameter without a gradient keeps its count)."""
        moving = set(map(id, stepping))
        return {id(state["step"]) for group in self.param_groups for p in group["params"]
                if id(p) not in moving and "step" in (state := self.state.get(p, {}))}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, refusing a parameter listed twice (torch warns and steps it twice per step, a
        behaviour it announces will become an error; hal's fused launch would update it once per
        listing from one state)."""
        params = param_group["params"]
        if isinstance(params, set):  # torch refuses a set (its order is not kept)
            return super().add_param_group(param_group)
        listed = [params] if isinstance(params, torch.Tensor) else list(params)
        seen: set[int] = {id(p) for group in getattr(self, "param_groups", ()) for p in group["params"]}
        for p in listed:
            if id(p) in seen:
                raise hal.InvalidArgumentError("hal.optim.AdamW", "params", "each parameter once, in one group",
                                               f"a parameter of shape {tuple(p.shape)} listed twice")
            seen.add(id(p))
        super().add_param_group({**param_group, "params": listed})

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
        if self._unsettled:
            self._settle_state()
        skip_all = found_inf is not None and not isinstance(found_inf, torch.Tensor) and float(found_inf) != 0.0
        if skip_all:
            return loss
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            lr, (beta1, beta2) = float(group["lr"]), group["betas"]
            for launch in self._launches(group, params):
                grads = list(map(_GRAD, launch.params))
                if any(map(_IS_SPARSE, grads)):
                    raise RuntimeError("hal.optim.AdamW does not support sparse gradients; use dense gradients")
                skip = found_inf.to(launch.step.device) if isinstance(found_inf, torch.Tensor) else None
                launch.step.add_(1.0 if skip is None else (skip == 0).to(launch.step.dtype))
                launch.run(grads, lr, float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]), skip)
        return loss


def _saved_states_by_param(groups: list[dict[str, Any]], state_dict: dict[str, Any]) -> dict[torch.Tensor, dict[str, Any]]:
    """The saved state of each parameter of ``groups``, before torch's loader casts it: saved ids
    map to parameters in the order of the groups, as ``torch.optim.Optimizer.load_state_dict``
    maps them (it checks that the groups match)."""
    saved_ids = [i for group in state_dict.get("param_groups", ()) for i in group["params"]]
    params = [p for group in groups for p in group["params"]]
    states = state_dict.get("state", {})
    return {p: states[i] for i, p in zip(saved_ids, params) if i in states}


_GRAD = operator.attrgetter("grad")
_IS_SPARSE = operator.attrgetter("is_sparse")


class _Launch:
    """One fused_adamw_ launch: parameters sharing device, dtype, master weights, copies and step
    count, with the lists of their state tensors (and the state dicts they came from, to notice
    when a state is replaced) and the lists the op receives as params and master_params: the
    parameters and their masters (if any), or the copies with the parameters as their masters."""

    __slots__ = ("params", "states", "exp_avgs", "exp_avg_sqs", "masters", "step", "plan", "op_params", "op_masters")

    def __init__(self, params: list[torch.Tensor], states: list[dict[str, Any]], has_master: bool,
                 copies: Optional[list[torch.Tensor]]) -> None:
        self.params, self.states = params, states
        self.exp_avgs = [s["exp_avg"] for s in states]
        self.exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        self.masters = [s["master_param"] for s in states] if has_master else None
        self.op_params, self.op_masters = (params, self.masters) if copies is None else (copies, params)
        self.step = states[0]["step"]
        self.plan = dispatch.Held()

    def run(self, grads: list[torch.Tensor], lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
            found_inf: Optional[torch.Tensor]) -> None:
        """hal.ops.fused_adamw_ over this launch's tensors, through the call's plan held here.

        What a step changes besides numbers are the gradients: torch gives each the dtype and
        device of its parameter (it refuses others), so their shapes and strides (which also stand
        for the parameters': a parameter whose ``.data`` was replaced by another shape shows in its
        new gradient) and the kind of found_inf are what is checked; everything else is this
        launch's own tensors (see still_valid). The cache key of a call over ResNet-50's 161 tensors
        (four lists) cost about 0.4 ms per step on the CPU VM, these two passes 0.06 ms."""
        params, masters = self.op_params, self.op_masters
        if tracing.is_compiling():  # under torch.compile: the op's graph node, as any hal.ops call
            hal.ops.fused_adamw_(
                params, grads, self.exp_avgs, self.exp_avg_sqs, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                weight_decay=weight_decay, step=self.step, master_params=masters, found_inf=found_inf,
            )  # fmt: skip
            return
        signature = (dispatch.layout_of(grads), None if found_inf is None else (found_inf.dtype, found_inf.device, found_inf.shape))
        bound = self.plan.get(signature, lambda: dispatch.bind(
            "fused_adamw_", params, grads, self.exp_avgs, self.exp_avg_sqs, lr=lr, beta1=beta1, beta2=beta2,
            eps=eps, weight_decay=weight_decay, step=self.step, master_params=masters, found_inf=found_inf,
        ))  # fmt: skip
        bound(params, grads, self.exp_avgs, self.exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, self.step, masters, None, found_inf)

    def still_valid(self, state: Any) -> bool:
        """The optimizer's state of these parameters holds the same objects as when the launch was
        built (C-level passes over the lists: a few microseconds for hundreds of parameters)."""
        same = operator.is_
        try:
            return (
                all(map(same, map(state.__getitem__, self.params), self.states))
                and all(map(same, map(_EXP_AVG, self.states), self.exp_avgs))
                and all(map(same, map(_EXP_AVG_SQ, self.states), self.exp_avg_sqs))
                and all(map(same, map(_STEP, self.states), itertools.repeat(self.step)))
                and (self.masters is None or all(map(same, map(_MASTER, self.states), self.masters)))
            )
        except KeyError:  # a state emptied or rebuilt from outside
            return False


_EXP_AVG = operator.itemgetter("exp_avg")
_EXP_AVG_SQ = operator.itemgetter("exp_avg_sq")
_MASTER = operator.itemgetter("master_param")
_STEP = operator.itemgetter("step")
