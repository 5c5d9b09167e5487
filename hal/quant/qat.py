"""Quantisation-aware training: fake-quantise weights and activations with ``hal.ops.fake_quantize``.

The forward sees the values int8 inference will see (quantised and dequantised); the gradient is
straight-through inside the clamping range and zero outside (the op's backward), so the model learns
around the quantisation error. Observers keep calibrating while the module trains.
"""

from __future__ import annotations

import copy
from typing import Callable, Optional

import torch
from torch import nn

import hal
from hal.quant.observers import MinMaxObserver, Observer


class FakeQuantize(nn.Module):
    """Observe (in training) and fake-quantise a tensor with the observer's current qparams.

    ``observer``: makes the observer. ``running``: keep observing across steps (activations); False
    starts a fresh observer at every training step, so the qparams follow the tensor's current
    range (weights, which move as they train).
    """

    def __init__(self, observer: Callable[[], Observer], running: bool = True) -> None:
        super().__init__()
        self.make_observer = observer
        self.running = running
        self.observer = observer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            if not self.running:
                self.observer = self.make_observer()
            self.observer.observe(x.detach())
        scale, zero_point = self.observer.qparams()
        obs = self.observer
        return hal.ops.fake_quantize(x, scale.to(x.device), zero_point.to(x.device), obs.quant_min, obs.quant_max, obs.axis)


def default_weight_observer() -> Observer:
    """Per-output-channel symmetric int8 in [-127, 127], what int8_linear's weights take."""
    return MinMaxObserver("int8", symmetric=True, axis=0, quant_min=-127, quant_max=127)


def default_activation_observer() -> Observer:
    """Per-tensor symmetric int8 (zero point 0, as int8_linear's activations need)."""
    return MinMaxObserver("int8", symmetric=True)


class QATLinear(nn.Linear):
    """``nn.Linear`` whose input and weight pass through :class:`FakeQuantize` (hal.ops.linear after)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: object = None,
        dtype: Optional[torch.dtype] = None,
        act_observer: Callable[[], Observer] = default_activation_observer,
        weight_observer: Callable[[], Observer] = default_weight_observer,
    ) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.act_fake_quant = FakeQuantize(act_observer, running=True)
        self.weight_fake_quant = FakeQuantize(weight_observer, running=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **observers: Callable[[], Observer]) -> "QATLinear":
        """A QATLinear sharing ``linear``'s parameters."""
        qat = cls(linear.in_features, linear.out_features, linear.bias is not None, device="meta", **observers)
        qat.weight, qat.bias = linear.weight, linear.bias
        qat.train(linear.training)
        return qat

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return hal.ops.linear(self.act_fake_quant(x), self.weight_fake_quant(self.weight), self.bias)


def prepare_qat(model: nn.Module, inplace: bool = False) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` by a :class:`QATLinear` sharing its parameters
    (on a deep copy unless ``inplace``)."""
    if not inplace:
        model = copy.deepcopy(model)
    if type(model) is nn.Linear:
        return QATLinear.from_linear(model)
    for name, child in list(model.named_children()):
        if type(child) is nn.Linear:
            setattr(model, name, QATLinear.from_linear(child))
        else:
            prepare_qat(child, inplace=True)
    return model
