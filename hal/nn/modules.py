"""Modules whose forward is a hal op: conv -> batch-norm -> ReLU, linear with an activation, norms.

Each is a drop-in for the PyTorch modules it replaces: same parameters, buffers and state_dict
keys, same train/eval behaviour. Under ``torch.autocast`` they follow PyTorch's autocast lists (hal
ops are not autocast ops themselves, so the modules cast): convolution and linear run in the
autocast dtype, the norms in float32; batch-norm parameters and running statistics stay float32
beside a half-precision activation, as cuDNN batch norm takes them.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import nn

import hal
from hal.ops import ACTIVATIONS


def autocast_dtype(x: torch.Tensor) -> Optional[torch.dtype]:
    """The autocast dtype active for x's device; None outside autocast and for inputs autocast
    leaves alone (not floating point, or float64)."""
    kind = x.device.type
    if x.is_floating_point() and x.dtype != torch.float64 and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return None


def _cast(t: Optional[torch.Tensor], dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
    """``t`` in ``dtype`` as autocast would cast it (float64 stays float64)."""
    if t is None or dtype is None or t.dtype in (dtype, torch.float64):
        return t
    return t.to(dtype)


class FusedConvBNReLU2d(nn.Module):
    """``relu(batch_norm(conv2d(x)))`` as one ``hal.ops.fused_conv_bn_relu`` call.

    Holds an ``nn.Conv2d`` as child ``"0"`` and an ``nn.BatchNorm2d`` as child ``"1"`` (also reachable
    as ``.conv`` and ``.bn``), so its state_dict is that of ``nn.Sequential(conv, bn, nn.ReLU())``
    and loads from and into it. In training it normalises with batch statistics and updates the
    running statistics and ``num_batches_tracked`` exactly as ``nn.BatchNorm2d`` does (momentum None:
    cumulative average); in eval the batch norm is folded into the convolution by the kernel.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: Union[int, tuple[int, int]],
        stride: Union[int, tuple[int, int]] = 1,
        padding: Union[int, tuple[int, int], str] = 0,
        dilation: Union[int, tuple[int, int]] = 1,
        groups: int = 1,
        bias: bool = False,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, device=device, dtype=dtype)
        bn = nn.BatchNorm2d(out_channels, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.add_module("0", conv)
        self.add_module("1", bn)

    @classmethod
    def from_modules(cls, conv: nn.Conv2d, bn: nn.BatchNorm2d) -> "FusedConvBNReLU2d":
        """A fused module around existing modules (shared, not copied); raises ValueError when
        they cannot be fused."""
        problem = fusion_problem(conv, bn)
        if problem:
            raise ValueError(f"cannot fuse {conv} and {bn}: {problem}")
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.add_module("0", conv)
        fused.add_module("1", bn)
        fused.train(bn.training)
        return fused

    @property
    def conv(self) -> nn.Conv2d:
        return self._modules["0"]  # type: ignore[return-value]

    @property
    def bn(self) -> nn.BatchNorm2d:
        return self._modules["1"]  # type: ignore[return-value]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        conv, bn = self.conv, self.bn
        momentum = 0.0 if bn.momentum is None else bn.momentum
        if self.training and bn.track_running_stats and bn.num_batches_tracked is not None:
            bn.num_batches_tracked.add_(1)
            if bn.momentum is None:  # cumulative moving average, as nn.BatchNorm2d
                momentum = 1.0 / float(bn.num_batches_tracked)
        use_batch_stats = self.training or (bn.running_mean is None and bn.running_var is None)
        keep_running = not self.training or bn.track_running_stats
        dtype = autocast_dtype(x)
        return hal.ops.fused_conv_bn_relu(
            _cast(x, dtype),
            _cast(conv.weight, dtype),
            _cast(conv.bias, dtype),
            bn.weight,
            bn.bias,
            bn.running_mean if keep_running else None,
            bn.running_var if keep_running else None,
            conv.stride,
            conv.padding,
            conv.dilation,
            conv.groups,
            bn.eps,
            momentum,
            use_batch_stats,
        )


def fusion_problem(conv: nn.Module, bn: nn.Module) -> Optional[str]:
    """Why ``conv`` -> ``bn`` cannot become a FusedConvBNReLU2d (None when it can)."""
    if type(conv) is not nn.Conv2d:
        return f"the convolution is a {type(conv).__name__}, not an nn.Conv2d"
    if type(bn) is not nn.BatchNorm2d:
        return f"the normalisation is a {type(bn).__name__}, not an nn.BatchNorm2d"
    if conv.padding_mode != "zeros":
        return f"padding_mode {conv.padding_mode!r} (hal's convolution pads with zeros only)"
    if conv.out_channels != bn.num_features:
        return f"the convolution has {conv.out_channels} output channels, the batch norm {bn.num_features} features"
    return None


class Linear(nn.Linear):
    """``nn.Linear`` followed by an activation, as one ``hal.ops.linear`` call (a GEMM epilogue).

    act is one of none, relu, gelu, gelu_tanh, silu, sigmoid, tanh. Parameters and state_dict are
    those of ``nn.Linear``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        act: str = "none",
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        if act not in ACTIVATIONS:
            raise ValueError(f"act must be one of {', '.join(ACTIVATIONS)}, not {act!r}")
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.act = act

    @classmethod
    def from_linear(cls, linear: nn.Linear, act: str = "none") -> "Linear":
        """A hal Linear sharing ``linear``'s parameters (not copied)."""
        fused = cls(linear.in_features, linear.out_features, linear.bias is not None, act, device="meta")
        fused.weight = linear.weight
        fused.bias = linear.bias
        fused.train(linear.training)
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = autocast_dtype(x)
        return hal.ops.linear(_cast(x, dtype), _cast(self.weight, dtype), _cast(self.bias, dtype), self.act)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, act={self.act}"


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` computed by ``hal.ops.layer_norm`` (float32 under autocast)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = torch.float32 if autocast_dtype(x) is not None else None
        return hal.ops.layer_norm(_cast(x, up), self.normalized_shape, _cast(self.weight, up), _cast(self.bias, up), self.eps)


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` computed by ``hal.ops.rms_norm`` (float32 under autocast)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = torch.float32 if autocast_dtype(x) is not None else None
        return hal.ops.rms_norm(_cast(x, up), self.normalized_shape, _cast(self.weight, up), self.eps)
