"""Fake (meta) kernels of the ``torch.ops.hal`` operators: the shape, dtype and device of each
result, computed from fake tensors without running anything.

torch.compile runs these while tracing. Each kernel decodes its slots, runs the op's checker (so a
bad call fails at compile time with the same hal error as in eager, and static options arrive
canonical: padding as four ints, dim >= 0, rms eps resolved) and builds empty results.

With dynamic shapes the checker sees meta tensors of the sizes' hints (it reads sizes as ints,
which would specialise every dimension), while the rules below compute with the symbolic sizes;
the kernels validate the real sizes when they run.

The rules state what the kernels return (ops/ docstrings): a gradient has the dtype of the input it
belongs to, or x's dtype when that input was absent; results are contiguous and distinct tensors
(two results that are one object would read as aliases to AOTAutograd).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

import torch

try:  # the size hint of a symbolic int; older torch versions name it hint_int
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:  # pragma: no cover - depends on the torch version
    from torch.fx.experimental.symbolic_shapes import hint_int as optimization_hint

from hal.arrays import torch_dtype

if TYPE_CHECKING:
    from hal.torch_library import TorchOp

Args = Mapping[str, Any]


def _like(t: torch.Tensor, shape: Optional[tuple] = None, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    return t.new_empty(tuple(t.shape) if shape is None else tuple(shape), dtype=dtype or t.dtype)


def _param_like(p: Optional[torch.Tensor], x: torch.Tensor, shape: tuple, fallback: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The gradient of a parameter: its shape and dtype; for an absent one, ``shape`` in the dtype of
    ``fallback`` (or x)."""
    if p is not None:
        return _like(p)
    return _like(x, shape, (fallback if fallback is not None else x).dtype)


def _conv_out(a: Args, x: str, w: str) -> tuple:
    """conv2d's output shape from canonical stride, padding (top, bottom, left, right), dilation."""
    xs, ws = a[x].shape, a[w].shape
    (sh, sw), (top, bottom, left, right), (dh, dw) = a["stride"], a["padding"], a["dilation"]
    ho = (xs[-2] + top + bottom - dh * (ws[2] - 1) - 1) // sh + 1
    wo = (xs[-1] + left + right - dw * (ws[3] - 1) - 1) // sw + 1
    return tuple(xs[:-3]) + (ws[0], ho, wo)


def _matmul_shape(a: torch.Tensor, b: torch.Tensor) -> tuple:
    """torch.matmul's result shape (1-D operands, broadcast batch dimensions)."""
    sa, sb = tuple(a.shape), tuple(b.shape)
    if len(sa) == 1 and len(sb) == 1:
        return ()
    batch = tuple(torch.broadcast_shapes(sa[:-2], sb[:-2]))
    return batch + (sa[-2:-1] if len(sa) > 1 else ()) + (sb[-1:] if len(sb) > 1 else ())


def _number_grad(v: Any, x: torch.Tensor) -> torch.Tensor:
    """Gradient of a scale_shift_act number-or-array: its shape (0-d for a number), x's dtype."""
    return _like(x, tuple(v.shape) if isinstance(v, torch.Tensor) else (), x.dtype)


def _fused_backward(a: Args) -> tuple:
    x, cw, cout = a["x"], a["conv_weight"], a["conv_weight"].shape[0]
    return (
        _like(x),
        _like(cw, dtype=x.dtype),
        _like(x, (cout,)),
        _param_like(a["bn_weight"], x, (cout,)),
        _param_like(a["bn_bias"], x, (cout,)),
    )


def _dequantize(a: Args) -> torch.Tensor:
    s = a["scale"]
    return _like(a["q"], dtype=s.dtype if isinstance(s, torch.Tensor) else torch.float32)


def _batch_norm_backward(a: Args) -> tuple:
    x, w = a["x"], a["weight"]
    c = (x.shape[1],)
    return _like(x), _param_like(w, x, c), _param_like(None, x, c, fallback=w)


def _norm_param_grad(a: Args) -> torch.Tensor:
    """grad_weight (or grad_bias) of layer_norm / rms_norm: normalized_shape, the weight's dtype."""
    return _param_like(a["weight"], a["x"], a["normalized_shape"])


