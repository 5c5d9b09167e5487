"""scale_shift_act and its backward: the forward in one numba pass for act none / relu over rows
with a feature-wise scale and shift (float32 and float64), or torch's vectorised CPU kernels (every
dtype and activation; half precision computed in float32 and rounded once; the backward as torch's
activation-backward kernels).

The transcendental activations stay with torch: numba calls libm's scalar exp / erf (there is no
SVML in the numba wheels), and a vectorisable float32 exp/erfc written for these kernels measured
about ten times slower than torch's Sleef GELU here (2026-12-01), so a fused pass lost to torch's
three vectorised ones."""

from __future__ import annotations

import math
from typing import Callable, Union

import numpy as np
import torch
import torch.nn.functional as F

from hal.plugin import Inputs
from hal_torch.elementwise import (ACTIVATION_FNS, EXACT_ACTS, exact_activation, exact_activation_grad, identity_affine, residual_activation,
                                           residual_activation_reasons)

from . import _numba
from ._common import FLOATS, contiguous, kernel, numba_kernel, numpy_kernel
from ._layout import channel_split, channel_vector

Scalar = Union[float, torch.Tensor]

_A = torch.ops.aten

#: d act(z) / dz applied to grad: torch's backward kernels, from the pre-activation z (or the output).
_ACT_BACKWARD: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "none": lambda g, z: g,
    "relu": lambda g, z: _A.threshold_backward(g, z, 0),
    "gelu": lambda g, z: _A.gelu_backward(g, z),
    "gelu_tanh": lambda g, z: _A.gelu_backward(g, z, approximate="tanh"),
    "silu": lambda g, z: _A.silu_backward(g, z),
    "sigmoid": lambda g, z: _A.sigmoid_backward(g, torch.sigmoid(z)),
    "tanh": lambda g, z: _A.tanh_backward(g, torch.tanh(z)),
}


def act_backward(act: str, grad: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """grad * act'(z) by torch's activation backward kernels (shared with linear's backward)."""
    return _ACT_BACKWARD[act](grad, z)


#: act applied in place to a tensor the kernel owns (no second buffer: on this CPU a fresh
#: 16 MiB result costs about as much as the pass that fills it).
_ACT_INPLACE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "none": lambda z: z,
    "relu": torch.relu_,
    "gelu": lambda z: _A.gelu_(z),
    "gelu_tanh": lambda z: _A.gelu_(z, approximate="tanh"),
    "silu": lambda z: F.silu(z, inplace=True),
    "sigmoid": torch.sigmoid_,
    "tanh": torch.tanh_,
}


def activate_(z: torch.Tensor, act: str) -> torch.Tensor:
    """act(z) for a tensor the kernel made (shared with linear's kernels), with gelu(+inf) = +inf
    (torch 2.13's vectorised float32 and bfloat16 GELU gives NaN there).

    Outside autograd z is overwritten. Where autograd records the kernel the activation is torch's
    out-of-place one (an in-place GELU would make autograd save a copy of z). GELU's +inf elements
    are marked only where z's maximum is not finite (one read pass, no buffer), or always where
    torch.compile traces the kernel (fake tensors hold no maximum). The maximum is ``max().item()``,
    detached only where z requires grad: 1.0 us against 1.7 for ``float(z.detach().amax())`` at
    (8, 64), the host time the issue 41 item 13 row spent beyond torch's own linear + GELU.
    """
    traced = type(z) is not torch.Tensor
    at_inf = None
    if act == "gelu" and z.numel() and (traced or not math.isfinite((z.detach() if z.requires_grad else z).max().item())):
        at_inf = z == math.inf
    y = ACTIVATION_FNS[act](z) if traced or z.requires_grad else _ACT_INPLACE[act](z)
    return y if at_inf is None else y.masked_fill_(at_inf, math.inf)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _param(v: Scalar, dtype: torch.dtype) -> Scalar:
    return v.to(dtype) if isinstance(v, torch.Tensor) else v


def _constant_along_memory_rows(x: torch.Tensor, *params: Scalar) -> bool:
    """Whether a parameter tensor holds one value along x's innermost memory dimension (per-channel
    planes of NCHW data) where x does not."""
    varying = [d for d in range(x.ndim) if x.shape[d] > 1]
    if not varying:
        return False
    inner = min(varying, key=x.stride)
    for v in params:
        if isinstance(v, torch.Tensor):
            at = inner - (x.ndim - v.ndim)  # v's dimension aligned with x's innermost (broadcasting from the right)
            if at < 0 or v.shape[at] == 1:
                return True
    return False


