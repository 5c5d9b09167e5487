"""Batch norm, and the vendor's convolution followed by it (``<conv>_triton``: the library
convolution, then the Triton statistics and normalise + ReLU passes). Launch configuration: the
plugin's ``batch_norm`` tiles for the (N, C, ...) input in its memory layout."""

from __future__ import annotations

from typing import Optional

import torch

from ..checks import contiguous_vectors
from .kit import FIRST, Kit, family


def _grad_dtype(param: Optional[torch.Tensor], x: torch.Tensor) -> torch.dtype:
    return (param if param is not None else x).dtype


def register(kit: Kit) -> None:
    tables, conv, conv_grads = kit.tables, kit.vendor.conv, kit.vendor.conv_grads
    bn_vectors = contiguous_vectors("running_mean", "running_var", "weight", "bias")
    fused_vectors = contiguous_vectors("running_mean", "running_var", "bn_weight", "bn_bias", "conv_bias")

    @kit.kernel("batch_norm", "triton", FIRST, checks=(bn_vectors,))
    def batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps):
        bn = family("batchnorm")
        xd = bn.dense(x)
        return bn.batch_norm_forward(xd, weight, bias, running_mean, running_var, training, momentum, eps, False, tables.batch_norm(xd))

    @kit.kernel("batch_norm_backward", "triton", FIRST, checks=(contiguous_vectors("running_mean", "running_var", "weight"),))
    def batch_norm_backward(grad_out, x, running_mean, running_var, weight, training, eps):
        bn = family("batchnorm")
        xd = bn.dense(x)
        dt = _grad_dtype(weight, x)
        return bn.batch_norm_backward(grad_out, xd, weight, None, running_mean, running_var, training, eps, False, tables.batch_norm(xd), (dt, dt))

    @kit.kernel("fused_conv_bn_relu", f"{kit.vendor.conv_name}_triton", FIRST, checks=(fused_vectors,))
    def fused_conv_bn_relu(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, momentum, training):
        """The library convolution without its bias (it cancels in the normalisation and goes into
        the running mean), then the Triton statistics and normalise + ReLU passes."""
        bn = family("batchnorm")
        # eval at eps = 0: the bias stays in the convolution, since with an infinite scale a (a zero
        # running variance) conv * a + bias * a gives other infinities than the op's (conv + bias) * a
        inside = conv_bias if not training and eps == 0 else None
        y = bn.dense(conv(x, conv_weight, inside, stride, padding, dilation, groups))
        return bn.batch_norm_forward(y, bn_weight, bn_bias, running_mean, running_var, training, momentum, eps, True,
                                     tables.batch_norm(y), conv_bias=None if inside is not None else conv_bias)

    @kit.kernel("fused_conv_bn_relu_backward", f"{kit.vendor.conv_name}_triton", FIRST, checks=(fused_vectors,))
    def fused_conv_bn_relu_backward(grad_out, x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, training):
        """Recomputes the convolution output, runs the batch-norm backward with the ReLU mask, then
        the library's convolution backward. In training the convolution bias gets an exact zero
        gradient (the batch mean absorbs it; a sum of rounded values that cancel would be noise)."""
        bn = family("batchnorm")
        y = bn.dense(conv(x, conv_weight, None, stride, padding, dilation, groups))
        dtypes = (_grad_dtype(bn_weight, x), _grad_dtype(bn_bias, x))
        dy, g_gamma, g_beta = bn.batch_norm_backward(grad_out, y, bn_weight, bn_bias, running_mean, running_var, training, eps, True,
                                                     tables.batch_norm(y), dtypes, conv_bias=conv_bias)
        gx, gw, gb = conv_grads(dy, x, conv_weight, stride, padding, dilation, groups)
        if training:
            gb = torch.zeros_like(gb)
        return gx, gw, gb, g_gamma, g_beta
