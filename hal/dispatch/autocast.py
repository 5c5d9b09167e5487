"""A call under ``torch.autocast``: the arguments cast as torch's autocast casts them for the
function the op names, then the op run with autocast off.

Torch's autocast wraps its listed functions: the wrapper casts the floating tensor arguments (to the
autocast dtype for ``lower_precision_fp`` functions such as ``F.linear``, to float32 for ``fp32``
ones such as ``F.cross_entropy``) and runs the function with autocast excluded, so that what the
function does inside is not cast again; a function on no list runs as if autocast were off. hal
does the same per op, from the op's declaration (:class:`hal.registry.Autocast`): the entry of every
op (:mod:`hal.dispatch.entry`) checks one C flag on each call and, where autocast is on, puts the
autocast state of the call's device (:func:`state`: device type and autocast dtype, or None where
autocast is off there) into the call's cache key. The plan cached under such a key
(:func:`planner`) casts by the op's rule and runs the plan of the cast arguments with autocast off
for that device. Kernels, decompositions and the ops they call therefore see the arrays as the
named torch function would, whatever torch's ops a kernel is made of, and the result dtype is that
function's under the same autocast (API.md), eagerly as compiled
(:func:`hal.integration.library.traced_call` applies the same rule while Dynamo traces, with
:func:`device_type` and :func:`cast`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from hal.registry import OpDecl
from hal.types import ARRAY_KINDS

from .dispatcher import DISPATCHER
from .plan import Plan

#: whether autocast is on for any device type (one C call; older torch: asks CPU and CUDA)
any_enabled = getattr(torch._C, "_is_any_autocast_enabled", None) or (
    lambda: torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")
)


def device_type(decl: OpDecl, args: Sequence[Any]) -> Optional[str]:
    """The device type of the call's first torch tensor where autocast is on for it (None: NumPy
    arrays, or autocast off there)."""
    for p, a in zip(decl.params, args):
        if p.kind not in ARRAY_KINDS:
            continue
        first = a[0] if isinstance(a, (list, tuple)) and a else a
        if isinstance(first, torch.Tensor):
            kind = first.device.type
            return kind if torch.is_autocast_enabled(kind) else None
    return None


def target_dtype(decl: OpDecl, kind: str) -> Optional[torch.dtype]:
    """The dtype the op's rule casts to on device type ``kind`` under the active autocast (None:
    no rule there)."""
    rule = decl.autocast
    if rule is None or (rule.devices is not None and kind not in rule.devices):
        return None
    return torch.get_autocast_dtype(kind) if rule.policy == "lower" else torch.float32


def cast(decl: OpDecl, args: Sequence[Any], kind: str) -> tuple:
    """``args`` with the tensors the op's rule names cast as torch's autocast would cast them:
    floating point, not float64, on device type ``kind``."""
    dtype = target_dtype(decl, kind)
    out = list(args)
    if dtype is None:
        return tuple(out)
    assert decl.autocast is not None and decl.autocast.args is not None
    for name in decl.autocast.args:
        i = decl.index(name)
        a = out[i]
        if (isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype not in (dtype, torch.float64)
                and a.device.type == kind):
            out[i] = a.to(dtype)
    return tuple(out)


def state(t: torch.Tensor) -> Optional[tuple[str, torch.dtype]]:
    """The autocast state of a call whose first array argument is the tensor ``t``: (device type,
    autocast dtype there) where autocast is on for ``t``'s device type, else None (the call runs as
    without autocast). A part of the call's cache key (:mod:`hal.dispatch.entry`)."""
    kind = _device_types.get(t.device) or _device_type(t.device)
    return (kind, _autocast_dtype(kind)) if _enabled(kind) else None


def state_of(decl: OpDecl) -> Callable[[tuple], Optional[tuple[str, torch.dtype]]]:
    """:func:`state` for any canonical arguments of ``decl``: from its first array parameter that
    holds a torch tensor (or a list starting with one); None where none does (NumPy arrays)."""
    slots = tuple(i for i, p in enumerate(decl.params) if p.kind in ARRAY_KINDS)
    tensor, sequences = torch.Tensor, (list, tuple)

    def of(args: tuple) -> Optional[tuple[str, torch.dtype]]:
        for i in slots:
            a = args[i]
            first = a[0] if isinstance(a, sequences) and a else a
            if isinstance(first, tensor):
                return state(first)
        return None

    return of