def affine(x: torch.Tensor, scale: Scalar, shift: Scalar, dtype: torch.dtype) -> torch.Tensor:
    """A new tensor ``x * scale + shift`` in ``dtype``, laid out as x: one pass (addcmul, add with
    alpha) where torch vectorises it, a multiply and an in-place add where a parameter is one value
    along x's memory rows (torch's addcmul runs those about 3x slower than the two passes: (8, 64,
    56, 56) float32 with (64, 1, 1) parameters 0.47 against 0.17 ms, channels_last or a feature-wise
    bias 0.11-0.83 against 0.17-1.33 ms, 2-core EPYC VM, 2026-12-02)."""
    s, b = _param(scale, dtype), _param(shift, dtype)
    if isinstance(b, torch.Tensor):
        if isinstance(s, torch.Tensor):
            if _constant_along_memory_rows(x, s, b):
                return torch.mul(x, s).add_(b) if torch.result_type(x, s) == dtype else x.to(dtype).mul_(s).add_(b)
            return torch.addcmul(b, x, s)
        if abs(s) <= torch.finfo(dtype).max:  # torch refuses an alpha beyond the dtype's range (a product rounds to inf)
            return torch.add(b, x, alpha=s)
    z = x.to(dtype) * s
    return z.add_(b) if isinstance(b, torch.Tensor) or b != 0 else z


NUMBA_ACTS = ("none", "relu")


def _numba_act(inputs: Inputs) -> list[str]:
    act = inputs["act"]
    return [] if act in NUMBA_ACTS else [f"act {act!r}: torch's vectorised kernels run it faster (the numba kernel fuses none and relu)"]


def _not_identity(inputs: Inputs) -> list[str]:
    scale, shift = inputs["scale"], inputs["shift"]  # NumPy views here: only numbers can be an identity
    if isinstance(scale, (int, float)) and isinstance(shift, (int, float)) and scale == 1 and shift == 0:
        return ["an identity affine: torch's activation kernel is one pass with nothing to fuse, and "
                "faster (bare ReLU at (8, 64, 56, 56) float32: 0.25 against 0.82 ms, 2026-12-01)"]
    return []


def _no_full_size_param(inputs: Inputs) -> list[str]:
    """A parameter with x's own size (a residual added before the ReLU: fused_conv_bn_add_relu's
    training decomposition) is left to torch: the numba kernel would expand the other parameter to
    x's size as well and run one segment per element."""
    x = inputs["x"]
    if x.size > 1 and any(isinstance(v, np.ndarray) and v.size == x.size for v in (inputs["scale"], inputs["shift"])):
        return ["a parameter of x's own size: torch's add and activation are faster (relu(x + r) at (16, 256, 16, 16) float32: "
                "0.15 against 4-8 ms, 2026-12-02) and torch's autograd records them"]
    return []


#: channel segments from this length on (NCHW planes) are left to torch's kernels (see _numba_layout)
SHORT_SEGMENT = 64


def _numba_layout(inputs: Inputs) -> list[str]:
    """The numba pass takes one channel run of parameters, and runs only the layout where it
    measured faster than torch (2-core EPYC VM, float32, 2026-12-02): a feature-wise bias over rows
    ((4096, 1024): 0.37 against 0.88 ms; (1024, 1024): a tie; (128, 1024): 0.036 against 0.016 ms,
    the threads' start). torch's kernels were faster for per-channel planes ((8, 64, 56, 56): 0.59
    against 0.41 ms) and for numbers (0.58 against 0.17 ms; (4096, 1024): 3.2 against 0.7 ms)."""
    split = channel_split(inputs["x"], inputs["scale"], inputs["shift"])
    if isinstance(split, str):
        return [split]
    _, c, i = split
    if c == 1 or i >= SHORT_SEGMENT:
        return ["numbers or per-channel planes: torch's kernels are faster (the numba pass fuses feature-wise rows)"]
    return []


@numba_kernel("scale_shift_act", priority=30,
              checks=[_numba_act, _not_identity, _no_full_size_param, contiguous("x"), _numba_layout])
