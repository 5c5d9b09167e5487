"""Modules whose forward is a hal op: conv -> batch-norm (-> add a residual) -> ReLU, conv -> batch-norm,
linear with an activation, norms.

Each is a drop-in for the PyTorch modules it replaces: same parameters, buffers and state_dict
keys, same train/eval behaviour. Under ``torch.autocast`` they follow PyTorch's autocast lists (hal
ops are not autocast ops themselves, so the modules cast): convolution and linear run in the
autocast dtype, the norms in float32; batch-norm parameters and running statistics stay float32
beside a half-precision activation, as cuDNN batch norm takes them.
"""

from __future__ import annotations

from typing import Any, Optional, TypeVar, Union

import torch
from torch import nn

import hal
from hal.nn.agreement import has_hooks
from hal.ops import ACTIVATIONS
from hal.plugin_sdk.activations import TORCH_ACTIVATIONS
from hal.plugin_sdk.fold import FoldCache



def unfused_activation(module: Optional[nn.Module], act: str, y: torch.Tensor) -> torch.Tensor:
    """``act`` applied to ``y`` as the unfused chain applied it: by its module where it was one (so
    that the module's hooks run), else by torch's function."""
    return module(y) if module is not None else TORCH_ACTIVATIONS[act](y)


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


_Fused = TypeVar("_Fused", bound="_ConvBN")


class _ConvBN(nn.Module):
    """An ``nn.Conv2d`` at child ``"0"`` and an ``nn.BatchNorm2d`` at child ``"1"`` (also reachable
    as ``.conv`` and ``.bn``): the state_dict of ``nn.Sequential(conv, bn, ...)``, and the batch
    norm's bookkeeping of ``nn.BatchNorm2d`` for the fused modules built on it.

    Or, made with ``from_modules(conv, bn, borrow=True)``, a fused module that borrows a model's
    conv and batch norm without registering them: it has no state of its own, and the two modules
    stay where they are in the model, with their state_dict keys (:func:`hal.nn.fuse`,
    :func:`hal.nn.patch`). Its train/eval mode is the batch norm's, as in ``nn.Sequential(conv, bn)``.

    Hooks: while the conv, the batch norm or the activation module the chain absorbed (``act`` of
    ``from_modules``) has a forward, forward-pre or backward hook, the forward calls those modules
    one by one instead of the fused op, so every hook runs with the arguments it would see in the
    unfused model (hooks registered before or after the module was built)."""

    #: (conv, bn) of a module that borrows them (None: its own children "0" and "1")
    _hal_borrowed: Optional[tuple[nn.Conv2d, nn.BatchNorm2d]] = None
    #: the activation module the chain absorbed (None: a function such as F.relu, or none)
    _hal_act: Optional[nn.Module] = None

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
    def from_modules(cls: type[_Fused], conv: nn.Conv2d, bn: nn.BatchNorm2d, borrow: bool = False,
                     act: Optional[nn.Module] = None) -> _Fused:
        """A fused module around existing modules (shared, not copied): as its children "0" and
        "1", or with ``borrow`` held without registering them (see the class docstring). ``act``:
        the ReLU module the fused chain replaces a call of, if it was a module (called instead of
        the fused op while it has hooks). Raises ValueError when they cannot be fused."""
        problem = fusion_problem(conv, bn)
        if problem:
            raise ValueError(f"cannot fuse {conv} and {bn}: {problem}")
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        if borrow:
            fused._hal_borrowed = (conv, bn)
        else:
            fused.add_module("0", conv)
            fused.add_module("1", bn)
        object.__setattr__(fused, "_hal_act", act)  # borrowed like conv and bn: not registered as a child
        fused.train(bn.training)
        return fused

    def _hooked(self) -> bool:
        """Whether a module of the chain has hooks now (the forward then runs the chain unfused)."""
        return has_hooks(self.conv) or has_hooks(self.bn) or (self._hal_act is not None and has_hooks(self._hal_act))

    @property
    def conv(self) -> nn.Conv2d:
        borrowed = self._hal_borrowed
        return borrowed[0] if borrowed is not None else self._modules["0"]  # type: ignore[return-value]

    @property
    def bn(self) -> nn.BatchNorm2d:
        borrowed = self._hal_borrowed
        return borrowed[1] if borrowed is not None else self._modules["1"]  # type: ignore[return-value]

    def extra_repr(self) -> str:
        borrowed = self._hal_borrowed
        return "" if borrowed is None else f"borrows conv={borrowed[0]}, bn={borrowed[1]}"

    def _batch_norm_state(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], float, bool]:
        """(running_mean, running_var, momentum, use batch statistics) of this forward, as
        ``nn.BatchNorm2d`` computes them; in training ``num_batches_tracked`` counts the batch
        (momentum None: the cumulative average)."""
        bn = self.bn
        training = bn.training  # the batch norm's mode, as nn.Sequential(conv, bn) would use it
        momentum = 0.0 if bn.momentum is None else bn.momentum
        if training and bn.track_running_stats and bn.num_batches_tracked is not None:
            bn.num_batches_tracked.add_(1)
            if bn.momentum is None:
                momentum = 1.0 / float(bn.num_batches_tracked)
        use_batch_stats = training or (bn.running_mean is None and bn.running_var is None)
        keep_running = not training or bn.track_running_stats
        return (bn.running_mean if keep_running else None, bn.running_var if keep_running else None, momentum, use_batch_stats)

    def _conv_args(self, x: torch.Tensor) -> tuple:
        """(x, weight, bias) under autocast's casts, then stride, padding, dilation and groups."""
        conv, dtype = self.conv, autocast_dtype(x)
        return (_cast(x, dtype), _cast(conv.weight, dtype), _cast(conv.bias, dtype), conv.stride, conv.padding, conv.dilation, conv.groups)

    def _conv_then_bn(self, x: torch.Tensor, state: tuple) -> torch.Tensor:
        """``hal.ops.conv2d`` then ``hal.ops.batch_norm``: two ops, nothing folded."""
        running_mean, running_var, momentum, use_batch_stats = state
        bn = self.bn
        y = hal.ops.conv2d(*self._conv_args(x))
        return hal.ops.batch_norm(y, running_mean, running_var, bn.weight, bn.bias, use_batch_stats, momentum, bn.eps)