def planner(decl: OpDecl, key_of: Callable[..., Any]) -> Callable[[tuple, Any, tuple[str, torch.dtype]], Plan]:
    """The generated entry's decision for a call under autocast (:func:`state` not None), on a miss of
    its cache key: the plan that casts the arguments the op's rule names (:func:`cast`'s casts,
    found once here from the arguments, whose key fixes them: types, dtypes, devices), then runs,
    with autocast off for the call's device (on again afterwards, also when it raises), the plan
    that a call of the cast arguments with autocast off has, which is decided and cached as such a
    call would be (its key is ``key_of(*cast_args)``: the entry's key of those arguments). The plan
    is cached under the call's own key (which holds the autocast state) when the plan it runs is
    cached under its own; not otherwise (a decision that is not final, a key that cannot be
    computed, a traced call), so that such calls come here again.

    Why: before this, every call under autocast cast (checking each named argument: type, dtype,
    device type) and then called the entry again with autocast off, computing a second key and
    looking it up: on the project's 2-core VM 1.0 us of a rotary_embedding call (no rule: no casts)
    and 3.2 us of an SDPA call (2026-12-07). Now a hit is the entry's one key (with the autocast
    state, 0.4 us), one lookup, and the casts themselves."""
    rule = decl.autocast
    named = tuple(decl.index(n) for n in rule.args) if rule is not None and rule.args is not None else ()
    tensor, f64 = torch.Tensor, torch.float64

    def plan(args: tuple, key: Any, on: tuple[str, torch.dtype]) -> Plan:
        kind = on[0]
        dtype = target_dtype(decl, kind) if named else None
        casts = ()
        if dtype is not None:
            casts = tuple(i for i in named if isinstance(a := args[i], tensor) and a.is_floating_point()
                          and a.dtype not in (dtype, f64) and a.device.type == kind)
        if casts:
            cast_args = list(args)
            for i in casts:
                cast_args[i] = cast_args[i].to(dtype)
            args = tuple(cast_args)
        set_enabled(kind, False)
        try:
            inner_key = None
            if key is not None:
                try:
                    inner_key = key_of(*args)
                except Exception:  # as the entry: a key that cannot be computed is decided uncached
                    inner_key = None
            inner = DISPATCHER.cached_plan(inner_key) if inner_key is not None else None
            if inner is None:
                inner = DISPATCHER.plan(decl, args, inner_key)
            final = inner_key is not None and DISPATCHER.cached_plan(inner_key) is inner
        finally:
            set_enabled(kind, True)
        planned = (inner[0], _autocast_off(inner[1], kind, casts, dtype))
        if final:
            DISPATCHER.remember(key, planned)
        return planned

    return plan


def _autocast_off(run: Callable[..., Any], kind: str, casts: tuple[int, ...], dtype: Optional[torch.dtype]) -> Callable[..., Any]:
    """``run`` after the casts (argument positions, to ``dtype``), with autocast off for ``kind`` (on
    again afterwards, also when ``run`` raises)."""

    def run_off(*args: Any) -> Any:
        set_enabled(kind, False)
        try:
            return run(*args)
        finally:
            set_enabled(kind, True)

    if not casts:
        return run_off

    def run_cast(*args: Any) -> Any:
        a = list(args)
        for i in casts:
            a[i] = a[i].to(dtype)
        return run_off(*a)

    return run_cast


#: device types by device (``torch.device.type`` builds its string on every read: 0.2 us)
_device_types: dict[torch.device, str] = {}


def _device_type(device: torch.device) -> str:
    kind = _device_types[device] = device.type
    return kind


_enabled, _autocast_dtype, set_enabled = torch.is_autocast_enabled, torch.get_autocast_dtype, torch.set_autocast_enabled