def scale_shift_act_numba(x, scale, shift, act):
    p, c, i = channel_split(x, scale, shift)  # i < SHORT_SEGMENT: each channel's value repeated over its i elements
    s, b = channel_vector(scale, c, x.dtype), channel_vector(shift, c, x.dtype)
    out = np.empty_like(x)
    _numba.family("elementwise").affine_rows(x.reshape(p, c * i), np.repeat(s, i), np.repeat(b, i), out.reshape(p, c * i),
                                             act == "relu")
    return out


#: elements up to which NumPy's own ufunc on a NumPy caller's array beats torch's kernel and the
#: two conversions around it (hal's measured choice, float32 relu on the 2-core EPYC VM, 2026-12-07:
#: 1.2 against 2.8 us at 1024 elements, 2.1 against 2.8 at 4096; bare np.maximum against torch's
#: relu with the conversions 5.5 against 2.7 us at 16384: NumPy's maximum is slower per element)
NUMPY_ELEMENTS = 4096


def _exact_small(inputs: Inputs) -> list[str]:
    act, x = inputs["act"], inputs["x"]
    if act not in EXACT_ACTS or not _identity_numbers(inputs["scale"], inputs["shift"]):
        return ["not a bare relu or copy (scale 1 and shift 0 as numbers, act none or relu): torch's kernels compute the affine"]
    if x.size > NUMPY_ELEMENTS:
        return [f"{x.size} elements: beyond {NUMPY_ELEMENTS}, torch's vectorised kernel is faster than NumPy's even with the conversions"]
    return []


def _identity_numbers(scale: object, shift: object) -> bool:
    return isinstance(scale, (int, float)) and isinstance(shift, (int, float)) and scale == 1 and shift == 0


@numpy_kernel("scale_shift_act", priority=27, dtypes=FLOATS, checks=[_exact_small])
def scale_shift_act_numpy(x, scale, shift, act):
    """relu(x) or a copy of x, for a NumPy caller's small array: one NumPy call, no torch tensor made
    (the cost of NumPy input was the two conversions, 1.5-2x a torch caller's call). NaN propagates
    (np.maximum); a zero keeps the sign NumPy's maximum gives it, as in cpu_ref (-0.0 becomes +0.0 in
    float32 and float64, where torch's CPU relu keeps -0.0)."""
    return np.maximum(x, 0) if act == "relu" else x.copy(order="K")


@kernel("scale_shift_act", name="torch", priority=20, dtypes=FLOATS, differentiable=True)
def scale_shift_act_torch(x, scale, shift, act):
    if act in EXACT_ACTS and identity_affine(scale, shift):
        return exact_activation(x, act)
    return activate_(affine(x, scale, shift, _compute_dtype(x)), act).to(x.dtype)


# relu(x + residual) in x's own dtype (fused_conv_bn_add_relu's training decomposition ends with it):
# the torch kernel above computes half precision in float32 (three conversions each way, and the
# backward recomputes the sum); at a ResNet tail's (16, 64, 16, 16) under bf16 autocast that made the
# block's forward + backward 1.7-2.3 ms against torch's 0.64-0.96 (2026-12-02).
kernel("scale_shift_act", name="torch_residual", priority=25, dtypes=FLOATS, checks=[residual_activation_reasons],
       differentiable=True)(residual_activation)


@kernel("scale_shift_act_backward", name="torch", priority=20, dtypes=FLOATS)
def scale_shift_act_backward_torch(grad_out, x, scale, shift, act, output_mask):
    want_x, want_scale, want_shift = output_mask
    if act in EXACT_ACTS and identity_affine(scale, shift) and not (want_scale or want_shift):
        return exact_activation_grad(grad_out, x, act) if want_x else None, None, None
    acc = _compute_dtype(x)
    xa = x.to(acc)
    s = _param(scale, acc)
    gz = act_backward(act, grad_out.to(acc), affine(xa, s, shift, acc))
    gx = (gz * s).to(x.dtype) if want_x else None
    g_scale = _reduce_to(gz * xa, scale).to(x.dtype) if want_scale else None
    g_shift = _reduce_to(gz, shift).to(x.dtype) if want_shift else None
    return gx, g_scale, g_shift


def _reduce_to(t: torch.Tensor, like: Scalar) -> torch.Tensor:
    """``t`` summed to the shape of a broadcast parameter (0-d for a number)."""
    if isinstance(like, torch.Tensor):
        return t.sum_to_size(like.shape) if like.ndim else t.sum()
    return t.sum()
