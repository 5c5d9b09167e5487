"""conv2d (cuDNN), batch_norm (Triton, or cuDNN through torch) and conv -> BN -> ReLU.

float32 convolutions run with TensorFloat-32 off (``ieee_fp32``): hal's float32 is IEEE float32.

fused_conv_bn_relu has two paths:

- eval, ``cudnn_fused``: the batch norm folds into the convolution (w * gamma / sqrt(var + eps),
  bias (b - mean) * gamma / sqrt(var + eps) + beta) and ``torch.cudnn_convolution_relu`` runs
  conv + bias + ReLU as one cuDNN call. Folded weights are cached per parameter set and rebuilt
  when any parameter changes (tensor identity and version counter).
- training (and eval where the fused call cannot run), ``cudnn_triton``: cuDNN convolution without
  its bias (the bias cancels in the normalisation and goes into the running mean), then the Triton
  batch-norm kernels: statistics in one read, normalise + ReLU in one read and one write.

The backward recomputes the convolution output, runs the Triton batch-norm backward with the ReLU
mask, and cuDNN's convolution backward (in training the convolution bias gets an exact zero
gradient: a sum of rounded values that cancel would only add noise).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Optional

import torch
import torch.nn.functional as F

from hal.plugin import Inputs

from . import launch
from ._common import FLOATS, NOT_F64, contiguous_vectors, family, ieee_fp32, kernel

Pair = tuple[int, int]
Pads = tuple[int, int, int, int]


def _symmetric(padding: Pads) -> bool:
    top, bottom, left, right = padding
    return top == bottom and left == right


def conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], stride: Pair, padding: Pads, dilation: Pair, groups: int) -> torch.Tensor:
    """F.conv2d (cuDNN) with canonical padding; an asymmetric one is applied with F.pad first."""
    top, bottom, left, right = padding
    with ieee_fp32(x.dtype):
        if _symmetric(padding):
            return F.conv2d(x, weight, bias, stride, (top, left), dilation, groups)
        return F.conv2d(F.pad(x, (left, right, top, bottom)), weight, bias, stride, 0, dilation, groups)


def conv_grads(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, stride: Pair, padding: Pads, dilation: Pair, groups: int) -> tuple:
    """(grad_x, grad_weight, grad_bias) through aten.convolution_backward (cuDNN)."""
    top, bottom, left, right = padding
    sym = _symmetric(padding)
    xp = x if sym else F.pad(x, (left, right, top, bottom))
    pad = [top, left] if sym else [0, 0]
    with ieee_fp32(x.dtype):
        gx, gw, gb = torch.ops.aten.convolution_backward(
            g, xp, weight, [int(weight.shape[0])], list(stride), pad, list(dilation), False, [0, 0], groups, [True, True, True]
        )
    if not sym:
        gx = gx[:, :, top : top + x.shape[2], left : left + x.shape[3]]
    return gx, gw, gb


@kernel("conv2d", name="cudnn", priority=10, dtypes=FLOATS)
def conv2d(x, weight, bias, stride, padding, dilation, groups):
    return conv(x, weight, bias, stride, padding, dilation, groups)


@kernel("conv2d_backward", name="cudnn", priority=10, dtypes=FLOATS)
def conv2d_backward(grad_out, x, weight, stride, padding, dilation, groups):
    return conv_grads(grad_out, x, weight, stride, padding, dilation, groups)


# --- batch_norm --------------------------------------------------------------------------------

_bn_vectors = contiguous_vectors("running_mean", "running_var", "weight", "bias")


@kernel("batch_norm", name="triton", priority=20, dtypes=FLOATS, triton=True, checks=[_bn_vectors])
def batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps):
    bn = family("batchnorm")
    xd = bn.dense(x)
    return bn.batch_norm_forward(xd, weight, bias, running_mean, running_var, training, momentum, eps, False, launch.batch_norm(xd))


@kernel("batch_norm", name="cudnn", priority=10, dtypes=FLOATS)
def batch_norm_cudnn(x, running_mean, running_var, weight, bias, training, momentum, eps):
    return F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)


def _grad_dtype(param: Optional[torch.Tensor], x: torch.Tensor) -> torch.dtype:
    return (param if param is not None else x).dtype


@kernel("batch_norm_backward", name="triton", priority=20, dtypes=FLOATS, triton=True,
        checks=[contiguous_vectors("running_mean", "running_var", "weight")])
def batch_norm_backward(grad_out, x, running_mean, running_var, weight, training, eps):
    bn = family("batchnorm")
    xd = bn.dense(x)
    dt = _grad_dtype(weight, x)
    return bn.batch_norm_backward(grad_out, xd, weight, None, running_mean, running_var, training, eps, False,
                                  launch.batch_norm(xd), (dt, dt))


# --- fused_conv_bn_relu --------------------------------------------------------------------------


class FoldCache:
    """Folded (weight, bias) of eval-mode conv + BN, reused while the parameters are unchanged.

    An entry is valid while each parameter is the same live tensor object at the same version
    counter (every in-place update bumps it), so a step of an optimizer or a load_state_dict
    invalidates it. A few entries are kept (least recently used first out).
    """

    def __init__(self, size: int = 64) -> None:
        self._lru: OrderedDict[tuple, tuple[list, torch.Tensor, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()
        self._size = size

    def get(self, x: torch.Tensor, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, eps: float):
        params = (conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var)
        channels_last = x.ndim == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        key = (tuple((id(p), p._version) if p is not None else None for p in params), eps, x.dtype, channels_last)
        with self._lock:
            hit = self._lru.get(key)
            if hit is not None and all((r is None and p is None) or (r is not None and r() is p) for r, p in zip(hit[0], params)):
                self._lru.move_to_end(key)
                return hit[1], hit[2]
        w, b = fold(x.dtype, channels_last, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, eps)
        with self._lock:
            self._lru[key] = ([weakref.ref(p) if p is not None else None for p in params], w, b)
            while len(self._lru) > self._size:
                self._lru.popitem(last=False)
        return w, b


@torch.no_grad()
def fold(dtype, channels_last, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, eps):
    """Eval batch norm folded into the convolution, computed in float32 and rounded once."""
    a = torch.rsqrt(running_var.float() + eps)
    if bn_weight is not None:
        a = a * bn_weight.float()
    w = (conv_weight.float() * a.view(-1, 1, 1, 1)).to(dtype)
    if channels_last:
        w = w.contiguous(memory_format=torch.channels_last)
    b = -running_mean.float() * a
    if conv_bias is not None:
        b = b + conv_bias.float() * a
    if bn_bias is not None:
        b = b + bn_bias.float()
    return w, b.to(dtype)


FOLDED = FoldCache()


def _eval_only(inputs: Inputs) -> list[str]:
    reasons = []
    if inputs["training"]:
        reasons.append("training mode (batch statistics cannot be folded into the weights)")
    if not _symmetric(inputs["padding"]):
        reasons.append("asymmetric padding (cudnn_convolution_relu takes one padding per side pair)")
    return reasons


@kernel("fused_conv_bn_relu", name="cudnn_fused", priority=30, dtypes=NOT_F64, checks=[_eval_only])
def fused_conv_bn_relu_cudnn(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, momentum, training):
    w, b = FOLDED.get(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, eps)
    with ieee_fp32(x.dtype):
        return torch.cudnn_convolution_relu(x, w, b, stride, (padding[0], padding[2]), dilation, groups)


_fused_vectors = contiguous_vectors("running_mean", "running_var", "bn_weight", "bn_bias", "conv_bias")


@kernel("fused_conv_bn_relu", name="cudnn_triton", priority=20, dtypes=FLOATS, triton=True, checks=[_fused_vectors])
def fused_conv_bn_relu(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, momentum, training):
    bn = family("batchnorm")
    y = bn.dense(conv(x, conv_weight, None, stride, padding, dilation, groups))
    return bn.batch_norm_forward(y, bn_weight, bn_bias, running_mean, running_var, training, momentum, eps, True,
                                 launch.batch_norm(y), conv_bias=conv_bias)


@kernel("fused_conv_bn_relu_backward", name="cudnn_triton", priority=20, dtypes=FLOATS, triton=True, checks=[_fused_vectors])
def fused_conv_bn_relu_backward(grad_out, x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, training):
    bn = family("batchnorm")
    y = bn.dense(conv(x, conv_weight, None, stride, padding, dilation, groups))
    dtypes = (_grad_dtype(bn_weight, x), _grad_dtype(bn_bias, x))
    dy, g_gamma, g_beta = bn.batch_norm_backward(grad_out, y, bn_weight, bn_bias, running_mean, running_var, training, eps, True,
                                                 launch.batch_norm(y), dtypes, conv_bias=conv_bias)
    gx, gw, gb = conv_grads(dy, x, conv_weight, stride, padding, dilation, groups)
    if training:  # the batch mean absorbs the convolution bias: its gradient is exactly zero
        gb = torch.zeros_like(gb)
    return gx, gw, gb, g_gamma, g_beta
