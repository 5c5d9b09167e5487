"""``hal.fp8.Linear``: a linear layer whose three GEMMs run in FP8 through ``hal.ops.fp8_scaled_mm``,
and :func:`convert`, which swaps a model's ``nn.Linear`` layers for it.

Forward: the input and the weight are quantised to the recipe's format (e4m3), the GEMM adds the
bias and rounds once to the output dtype (the autocast dtype where autocast is on, else the input's).
Backward (a ``torch.autograd.Function``): the output gradient is quantised to the gradient format
(e5m2); ``grad_input = grad_out @ W`` and ``grad_weight = grad_out^T @ x`` run as ``fp8_scaled_mm``
too. The GEMM contracts along the last dimension of both operands, so these need ``W^T``, ``x^T``
and ``grad_out^T``. Each comes from the same pass as its tensor's own quantisation
(``fp8_quantize_transpose``: one read, both layouts written, no transposed copy): the forward
quantises x and W with their transposes where the backward will need them and saves the FP8
transposes (one byte an element) instead of x and W, so the backward reads neither again; with one
scale per tensor the transpose shares it (identical to transposing the FP8 values; delayed scaling's
state is touched once per call), with row or block scales the transpose has its own current scales of
the recipe's granularity (they must group along the contraction dimension, which transposition
changes). Memory: a layer holds x^T in FP8 in place of x (half of bf16's bytes, where nothing else
holds x) and W^T in FP8 besides its weight (a byte a weight element, as Transformer Engine's FP8
weight transpose). The bias gradient is ``grad_out.sum(0)`` in float32. Master weights stay in the
module's dtype (float32, bfloat16 or float16): only the GEMM operands are FP8.

The input's amax may come with it (``forward(x, x_amax)``): under per-tensor current scaling the
amax reduced by x's producer as it wrote x (``hal.ops.rms_norm_amax``, ``swiglu_amax``; the patched
Llama decoder layer of :mod:`hal.nn.patch_hf` passes them), so x's cast reads x once
(``hal.ops.fp8_quantize_transpose_from_amax``) instead of twice (amax, then codes).

NaN: under delayed scaling a NaN in the input gives NaN in its output row, as ``nn.Linear``; under
current scaling the NaN makes its group's scale NaN (the amax propagates NaN), which
``fp8_scaled_mm`` refuses with an error for host tensors (device scales are not read: NaN output).
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

import torch
from torch import nn

from hal.nn.weight_copies import copy_for
from hal.ops import fp8_scaled_mm

from .device import require_fp8
from .recipes import CurrentScaling, Recipe

_OUT_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _dtype_name(dt: torch.dtype, what: str) -> str:
    if dt not in _OUT_DTYPES:
        raise TypeError(f"hal.fp8.Linear: {what} must be float32, bfloat16 or float16, got {dt}; "
                        "cast the module or the input (e.g. model.float())")
    return _OUT_DTYPES[dt]


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, sx, sw, sg, out_dtype, weight_copy, x_amax):  # type: ignore[override]
        # an operand whose transpose the backward reads is quantised with it, in one pass; the
        # backward then reads the saved FP8 transpose instead of the high-precision tensor again.
        # The weight's values come from its half-precision copy where there is one (fewer bytes to
        # read; the gradient still goes to the weight itself, in its dtype). x_amax: x's amax,
        # reduced by x's producer (None: the input scaler finds what it needs itself)
        w = weight if weight_copy is None else weight_copy
        wants_wt, wants_xt = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        given = () if x_amax is None else (x_amax,)  # (a scaler that does not use an amax is not given one)
        if wants_xt:
            qx, scale_x, qxt, scale_xt = sx.quantize_with_transpose(x, *given)
        else:
            (qx, scale_x), qxt, scale_xt = sx.quantize(x, *given), None, None
        if wants_wt:
            qw, scale_w, qwt, scale_wt = sw.quantize_with_transpose(w)
        else:
            (qw, scale_w), qwt, scale_wt = sw.quantize(w), None, None
        out = fp8_scaled_mm(qx, qw, scale_x, scale_w, bias, sx.format, sw.format, out_dtype,
                            getattr(sx, "block_size", 128))
        ctx.save_for_backward(qxt, scale_xt, qwt, scale_wt)
        ctx.scalers = (sx, sw, sg)
        ctx.dtypes = (x.dtype, weight.dtype)
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return out

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        qxt, scale_xt, qwt, scale_wt = ctx.saved_tensors
        sx, sw, sg = ctx.scalers
        x_dtype, w_dtype = ctx.dtypes
        bs = getattr(sx, "block_size", 128)
        g = g.contiguous()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[1]:  # g and g^T (N, M) from one pass over g
            qg, scale_g, qgt, scale_gt = sg.quantize_with_transpose(g)
        else:
            qg, scale_g = sg.quantize(g)
        if ctx.needs_input_grad[0]:  # grad_x = g @ W: W^T (K, N) from the forward
            grad_x = fp8_scaled_mm(qg, qwt, scale_g, scale_wt, None, sg.format, sw.format, _dtype_name(x_dtype, "the input"), bs)
        if ctx.needs_input_grad[1]:  # grad_w = g^T @ x: x^T (K, M) from the forward
            grad_w = fp8_scaled_mm(qgt, qxt, scale_gt, scale_xt, None, sg.format, sx.format, _dtype_name(w_dtype, "the weight"), bs)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.float().sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The autocast dtype for ``device_type`` where autocast is on there (torch 2.11 and 2.13)."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except TypeError:  # older signature: CUDA only
        enabled = torch.is_autocast_enabled() if device_type == "cuda" else torch.is_autocast_cpu_enabled()
    if not enabled:
        return None
    get = getattr(torch, "get_autocast_dtype", None)
    if get is not None:
        return get(device_type)
    return torch.get_autocast_gpu_dtype() if device_type == "cuda" else torch.get_autocast_cpu_dtype()


class Linear(nn.Linear):
    """``nn.Linear`` with FP8 GEMMs (see the module docs): same parameters, same ``state_dict``.

    recipe: a :mod:`hal.fp8.recipes` recipe (``CurrentScaling()`` per tensor by default). The
    recipe's per-tensor state (delayed scaling) is in the submodules ``input_scaler``,
    ``weight_scaler`` and ``grad_scaler``, as non-persistent buffers.

    Inside ``hal.optimize``'s step, under autocast, a float32 weight is quantised from its
    half-precision copy (``hal.nn.weight_copies``: written by the optimizer's update), as autocast
    would have cast it first: 2 bytes an element read twice (amax, cast) instead of 4."""

    #: the weight's values are read through hal.nn.weight_copies.copy_for (a copy inside hal.optimize's step)
    reads_weight_copy = True

    def __init__(self, in_features: int, out_features: int, bias: bool = True, recipe: Optional[Recipe] = None,
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._make_scalers(recipe, None if self.weight.is_meta else self.weight.device)

    def _make_scalers(self, recipe: Optional[Recipe], device: Optional[torch.device]) -> None:
        self.recipe = recipe if recipe is not None else CurrentScaling()
        if not isinstance(self.recipe, Recipe):
            raise TypeError(f"hal.fp8.Linear: recipe must be a hal.fp8 recipe (CurrentScaling(), DelayedScaling(), ...), "
                            f"got {type(recipe).__name__}")
        require_fp8("hal.fp8.Linear", device, (self.recipe.format, self.recipe.backward_format))
        self._fp8_device = device  # the device last found to have FP8 (checked again when the input moves)
        self.input_scaler = self.recipe.scaler(self.recipe.format, device)
        self.weight_scaler = self.recipe.scaler(self.recipe.format, device)
        self.grad_scaler = self.recipe.scaler(self.recipe.backward_format, device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Optional[Recipe] = None) -> "Linear":
        """An FP8 layer sharing ``linear``'s parameters (the same Parameter objects: optimizers and
        tied weights keep pointing at them)."""
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, recipe,
                  device=torch.device("meta"), dtype=linear.weight.dtype)
        new.weight = linear.weight
        new.bias = linear.bias
        new._make_scalers(recipe, linear.weight.device)
        new.train(linear.training)
        return new

    @property
    def takes_input_amax(self) -> bool:
        """Whether :meth:`forward` uses an ``x_amax`` it is given (per-tensor current scaling: the
        input's cast then reads x once, for the codes); else one given is ignored."""
        return self.input_scaler.uses_amax

    def forward(self, x: torch.Tensor, x_amax: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x_amax``: ``max |float32(x)|`` as a 0-d float32 tensor where x's producer reduced it
        (``hal.ops.rms_norm_amax`` / ``swiglu_amax``): the input's cast does not reduce it again
        (:attr:`takes_input_amax`; the same codes and scale as without it). It must be x's amax."""
        if x_amax is not None and not self.input_scaler.uses_amax:
            x_amax = None
        if not torch.compiler.is_compiling() and x.device != self._fp8_device:  # moved since construction
            require_fp8("hal.fp8.Linear", x.device, (self.recipe.format, self.recipe.backward_format))
            self._fp8_device = x.device
        _dtype_name(self.weight.dtype, "the weight")
        out_dt = _autocast_dtype(x.device.type) or x.dtype
        out_dtype = _dtype_name(out_dt, "the input (or autocast) dtype")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        out = _Fp8LinearFn.apply(x2, self.weight, self.bias, self.input_scaler, self.weight_scaler,
                                 self.grad_scaler, out_dtype, copy_for(self, out_dt), x_amax)
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"


def convert(model: nn.Module, recipe: Optional[Recipe] = None,
            keep: Union[Iterable[str], str, None] = None, within: str = "model") -> nn.Module:
    """Replace ``model``'s ``nn.Linear`` layers, in place, by :class:`Linear` sharing their parameters,
    and return the model. State-dict keys do not change.

    ``within``: ``"model"`` (default) converts every ``nn.Linear``; ``"blocks"`` only those inside
    the model's repeated blocks (the children of an ``nn.ModuleList`` of two or more modules of one
    class, :func:`hal.nn.recompute.blocks`: a transformer's layers), so embeddings, input projections
    and the output head stay in higher precision, where FP8 costs the most accuracy and saves the
    least time; ``"auto"``: ``"blocks"`` where the model has repeated blocks, else ``"model"``.
    ``keep``: layers left in higher precision besides, by qualified name (``"layers.0.proj"``) or
    ``"first"`` / ``"last"`` (the first and last ``nn.Linear`` in ``model.named_modules()`` order,
    usually the input projection and the output head). Default: ``("first", "last")`` within the
    model, nothing within blocks. ``keep=()`` converts them all."""
    from hal.nn.recompute import blocks

    if within not in ("model", "blocks", "auto"):
        raise ValueError(f"hal.fp8.convert: within must be 'model', 'blocks' or 'auto', not {within!r}")
    found = blocks(model) if within != "model" else []
    within = "blocks" if found else "model" if within == "auto" else within
    keep = (("first", "last") if within == "model" else ()) if keep is None else keep
    keep = (keep,) if isinstance(keep, str) else tuple(keep)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and not isinstance(m, Linear)]
    names = [n for n, _ in linears]
    unknown = [k for k in keep if k not in ("first", "last") and k not in names]
    if unknown:
        raise ValueError(f"hal.fp8.convert: keep names no nn.Linear of the model: {unknown}; "
                         f"its linear layers are {names}")
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"hal.fp8.convert: recipe must be a hal.fp8 recipe (CurrentScaling(), DelayedScaling(), ...), "
                        f"got {type(recipe).__name__}")
    kept = {k for k in keep if k not in ("first", "last")}
    if names and "first" in keep:
        kept.add(names[0])
    if names and "last" in keep:
        kept.add(names[-1])
    if within == "blocks":
        inside = {id(m) for block in found for m in block.modules()}
        kept.update(n for n, m in linears if id(m) not in inside)
    if "" in names and "" not in kept:
        raise ValueError("hal.fp8.convert: the model itself is an nn.Linear; use hal.fp8.Linear.from_linear(model)")
    chosen = CurrentScaling() if recipe is None else recipe
    for device in {m.weight.device for n, m in linears if n not in kept and not m.weight.is_meta}:
        # every device first, so a model is converted whole or not at all
        require_fp8("hal.fp8.convert", device, (chosen.format, chosen.backward_format))
    for name, module in linears:
        if name in kept:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, Linear.from_linear(module, recipe))
    if isinstance(chosen, CurrentScaling) and chosen.granularity == "tensor":
        # per-tensor current scaling: hal.nn.patch's Llama decoder layers hand their FP8 projections the
        # amaxes of their inputs, reduced by the norms and the SwiGLU as they write them
        from hal.nn.patch_hf_amax import pass_amaxes

        pass_amaxes(model)
    return model


__all__ = ["Linear", "convert"]