class FusedConvBNReLU2d(_ConvBN):
    """``relu(batch_norm(conv2d(x)))`` as one ``hal.ops.fused_conv_bn_relu`` call.

    Holds an ``nn.Conv2d`` as child ``"0"`` and an ``nn.BatchNorm2d`` as child ``"1"`` (also reachable
    as ``.conv`` and ``.bn``), so its state_dict is that of ``nn.Sequential(conv, bn, nn.ReLU())``
    and loads from and into it. In training it normalises with batch statistics and updates the
    running statistics and ``num_batches_tracked`` exactly as ``nn.BatchNorm2d`` does (momentum None:
    cumulative average); in eval the batch norm is folded into the convolution by the kernel.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._hooked():
            return unfused_activation(self._hal_act, "relu", self.bn(self.conv(x)))
        running_mean, running_var, momentum, use_batch_stats = self._batch_norm_state()
        x, weight, bias, *geometry = self._conv_args(x)
        bn = self.bn
        return hal.ops.fused_conv_bn_relu(x, weight, bias, bn.weight, bn.bias, running_mean, running_var, *geometry, bn.eps, momentum, use_batch_stats)


class FusedConvBNAddReLU2d(_ConvBN):
    """``relu(batch_norm(conv2d(x)) + residual)`` as one ``hal.ops.fused_conv_bn_add_relu`` call: the
    tail of a ResNet block, ``forward(x, residual)``.

    Children, state_dict and batch-norm behaviour as :class:`FusedConvBNReLU2d` (the state_dict of
    ``nn.Sequential(conv, bn)``). Under autocast the residual is cast with x. A residual the op does
    not take (one that broadcasts to the convolution output, or of another dtype: torch's add would
    broadcast or promote) is added by torch after ``hal.ops.conv2d`` and ``hal.ops.batch_norm``, so
    the module computes what the unfused chain computes.
    """

    #: (x's shape, the convolution output's shape) of the last eager forward: its shape check costs
    #: a comparison, not the output-size arithmetic, while x's shape stays the same (not under
    #: torch.compile: Dynamo would guard on the cached shapes and recompile for every new size)
    _shapes: tuple = ((), ())

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self._hooked():
            return unfused_activation(self._hal_act, "relu", self.bn(self.conv(x)) + residual)
        state = self._batch_norm_state()
        x_, weight, bias, *geometry = self._conv_args(x)
        residual = _cast(residual, autocast_dtype(x)) if isinstance(residual, torch.Tensor) else residual
        if not self._takes(x_, residual):
            return torch.relu(self._conv_then_bn(x, state) + residual)
        running_mean, running_var, momentum, use_batch_stats = state
        bn = self.bn
        return hal.ops.fused_conv_bn_add_relu(x_, weight, bias, bn.weight, bn.bias, running_mean, running_var, residual, *geometry, bn.eps, momentum,
                                              use_batch_stats)

    def _takes(self, x: torch.Tensor, residual: Any) -> bool:
        """Whether the op takes ``residual``: a tensor of x's dtype and the convolution output's shape."""
        if not isinstance(residual, torch.Tensor) or residual.dtype != x.dtype:
            return False
        if torch.compiler.is_compiling():  # symbolic sizes stay symbolic, nothing cached
            return residual.shape == conv_output_shape(self.conv, x)
        if self._shapes[0] != x.shape:
            self._shapes = (x.shape, conv_output_shape(self.conv, x))
        return residual.shape == self._shapes[1]


#: folded (weight, bias) of the FusedConvBN2d modules in eval, kept while their parameters are unchanged
_FOLDED = FoldCache()


class FusedConvBN2d(_ConvBN):
    """``batch_norm(conv2d(x))``, no activation (torchvision's downsample ``nn.Sequential(conv, bn)``).

    Children, state_dict and batch-norm behaviour as :class:`FusedConvBNReLU2d`. In eval the batch
    norm is folded into the convolution's weight and bias (:class:`hal.plugin_sdk.fold.FoldCache`, kept
    while the parameters are unchanged) and one ``hal.ops.conv2d`` runs; in training, in eval where
    a parameter needs a gradient (folded weights would carry none), and under torch.compile (the
    cache is host bookkeeping Dynamo cannot trace; Inductor folds constants itself),
    ``hal.ops.conv2d`` then ``hal.ops.batch_norm``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._hooked():
            return self.bn(self.conv(x))
        state = self._batch_norm_state()
        running_mean, running_var, _, use_batch_stats = state
        if use_batch_stats or _parameters_need_grad(self.conv, self.bn) or torch.compiler.is_compiling():
            return self._conv_then_bn(x, state)
        x, _, _, *geometry = self._conv_args(x)
        conv, bn = self.conv, self.bn
        weight, bias = _FOLDED.get(x, conv.weight, conv.bias, bn.weight, bn.bias, running_mean, running_var, bn.eps)
        return hal.ops.conv2d(x, weight, bias, *geometry)


