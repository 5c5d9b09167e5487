"""Register the kits/cpp kernels (named "cpp") onto a plugin, given a runtime.

A GPU plugin calls :func:`register` once at import with its runtime object (which imports nothing
heavy until a kernel runs) and, for fused_conv_bn_relu, its vendor library's convolution
(:class:`Convolution`: cuDNN, MIOpen). Each kernel rejects, with the runtime's reason, when the
runtime cannot run here (CuPy or hip-python missing, no compiler, no device), so the dispatcher
falls back, counted, to the plugin's other kernels.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

import torch

from hal.arrays import flat_runs
from hal.plugin import CONTEXTS, Inputs, Plugin

from . import batchnorm as bn
from . import norm, optim
from .kit import Kit, Runtime

FLOATS = ("float16", "bfloat16", "float32", "float64")
ADAMW_LISTS = ("params", "grads", "exp_avgs", "exp_avg_sqs", "master_params")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


@dataclasses.dataclass(frozen=True)
class Convolution:
    """A vendor library's convolution, which the fused conv + batch norm + ReLU kernels build on.

    ``name`` names the kernels ("cudnn" gives "cudnn_cpp"); ``forward(x, weight, bias, stride,
    padding, dilation, groups)`` takes canonical arguments (padding as (top, bottom, left, right));
    ``grads(grad_out, x, weight, stride, padding, dilation, groups)`` returns (grad_x, grad_weight,
    grad_bias). Both keep hal's IEEE float32.
    """

    name: str
    forward: Callable[..., torch.Tensor]
    grads: Callable[..., tuple]


def runtime_check(runtime: Runtime) -> Callable[[Inputs], list[str]]:
    """A kernel check: the runtime's reason when it cannot run kernels here."""

    def check(inputs: Inputs) -> list[str]:
        reason = runtime.unavailable_reason()
        return [reason] if reason else []

    return check


def _unit_stride(inputs: Inputs, names: tuple[str, ...]) -> list[str]:
    bad = [n for n in names if isinstance(inputs[n], torch.Tensor) and inputs[n].stride(-1) != 1]
    return [f"{', '.join(bad)} must have unit stride (the kernels index them in place)"] if bad else []


#: where the kit's kernels serve unless a plugin says otherwise: every context, below the Triton
#: kernels (20) and torch's (25), whose launches cost less host time.
EVERYWHERE = {c: 15 for c in CONTEXTS}


