"""A call under ``torch.autocast``: the arguments cast as torch's autocast casts them for the
function the op names, then the op run with autocast off.

Torch's autocast wraps its listed functions: the wrapper casts the floating tensor arguments (to the
autocast dtype for ``lower_precision_fp`` functions such as ``F.linear``, to float32 for ``fp32``
ones such as ``F.cross_entropy``) and runs the function with autocast excluded, so that what the
function does inside is not cast again; a function on no list runs as if autocast were off. hal
does the same per op, from the op's declaration (:class:`hal.registry.Autocast`): the entry of every
op (:mod:`hal.dispatch.entry`) checks one C flag on each call and, where autocast is on for the
device of the call's tensors, comes here, which casts by the op's rule and calls the entry again
with autocast off for that device. Kernels, decompositions and the ops they call therefore see the
arrays as the named torch function would, whatever torch's ops a kernel is made of, and the result
dtype is that function's under the same autocast (API.md), eagerly as compiled
(:func:`hal.integration.library.traced_call` applies the same rule while Dynamo traces).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

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


def run(decl: OpDecl, args: Sequence[Any], kind: str) -> Any:
    """The call under autocast on device type ``kind``: its arguments cast by the op's rule, then
    the op with autocast off for ``kind`` (restored afterwards)."""
    casted = cast(decl, args, kind)
    torch.set_autocast_enabled(kind, False)
    try:
        return call_entry(decl, casted)
    finally:
        torch.set_autocast_enabled(kind, True)


def call_entry(decl: OpDecl, args: Sequence[Any]) -> Any:
    """``hal.ops.<name>`` on the canonical argument tuple (keyword-only parameters by name)."""
    assert decl.entry is not None
    keywords = [p.name for p in decl.params if p.keyword_only]
    if not keywords:
        return decl.entry(*args)
    n = len(decl.params) - len(keywords)
    return decl.entry(*args[:n], **dict(zip(keywords, args[n:])))