def _parameters_need_grad(*modules: nn.Module) -> bool:
    """Whether autograd would differentiate a forward with respect to the modules' parameters."""
    return torch.is_grad_enabled() and any(p.requires_grad for m in modules for p in m.parameters())


def conv_output_shape(conv: nn.Conv2d, x: torch.Tensor) -> tuple[int, ...]:
    """The shape ``conv`` gives for a batched (N, C, H, W) ``x`` (zero padding; () for other ranks).
    Sizes are not converted with ``int()``: under torch.compile with dynamic shapes they are
    symbolic, and ``int()`` would specialise the graph to this call's sizes."""
    if x.dim() != 4:
        return ()
    if conv.padding == "same":
        return (x.shape[0], conv.out_channels, x.shape[2], x.shape[3])
    pads = (0, 0) if conv.padding == "valid" else conv.padding
    hw = [(n + 2 * p - d * (k - 1) - 1) // s + 1 for n, p, d, k, s in zip(x.shape[2:], pads, conv.dilation, conv.kernel_size, conv.stride)]
    return (x.shape[0], conv.out_channels, *hw)


def fusion_problem(conv: nn.Module, bn: nn.Module) -> Optional[str]:
    """Why ``conv`` -> ``bn`` cannot become one of the fused conv modules (None when it can)."""
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
        return linear_act(self, self.act, x)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, act={self.act}"


class FusedLinearAct(nn.Module):
    """``act(linear(x))`` of a model's ``nn.Linear``, which it borrows without registering it, as one
    ``hal.ops.linear`` call: what :func:`hal.nn.fuse` puts beside the linear (``<linear>_fused``).

    It has no state of its own: the linear stays at its path with its parameters (state_dict keys
    and ``named_parameters()`` order unchanged), and each forward reads the linear's ``weight`` and
    ``bias`` as they are then (a parameter replaced after fusing is the one used). While the linear
    or the activation module (``act_module``, if the activation was one) has hooks, the forward
    calls them one by one instead, so their hooks run as in the unfused model."""

    def __init__(self, linear: nn.Linear, act: str, act_module: Optional[nn.Module] = None) -> None:
        if act not in ACTIVATIONS:
            raise ValueError(f"act must be one of {', '.join(ACTIVATIONS)}, not {act!r}")
        super().__init__()
        self._hal_borrowed = (linear, act_module)  # a tuple: not registered as children
        self.act = act

    @property
    def linear(self) -> nn.Linear:
        return self._hal_borrowed[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear, act_module = self._hal_borrowed
        if has_hooks(linear) or (act_module is not None and has_hooks(act_module)):
            return unfused_activation(act_module, self.act, linear(x))
        return linear_act(linear, self.act, x)

    def extra_repr(self) -> str:
        return f"borrows linear={self.linear}, act={self.act}"


def linear_act(linear: nn.Linear, act: str, x: torch.Tensor) -> torch.Tensor:
    """``act(linear(x))`` as one ``hal.ops.linear`` call on ``linear``'s parameters as they are
    now (the computation of :class:`Linear`, also for an ``nn.Linear`` it borrows)."""
    dtype = autocast_dtype(x)
    return hal.ops.linear(_cast(x, dtype), _cast(linear.weight, dtype), _cast(linear.bias, dtype), act)


def _half_beside_float32(x: torch.Tensor, *params: Optional[torch.Tensor]) -> bool:
    """A half-precision x with float32 parameters: what ``nn.LayerNorm`` and ``nn.RMSNorm`` accept
    (torch's mixed-dtype kernels compute in float32 and return x's dtype), and hal's norm ops, whose
    arrays share one dtype, do not take as they are."""
    return x.dtype in (torch.float16, torch.bfloat16) and any(p is not None and p.dtype == torch.float32 for p in params)


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` computed by ``hal.ops.layer_norm`` (float32 under autocast). A half-precision
    input beside float32 parameters (a model in bfloat16 whose norms were kept in float32) is
    normalised in float32 and returned in its own dtype, as ``nn.LayerNorm`` does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = torch.float32 if autocast_dtype(x) is not None else None
        if up is None and _half_beside_float32(x, self.weight, self.bias):
            return hal.ops.layer_norm(x.float(), self.normalized_shape, self.weight, self.bias, self.eps).to(x.dtype)
        return hal.ops.layer_norm(_cast(x, up), self.normalized_shape, _cast(self.weight, up), _cast(self.bias, up), self.eps)


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` computed by ``hal.ops.rms_norm`` (float32 under autocast); a half-precision
    input beside a float32 weight as :class:`LayerNorm`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = torch.float32 if autocast_dtype(x) is not None else None
        if up is None and _half_beside_float32(x, self.weight):
            return hal.ops.rms_norm(x.float(), self.normalized_shape, self.weight, self.eps).to(x.dtype)
        if up is None and self.weight is not None and self.weight.dtype != x.dtype:
            # any other mix (a float64 weight beside float32 x): torch's own rule, whose result is in
            # x's dtype; hal's op takes arrays of one dtype
            return super().forward(x)
        return hal.ops.rms_norm(_cast(x, up), self.normalized_shape, _cast(self.weight, up), self.eps)
