"""A call under ``torch.autocast``: the arguments cast as torch's autocast casts them for the
function the op names, then the op run with autocast off.

Torch's autocast wraps its listed functions: the wrapper casts the floating tensor arguments (to the
autocast dtype for ``lower_precision_fp`` functions such as ``F.linear``, to float32 for ``fp32``
ones such as ``F.cross_entropy``) and runs the function with autocast excluded, so that what the
function does inside is not cast again; a function on no list runs as if autocast were off. hal
does the same per op, from the op's declaration (:class:`hal.registry.Autocast`): the entry of every
op (:mod:`hal.dispatch.entry`) checks one C flag on each call and, where autocast is on for the
device of the call's tensors, comes here (:func:`caller`: the op's function for it, made with the
entry), which casts by the op's rule and calls the entry again with autocast off for that device.
Kernels, decompositions and the ops they call therefore see the arrays as the named torch function
would, whatever torch's ops a kernel is made of, and the result
dtype is that function's under the same autocast (API.md), eagerly as compiled
(:func:`hal.integration.library.traced_call` applies the same rule while Dynamo traces).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from hal.registry import OpDecl
from hal.types import ARRAY_KINDS

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


#: what :func:`caller`'s function returns for a call that autocast leaves alone
PASS = object()


def caller(decl: OpDecl) -> Callable[[tuple], Any]:
    """The generated entry's path under autocast for ``decl`` (:mod:`hal.dispatch.entry`): a function
    of the canonical argument tuple that does :func:`device_type` and :func:`cast`, then calls the
    entry again with autocast off for the call's device (on again afterwards), in one frame, with
    what they look up in the declaration (its array parameters, the parameters its rule casts, its
    keyword-only ones) found once, here, instead of on every call (``decl.index`` builds the tuple
    of parameter names on each use: about 4 us of an SDPA call under autocast went to that on the
    project's 2-core VM, 2026-12-07). It returns :data:`PASS` where autocast is off for the call's
    device (the entry goes on as without autocast). The traced path
    (:func:`hal.integration.library.traced_call`) keeps :func:`device_type` and :func:`cast`."""
    slots = tuple(i for i, p in enumerate(decl.params) if p.kind in ARRAY_KINDS)
    rule = decl.autocast
    casts = tuple(decl.index(n) for n in rule.args) if rule is not None and rule.args is not None else ()
    keywords = tuple(p.name for p in decl.params if p.keyword_only)
    n = len(decl.params) - len(keywords)
    tensor, sequences, f64 = torch.Tensor, (list, tuple), torch.float64
    enabled, set_enabled = torch.is_autocast_enabled, torch.set_autocast_enabled

    def call(args: tuple) -> Any:
        for i in slots:
            a = args[i]
            first = a[0] if isinstance(a, sequences) and a else a
            if isinstance(first, tensor):
                kind = first.device.type
                break
        else:
            return PASS
        if not enabled(kind):
            return PASS
        dtype = target_dtype(decl, kind) if casts else None
        if dtype is not None:
            out = list(args)
            for i in casts:
                a = out[i]
                if isinstance(a, tensor) and a.is_floating_point() and a.dtype not in (dtype, f64) and a.device.type == kind:
                    out[i] = a.to(dtype)
            args = tuple(out)
        entry = decl.entry
        set_enabled(kind, False)
        try:
            if keywords:
                return entry(*args[:n], **dict(zip(keywords, args[n:])))
            return entry(*args)
        finally:
            set_enabled(kind, True)

    return call
