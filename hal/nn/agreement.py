"""Whether a replacement computes what the module it replaces computes: the checks
:func:`hal.nn.patch` runs before every swap (:mod:`hal.nn.patch`, :mod:`hal.nn.patch_hf`).

A randomised copy of the module (its floating parameters drawn at random: initial ones or zeros
would hide what the module does with them) and the replacement built on the copy run the same
random probe; the replacement is used only if both give the same dtype, shape and values to the
dtype's rounding. A probe that raises (meta tensors, an unexpected layout) counts as disagreement,
so a module the check cannot run is left alone.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable

import torch
from torch import nn

log = logging.getLogger("hal.nn.patch")

#: (rtol, atol) within which a replacement must agree with the module it replaces
AGREEMENT = {torch.float32: (1e-4, 1e-5), torch.float64: (1e-10, 1e-12), torch.float16: (1e-2, 1e-3), torch.bfloat16: (3e-2, 1e-2)}


def close(want: Any, got: Any) -> bool:
    """Two results of the same dtype and shape, equal to that dtype's rounding. The absolute
    tolerance scales with the result's largest magnitude (above 1): a sum of many products rounds
    to a fraction of its terms' size, not of its own, so an element that nearly cancels carries the
    error of the large ones (an attention of width 4096 in float32: 1.9e-5 beside outputs of 42,
    where the unscaled 1e-5 refused a correct replacement)."""
    if not isinstance(want, torch.Tensor) or not isinstance(got, torch.Tensor) or want.dtype != got.dtype or want.shape != got.shape:
        return False
    rtol, atol = AGREEMENT.get(want.dtype, (1e-4, 1e-5))
    want, got = want.double(), got.double()
    scale = max(1.0, float(want.abs().amax())) if want.numel() and bool(want.isfinite().all()) else 1.0
    return bool(torch.allclose(got, want, rtol=rtol, atol=atol * scale))


def same(kind: str, run: Callable[[], tuple[Any, Any]], ref: torch.Tensor) -> bool:
    """``run()`` gives (original's result, replacement's result): they agree to the dtype's rounding
    (run without grad and outside autocast on ``ref``'s device). A probe that raises counts as
    disagreement."""
    try:
        with torch.no_grad(), torch.autocast(ref.device.type, enabled=False):
            want, got = run()
        return close(want, got)
    except Exception as exc:  # noqa: BLE001 - a module the probe cannot run is left alone
        log.debug("hal.nn.patch: probe of %s failed: %s", kind, exc)
        return False


def random_copy(m: nn.Module, seed: int, scale: float, offset: float = 0.0) -> nn.Module:
    """A deep copy of ``m`` without hooks, with floating parameters drawn as ``randn * scale + offset``."""
    gen = torch.Generator().manual_seed(seed)
    trial = copy.deepcopy(m)
    for sub in trial.modules():  # the copy runs probes: the user's hooks, copied along, must not see them
        for hooks in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                      "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called"):
            table = getattr(sub, hooks, None)
            if table:
                table.clear()
    with torch.no_grad():
        for p in trial.parameters():
            if p.is_floating_point():
                p.copy_((torch.randn(p.shape, generator=gen) * scale + offset).to(p.dtype))
    return trial


def probe(shape: tuple[int, ...], like: torch.Tensor, seed: int) -> torch.Tensor:
    """A random input of ``shape`` on ``like``'s device, in its dtype."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device=like.device, dtype=like.dtype)


def has_hooks(m: nn.Module) -> bool:
    """Whether ``m`` has hooks (a swap or a fusion would stop them from running)."""
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or getattr(m, "_backward_pre_hooks", None))


def own_state(m: nn.Module) -> tuple[set[str], set[str], bool]:
    """(own parameter names, child names, whether it has own buffers)."""
    return {n for n, _ in m.named_parameters(recurse=False)}, set(m._modules), bool(list(m.buffers(recurse=False)))


def state_is(m: nn.Module, params: set[str], children: set[str]) -> bool:
    """``m`` has exactly these own parameters and children, and no buffers of its own."""
    own, kids, buffers = own_state(m)
    return own == params and kids == children and not buffers
