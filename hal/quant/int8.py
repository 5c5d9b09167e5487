"""Conversion of ``nn.Linear`` layers to int8 inference with ``hal.ops.int8_linear``.

Weights are quantised per output channel, symmetric in [-127, 127]; activations per tensor,
symmetric (int8_linear has no zero points), with a scale calibrated by an observer on sample
inputs. At run time the input is quantised (``hal.ops.quantize``), multiplied in int8 with int32
accumulation and rescaled in the GEMM epilogue.
"""

from __future__ import annotations

import copy
from typing import Callable, Iterable, Optional

import torch
from torch import nn

import hal
from hal.ops.quant import OUT_DTYPES
from hal.quant.observers import Observer
from hal.quant.qat import QATLinear, default_activation_observer, default_weight_observer


class Int8Linear(nn.Module):
    """A Linear computed in int8: buffers ``w_q`` (int8, (out, in)), ``w_scale`` (float32, (out,)),
    ``x_scale`` (float32, 0-d) and ``bias`` (float, or None). Returns the input's dtype (float64
    inputs get a float32 GEMM epilogue, then are cast back)."""

    def __init__(self, w_q: torch.Tensor, w_scale: torch.Tensor, x_scale: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        super().__init__()
        self.in_features, self.out_features = int(w_q.shape[1]), int(w_q.shape[0])
        self.register_buffer("w_q", w_q)
        self.register_buffer("w_scale", w_scale)
        self.register_buffer("x_scale", x_scale)
        self.register_buffer("bias", bias)

    @classmethod
    def from_float(cls, linear: nn.Linear, act_observer: Optional[Observer] = None) -> "Int8Linear":
        """Quantise ``linear``: its weight per output channel, its input with the scale of
        ``act_observer``, which has observed the layer's inputs (a :class:`QATLinear`'s own
        activation observer when omitted)."""
        if act_observer is None and isinstance(linear, QATLinear):
            act_observer = linear.act_fake_quant.observer
        if act_observer is None:
            raise ValueError("Int8Linear.from_float needs an observer that has seen the layer's inputs (act_observer)")
        x_scale, x_zero = act_observer.qparams()
        if x_scale.ndim != 0 or int(x_zero) != 0:
            raise ValueError(
                "int8_linear takes per-tensor symmetric activations (zero point 0): calibrate with "
                "an observer built with symmetric=True and axis=None"
            )
        weight = linear.weight.detach()
        weight_obs = default_weight_observer()
        weight_obs.observe(weight)
        w_scale = weight_obs.qparams()[0].to(weight.device)
        w_q = hal.ops.quantize(weight, w_scale, torch.zeros_like(w_scale, dtype=torch.int32), 0, "int8")
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(w_q, w_scale, x_scale.to(weight.device), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_q = hal.ops.quantize(x, self.x_scale, 0, None, "int8")
        name = str(x.dtype).removeprefix("torch.")
        out = hal.ops.int8_linear(x_q, self.w_q, self.x_scale, self.w_scale, self.bias, name if name in OUT_DTYPES else "float32")
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def convert(
    model: nn.Module,
    calibration: Iterable[torch.Tensor],
    observer: Callable[[], Observer] = default_activation_observer,
    inplace: bool = False,
) -> nn.Module:
    """Calibrate and convert every ``nn.Linear`` (and :class:`QATLinear`) of ``model`` to
    :class:`Int8Linear`.

    ``calibration``: model inputs to run (in eval mode, without gradients) while an ``observer()``
    watches each linear's input; a QATLinear keeps the observers it trained with. Works on a deep
    copy unless ``inplace``.
    """
    if not inplace:
        model = copy.deepcopy(model)
    plain = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear]
    observers = {n: observer() for n, _ in plain}
    hooks = [m.register_forward_pre_hook(lambda _m, args, o=observers[n]: o.observe(args[0])) for n, m in plain]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in calibration:
                model(batch)
    finally:
        for h in hooks:
            h.remove()
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear or isinstance(module, QATLinear):
            if name in observers and not observers[name].count:
                raise ValueError(f"hal.quant.convert: linear {name or '(the model)'!r} saw no input in calibration; pass batches that reach it")
            int8 = Int8Linear.from_float(module, observers.get(name))
            if name:
                parent, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(parent), leaf, int8)
            else:
                return int8
    return model.train(was_training)
