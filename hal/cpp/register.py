"""Register the hal/cpp kernels (named "cpp") onto a plugin, given a runtime.

A GPU plugin calls :func:`register` once at import with its runtime object (which imports nothing
heavy until a kernel runs). Each kernel rejects, with the runtime's reason, when the runtime cannot
run here (CuPy missing, no compiler), so the dispatcher falls back, counted, to the plugin's other
kernels.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from hal.arrays import flat_runs
from hal.plugin import Inputs, Plugin

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


def runtime_check(runtime: Runtime) -> Callable[[Inputs], list[str]]:
    """A kernel check: the runtime's reason when it cannot run kernels here."""

    def check(inputs: Inputs) -> list[str]:
        reason = runtime.unavailable_reason()
        return [reason] if reason else []

    return check


def _unit_stride(inputs: Inputs, names: tuple[str, ...]) -> list[str]:
    bad = [n for n in names if isinstance(inputs[n], torch.Tensor) and inputs[n].stride(-1) != 1]
    return [f"{', '.join(bad)} must have unit stride (the kernels index them in place)"] if bad else []


def register(plugin: Plugin, runtime: Runtime, *, backend: Optional[str] = None, priority: int = 15,
             **kernel_options: Any) -> Kit:
    """Register the C++ kernels of batch_norm, batch_norm_backward, layer_norm_backward,
    rms_norm_backward and fused_adamw_ as kernel "cpp"
    of ``backend`` (default: the plugin's own) with ``priority``; ``kernel_options`` go to
    :meth:`Plugin.kernel` (the architecture predicate, for one). Returns the kit (its compiled
    modules and scratch buffers) the kernels launch through."""
    kit = Kit(runtime)
    available = runtime_check(runtime)

    def bn_check(*vectors: str):
        def check(inputs: Inputs) -> list[str]:
            reasons = available(inputs) + _unit_stride(inputs, vectors)
            layout = bn.unsupported_reason(inputs["x"])
            return reasons + ([layout] if layout else [])

        return check

    def kernel(op: str, check, dtypes=FLOATS):
        return plugin.kernel(op, name="cpp", backend=backend, priority=priority, dtypes=dtypes, check=check, **kernel_options)

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
        if isinstance(inputs["step"], torch.Tensor):
            reasons.append("step is a device tensor (this kernel takes the step count as a host number)")
        return reasons

    @kernel("fused_adamw_", adamw_check)
    def fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step, master_params,
                     inv_scale, found_inf):
        optim.fused_adamw(kit, params, grads, exp_avgs, exp_avg_sqs, master_params, lr=lr, beta1=beta1, beta2=beta2,
                          eps=eps, weight_decay=weight_decay, step=step, inv_scale=inv_scale, found_inf=found_inf)
        return None

    return kit
