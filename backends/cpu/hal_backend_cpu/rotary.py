"""rotary_embedding and its backward as one numba pass (``hal_backend_cpu._nb.rotary``) for small
arrays: the ``torch`` kernel (hal_torch.transformer) is eleven torch ops a call (the upcasts, the
halves, four products, two sums, the concatenation, the rounding), and at the sizes of a small
model's heads their per-op host time is the whole cost (issue 40, eager host time on the CPU).

bfloat16 goes in and out as its bit patterns (an int16 view: no conversion pass either side), each
row widened to float32 exactly and the result rounded to nearest even; float32 and float64 go
straight in; float16 is converted by torch (numba has no float16 arithmetic). Any strides. The pass
computes in float32 (float64 for float64) with the torch kernel's products and sums, unfused, so its
results are the torch kernel's bit for bit (NaN aside: torch's canonical NaN). Beyond
:data:`NUMBA_ROTARY_ELEMENTS` the torch kernel's vectorised ops are as fast: this kernel declines.
"""

from __future__ import annotations

import numpy as np
import torch

from hal.plugin import Inputs

from . import _numba
from ._common import FLOATS, numba_kernel, numel

#: elements of x up to which the numba pass serves. Host time a forward call on the project's
#: 2-core EPYC VM (2026-12-07, one thread, x a (B, H, T, D) transposed view of a projection as
#: hal.nn.patch's attention passes it, cos and sin float32 (B, 1, T, D/2)), numba against the torch
#: kernel: bfloat16 (2, 4, 16, 16) 8.6 / 22.1 us, (2, 1, 16, 16) 6.0 / 16.5, (2, 8, 64, 64) 64.8 /
#: 64.2, (2, 8, 256, 64) 242 / 234; float32 5.5 / 19.8, 4.7 / 14.7, 40 / 73, 119 / 196.
NUMBA_ROTARY_ELEMENTS = 1 << 16


def _small(inputs: Inputs) -> list[str]:
    """A check: up to 4 dimensions and :data:`NUMBA_ROTARY_ELEMENTS` elements, not in a torch.compile
    graph (there the torch kernel's ops join the graph, which Inductor fuses)."""
    if inputs.traced:
        return ["inside a torch.compile graph the torch kernel's ops join the graph (Inductor fuses them)"]
    x = inputs.args[0]  # x, or the backward's grad_out
    reasons = []
    if x.ndim > 4:
        reasons.append(f"{x.ndim} dimensions: the numba pass takes up to 4 (B, H, T, D)")
    if numel(x.shape) > NUMBA_ROTARY_ELEMENTS:
        reasons.append(f"{numel(x.shape)} elements: beyond {NUMBA_ROTARY_ELEMENTS} the torch kernel's vectorised ops are as fast")
    return reasons


def _view4(t: torch.Tensor) -> np.ndarray:
    """``t`` as a 4-d NumPy view (leading dimensions of one added)."""
    while t.ndim < 4:
        t = t.unsqueeze(0)
    return (t.detach() if t.requires_grad else t).numpy()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, negate: bool) -> torch.Tensor:
    nb = _numba.family("rotary")
    dtype = x.dtype
    if dtype == torch.bfloat16:  # its bit patterns in and out: no conversion pass either side
        c = cos if cos.dtype == torch.float32 else cos.float()
        s = sin if sin.dtype == torch.float32 else sin.float()
        out = np.empty(x.shape, np.int16)
        nb.rotate_bf16(_view4(x.view(torch.int16)), _view4(c), _view4(s), negate, interleaved, _4d(out))
        return torch.from_numpy(out).view(torch.bfloat16)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    xa = x if dtype == acc else x.to(acc)  # float16: numba has no float16 arithmetic
    c = cos if cos.dtype == acc else cos.to(acc)
    s = sin if sin.dtype == acc else sin.to(acc)
    out = np.empty(x.shape, np.float64 if acc == torch.float64 else np.float32)
    nb.rotate(_view4(xa), _view4(c), _view4(s), negate, interleaved, _4d(out))
    result = torch.from_numpy(out)
    return result if dtype == acc else result.to(dtype)


def _4d(a: np.ndarray) -> np.ndarray:
    return a.reshape((1,) * (4 - a.ndim) + a.shape) if a.ndim < 4 else a


@numba_kernel("rotary_embedding", priority=30, dtypes=FLOATS, array_api="torch", checks=[_small])
def rotary_embedding_numba(x, cos, sin, interleaved):
    return _rotate(x, cos, sin, interleaved, False)


@numba_kernel("rotary_embedding_backward", priority=30, dtypes=FLOATS, array_api="torch", checks=[_small])
def rotary_embedding_backward_numba(grad_out, cos, sin, interleaved):
    """The rotation by the opposite angle (the adjoint), as the torch kernel's ``-sin``."""
    return _rotate(grad_out, cos, sin, interleaved, True)
