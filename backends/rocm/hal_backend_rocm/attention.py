"""scaled_dot_product_attention through torch's SDPA backends on ROCm, one kernel per backend.

A ROCm build of torch has three: FlashAttention and memory-efficient attention, both from AOTriton
(AMD's ahead-of-time compiled Triton kernels, built for gfx90a and gfx942; other architectures are
experimental there), and the math backend. Each kernel forces its backend
(``torch.nn.attention.sdpa_kernel``) so that its capability data is what runs. The fused ones take
no mask (a fully masked query row must give zeros, as torch's math backend and cpu_ref give), equal
head sizes of at most 256 (AOTriton 0.8 and later) and causal attention only for L == S (torch's
causal mask is aligned top-left, FlashAttention's bottom-right); memory-efficient attention also
runs float32 with head sizes a multiple of 4 (8 for half precision). ``math`` runs everything else
(float64, masks, L != S causal), in float32 for half-precision inputs. Inputs of any batch rank are
flattened to (B, 1, L, E), the layout the fused backends take. The backward recomputes the forward
under autograd with the same backend (the op receives no saved state).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from hal.plugin import Archs, Inputs

from ._common import FLOATS, HALF, NOT_F64, eager_kernel
from ._device import ANY_GFX, TRITON_ARCHS

#: the largest head size every AOTriton release torch ships takes
MAX_HEAD = 256


def _aotriton_shapes(float32_multiple: int) -> Callable[[Inputs], list[str]]:
    """The check of the AOTriton backends (head sizes a multiple of 8 in half precision, of
    ``float32_multiple`` in float32)."""

    def check(inputs: Inputs) -> list[str]:
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        e, ev = int(q.shape[-1]), int(v.shape[-1])
        multiple = 8 if q.dtype in (torch.float16, torch.bfloat16) else float32_multiple
        reasons = []
        if inputs["attn_mask"] is not None:
            reasons.append("attn_mask given (the math kernel gives fully masked query rows zeros)")
        if e != ev or e > MAX_HEAD or e % multiple:
            reasons.append(f"head sizes E={e}, Ev={ev}: needs E == Ev <= {MAX_HEAD}, a multiple of {multiple}")
        if inputs["is_causal"] and q.shape[-2] != k.shape[-2]:
            reasons.append("causal with L != S (torch's top-left alignment is kept by the math kernel)")
        return reasons

    return check


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, 1, t.shape[-2], t.shape[-1])


def _forced(backend: SDPBackend, fn: Callable[..., Any], flatten: bool, offset: int) -> Callable[..., Any]:
    """``fn`` (hal_torch's SDPA, ``offset`` 0, or its backward, 1: it takes grad_out first) run
    with only ``backend`` allowed; q, k, v flattened to (B, 1, L, E) and results shaped back when
    ``flatten``."""

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        tensors = args[: offset + 3]
        if flatten:
            args = (*map(_flat, tensors), *args[offset + 3 :])
        with sdpa_kernel([backend]):
            out = fn(*args)
        if not flatten:
            return out
        if offset == 0:
            return out.reshape(*tensors[0].shape[:-1], tensors[2].shape[-1])
        return tuple(g.reshape(t.shape) for g, t in zip(out, tensors[1:]))

    return run


def _register(name: str, backend: SDPBackend, priority: int, dtypes: tuple[str, ...], checks: list, flatten: bool, archs: Archs = ANY_GFX) -> None:
    for offset, op in enumerate(("scaled_dot_product_attention", "scaled_dot_product_attention_backward")):
        eager_kernel(op, name=name, priority=priority, dtypes=dtypes, checks=checks,
                     wrap=functools.partial(_forced, backend, flatten=flatten, offset=offset), archs=archs)


_register("flash", SDPBackend.FLASH_ATTENTION, 30, HALF, [_aotriton_shapes(8)], True, TRITON_ARCHS)
_register("efficient", SDPBackend.EFFICIENT_ATTENTION, 20, NOT_F64, [_aotriton_shapes(4)], True, TRITON_ARCHS)
_register("math", SDPBackend.MATH, 10, FLOATS, [], False)