def register(plugin: Plugin, runtime: Runtime, *, backend: Optional[str] = None, contexts: Mapping[str, int] = EVERYWHERE,
             convolution: Optional[Convolution] = None, op_contexts: Optional[Mapping[str, Mapping[str, int]]] = None,
             **kernel_options: Any) -> Kit:
    """Register the C++ kernels of batch_norm, batch_norm_backward, layer_norm_backward,
    rms_norm_backward and fused_adamw_ as kernel "cpp" of ``backend`` (default: the plugin's own),
    and with a ``convolution`` those of fused_conv_bn_relu and its backward as
    "<convolution.name>_cpp" (the library's convolution, then the C++ batch norm + ReLU). Each serves
    ``contexts`` (``{context: priority}``, :meth:`Plugin.kernel`'s), or where ``op_contexts`` names
    its op, those (a plugin's routing measured per vendor: the batch norm first in graph replays,
    say); ``kernel_options`` go to :meth:`Plugin.kernel` (the architecture predicate, for one).
    Returns the kit (its compiled modules and scratch buffers) the kernels launch through."""
    kit = Kit(runtime)
    available = runtime_check(runtime)

    def bn_check(*vectors: str):
        def check(inputs: Inputs) -> list[str]:
            reasons = available(inputs) + _unit_stride(inputs, vectors)
            layout = bn.unsupported_reason(inputs["x"])
            return reasons + ([layout] if layout else [])

        return check

    def kernel(op: str, check, dtypes=FLOATS, name: str = "cpp"):
        return plugin.kernel(op, name=name, backend=backend, contexts=(op_contexts or {}).get(op, contexts), dtypes=dtypes, check=check,
                             **kernel_options)

    @kernel("batch_norm", bn_check("running_mean", "running_var", "weight", "bias"))
    def batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps):
        return bn.batch_norm_forward(kit, x, weight, bias, running_mean, running_var, training, momentum, eps, False)

    @kernel("batch_norm_backward", bn_check("running_mean", "running_var", "weight"))
    def batch_norm_backward(grad_out, x, running_mean, running_var, weight, training, eps):
        dt = bn.grad_dtype(weight, x)
        return bn.batch_norm_backward(kit, grad_out, x, weight, None, running_mean, running_var, training, eps, False, (dt, dt))

    def norm_check(inputs: Inputs) -> list[str]:
        reason = norm.unsupported_reason(_numel(inputs["normalized_shape"]))
        return available(inputs) + _unit_stride(inputs, ("weight",)) + ([reason] if reason else [])

    @kernel("layer_norm_backward", norm_check)
    def layer_norm_backward(grad_out, x, normalized_shape, weight, eps):
        dx, gw, gb = norm.norm_backward(kit, grad_out, x, _numel(normalized_shape), weight, eps, False)
        return dx, gw.view(normalized_shape), gb.view(normalized_shape)

    @kernel("rms_norm_backward", norm_check)
    def rms_norm_backward(grad_out, x, normalized_shape, weight, eps):
        dx, gw, _ = norm.norm_backward(kit, grad_out, x, _numel(normalized_shape), weight, eps, True)
        return dx, gw.view(normalized_shape)

    def adamw_check(inputs: Inputs) -> list[str]:
        reasons = available(inputs)
        if not flat_runs(*(inputs[n] for n in ADAMW_LISTS if inputs[n] is not None)):
            reasons.append(f"{', '.join(ADAMW_LISTS)} hold tensors with gaps or overlaps, or differing in memory layout at one "
                           "index (the multi-tensor kernel walks each as one run of memory)")
        return reasons

    @kernel("fused_adamw_", adamw_check)
    def fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step, master_params,
                     inv_scale, found_inf):
        optim.fused_adamw(kit, params, grads, exp_avgs, exp_avg_sqs, master_params, lr=lr, beta1=beta1, beta2=beta2,
                          eps=eps, weight_decay=weight_decay, step=step, inv_scale=inv_scale, found_inf=found_inf)
        return None

    if convolution is not None:
        _register_fused(kernel, kit, available, convolution)
    return kit


def _register_fused(kernel: Callable[..., Callable], kit: Kit, available: Callable[[Inputs], list[str]],
                    convolution: Convolution) -> None:
    """fused_conv_bn_relu and its backward: ``convolution`` without its bias (it cancels in the
    normalisation and is folded into the running mean), then the C++ batch norm with the ReLU."""
    conv, conv_grads, name = convolution.forward, convolution.grads, f"{convolution.name}_cpp"

    def check(inputs: Inputs) -> list[str]:
        return available(inputs) + _unit_stride(inputs, ("running_mean", "running_var", "bn_weight", "bn_bias", "conv_bias"))

    @kernel("fused_conv_bn_relu", check, name=name)
    def fused_conv_bn_relu(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups,
                           eps, momentum, training):
        inside = conv_bias if not training and eps == 0 else None  # as hal_triton.kernels' fused_conv_bn_relu
        y = conv(x, conv_weight, inside, stride, padding, dilation, groups)
        return bn.batch_norm_forward(kit, y, bn_weight, bn_bias, running_mean, running_var, training, momentum, eps, True,
                                     conv_bias=None if inside is not None else conv_bias)

    @kernel("fused_conv_bn_relu_backward", check, name=name)
    def fused_conv_bn_relu_backward(grad_out, x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding,
                                    dilation, groups, eps, training):
        y = conv(x, conv_weight, None, stride, padding, dilation, groups)
        dtypes = (bn.grad_dtype(bn_weight, x), bn.grad_dtype(bn_bias, x))
        dy, g_gamma, g_beta = bn.batch_norm_backward(kit, grad_out, y, bn_weight, bn_bias, running_mean, running_var, training, eps, True,
                                                     dtypes, conv_bias=conv_bias)
        gx, gw, gb = conv_grads(dy, x, conv_weight, stride, padding, dilation, groups)
        if training:  # the batch mean absorbs the convolution bias: its gradient is exactly zero
            gb = torch.zeros_like(gb)
        return gx, gw, gb, g_gamma, g_beta