#: op -> its results from canonical arguments by name.
RULES: dict[str, Callable[[Args], Any]] = {
    "conv2d": lambda a: _like(a["x"], _conv_out(a, "x", "weight")),
    "conv2d_backward": lambda a: (_like(a["x"]), _like(a["weight"]), _like(a["x"], (a["weight"].shape[0],))),
    "batch_norm": lambda a: _like(a["x"]),
    "batch_norm_backward": _batch_norm_backward,
    "fused_conv_bn_relu": lambda a: _like(a["x"], _conv_out(a, "x", "conv_weight")),
    "fused_conv_bn_relu_backward": _fused_backward,
    "scale_shift_act": lambda a: _like(a["x"]),
    "scale_shift_act_backward": lambda a: (_like(a["x"]), _number_grad(a["scale"], a["x"]), _number_grad(a["shift"], a["x"])),
    "linear": lambda a: _like(a["x"], tuple(a["x"].shape[:-1]) + (a["weight"].shape[0],)),
    "linear_backward": lambda a: (_like(a["x"]), _like(a["weight"]), _param_like(a["bias"], a["x"], (a["weight"].shape[0],))),
    "matmul": lambda a: _like(a["a"], _matmul_shape(a["a"], a["b"])),
    "matmul_backward": lambda a: (_like(a["a"]), _like(a["b"])),
    "grouped_gemm": lambda a: _like(a["x"], (a["x"].shape[0], a["weight"].shape[2])),
    "grouped_gemm_backward": lambda a: (_like(a["x"]), _like(a["weight"])),
    "layer_norm": lambda a: _like(a["x"]),
    "layer_norm_backward": lambda a: (_like(a["x"]), _norm_param_grad(a), _norm_param_grad(a)),
    "rms_norm": lambda a: _like(a["x"]),
    "rms_norm_backward": lambda a: (_like(a["x"]), _norm_param_grad(a)),
    "softmax": lambda a: _like(a["x"]),
    "softmax_backward": lambda a: _like(a["out"]),
    "scaled_dot_product_attention": lambda a: _like(a["q"], tuple(a["q"].shape[:-1]) + (a["v"].shape[-1],)),
    "scaled_dot_product_attention_backward": lambda a: (_like(a["q"]), _like(a["k"]), _like(a["v"])),
    "amp_unscale_": lambda a: (a["tensors"][0].new_empty((), dtype=torch.float32) if a["tensors"] else torch.empty((), dtype=torch.float32)),
    "fused_adamw_": lambda a: None,
    "quantize": lambda a: _like(a["x"], dtype=torch_dtype(a["dtype"])),
    "dequantize": _dequantize,
    "fake_quantize": lambda a: _like(a["x"]),
    "fake_quantize_backward": lambda a: _like(a["x"]),
    "int8_linear": lambda a: _like(a["x_q"], tuple(a["x_q"].shape[:-1]) + (a["w_q"].shape[0],), torch_dtype(a["out_dtype"])),
}


def _symbolic(v: Any) -> bool:
    if isinstance(v, (list, tuple)):
        return any(map(_symbolic, v))
    return isinstance(v, torch.Tensor) and not all(isinstance(s, int) for s in v.shape)


def _probe(v: Any) -> Any:
    """A tensor with symbolic sizes as a meta tensor of their hints (lists too); others as they are."""
    if isinstance(v, (list, tuple)):
        return type(v)(map(_probe, v))
    if isinstance(v, torch.Tensor) and _symbolic(v):
        return torch.empty([optimization_hint(s) for s in v.shape], dtype=v.dtype, device="meta")
    return v


def canonical(top: "TorchOp", slots: tuple) -> dict[str, Any]:
    """The call's arguments by name, validated and with the checker's canonical static values."""
    decl = top.decl
    args = top.decode(slots)
    named = decl.bind(args)
    if decl.check is not None:
        probe = tuple(map(_probe, args)) if _symbolic(args) else args
        named.update(decl.check(*probe) or {})
    return named


def fake_kernel(top: "TorchOp") -> Callable[..., Any]:
    """The fake kernel of a registered op."""
    rule = RULES[top.decl.name]

    def fake(*slots: Any) -> Any:
        return rule(canonical(top, slots))

    return fake


def fake_twin_kernel(top: "TorchOp", mutated: list[str], flag: str) -> Callable[..., Any]:
    """The fake kernel of a functional twin: the result, then each mutated array's new value
    (empty when the op does not write it)."""
    rule = RULES[top.decl.name]

    def fake(*slots: Any) -> Any:
        a = canonical(top, slots)
        out = rule(a)
        fresh = [_like(a[n]) if (a[flag] and a[n] is not None) else out.new_empty(0) for n in mutated]
        return (out, *fresh)

    return fake
