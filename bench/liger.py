"""Liger-Kernel's kernels as a named peer ("liger") of the bench cases that have one.

Each adapter maps hal's canonical arguments of an op onto the Liger-Kernel autograd function that
computes the same thing, called as Liger-Kernel 0.8.5 defines it, on the peer's own copies of the
inputs (in the layout Liger expects, so that no hidden copy is timed). Three ways to time it, the
same three as the other columns of a case:

- ``forward``: the function on inputs that need no gradient;
- ``backward``: the graph built once, each run one ``torch.autograd.grad`` with ``retain_graph``,
  as the eager and torch.compile columns of hal's backward cases are timed;
- ``train``: forward and backward in every run (for the losses, whose gradient Liger computes in
  the forward pass: their backward alone is not comparable, and their backward cases say so).

Where a run overwrites its inputs (SwiGLU's backward writes its gradients into the saved inputs,
cross-entropy writes the gradient into the logits, RoPE's backward rotates grad_out in place) the
peer restores them before each timed run, outside the timing. RoPE's forward rotates q in place; a
rotation keeps random data random, so the forward's input is not restored.

A peer that cannot run says why (not installed, no GPU, an option Liger lacks); the table shows it.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Optional, Sequence

import torch

from .peer import Peer

NAME = "liger"


def version() -> Optional[str]:
    """The installed Liger-Kernel version, or None."""
    try:
        from importlib.metadata import version as dist_version

        return dist_version("liger-kernel")
    except Exception:  # noqa: BLE001 - not installed
        return None


def _library() -> Any:
    """``liger_kernel.ops``: its Function classes are the implementation Liger selected for this
    device (its Triton kernels on CUDA unless another of its back-ends was installed)."""
    import liger_kernel.ops

    return liger_kernel.ops


def import_reason(module: str = "liger_kernel.ops") -> Optional[str]:
    """Why ``module`` of Liger-Kernel does not import (not installed, or broken), or None."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] == "liger_kernel":
            return "Liger-Kernel not installed"
        return f"Liger-Kernel does not import: {type(exc).__name__}: {exc}"[:160]
    except Exception as exc:  # noqa: BLE001 - a broken install is reported in the table
        return f"Liger-Kernel does not import: {type(exc).__name__}: {exc}"[:160]
    return None


def _same(g: torch.Tensor) -> torch.Tensor:
    return g


@dataclasses.dataclass(frozen=True)
class Adapter:
    """How one op maps onto a Liger-Kernel function."""

    function: str  # the class in liger_kernel.ops
    inputs: Callable[[tuple], list]  # hal's canonical arguments -> the peer's own arguments
    call: Callable[[Any, list], torch.Tensor]  # (Liger's function, its arguments) -> the op's result
    grads: dict[str, int]  # hal parameter name -> index of the peer argument standing for it
    overwrites: tuple[int, ...] = ()  # arguments that a run with gradients writes into
    overwrites_grad: bool = False  # its backward writes into the grad_out it is given
    grad_layout: Callable[[torch.Tensor], torch.Tensor] = _same  # hal's grad_out in the peer's layout
    fused_grad: bool = False  # the gradient is computed in the forward pass (no backward of its own)
    supports: Callable[[tuple], Optional[str]] = lambda canon: None


def _copy(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.detach().clone()


def _last_dim_norm(canon: tuple, names: Sequence[str]) -> Optional[str]:
    shape = canon[1]
    if len(shape) != 1:
        return f"Liger-Kernel normalises the last dimension only (normalized_shape {tuple(shape)})"
    missing = [n for n, t in zip(names, canon[2 : 2 + len(names)]) if t is None]
    return f"Liger-Kernel's function needs {' and '.join(missing)}" if missing else None


def _natural_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) values stored as (B, T, H, D): the layout of q after Llama's projection, the
    one Liger's RoPE reads without a copy."""
    return x.detach().transpose(1, 2).contiguous()


def _rope_inputs(canon: tuple) -> list:
    x, cos, sin = canon[0], canon[1], canon[2]
    q = _natural_heads(x)
    k = torch.randn_like(q[:, :, :1])  # Liger rotates q and k together: k gets one head (1/H more bytes)
    full = lambda t: torch.cat((t, t), -1).reshape(1, t.shape[-2], 2 * t.shape[-1]).contiguous()  # noqa: E731
    return [q, k, full(cos), full(sin)]


def _rope_supports(canon: tuple) -> Optional[str]:
    x, cos, interleaved = canon[0], canon[1], canon[3]
    if interleaved:
        return "Liger-Kernel's RoPE is the non-interleaved (Llama) form only"
    if x.dim() != 4 or cos.dim() != 2:
        return "Liger-Kernel's RoPE takes q (B, H, T, D) with one (T, D) table"
    return None


def _grad_heads(g: torch.Tensor) -> torch.Tensor:
    return _natural_heads(g).transpose(1, 2)


ADAPTERS: dict[str, Adapter] = {
    "rms_norm": Adapter(
        "LigerRMSNormFunction",
        inputs=lambda c: [_copy(c[0]), _copy(c[2]), c[3]],
        # offset 0, Llama's casting, dX in a new tensor (in_place=False: the same bytes as
        # overwriting dY, and grad_out stays what it was for the next timed run)
        call=lambda f, a: f.apply(a[0], a[1], a[2], 0.0, "llama", False),
        grads={"x": 0, "weight": 1},
        supports=lambda c: _last_dim_norm(c, ("weight",)),
    ),
    "layer_norm": Adapter(
        "LigerLayerNormFunction",
        inputs=lambda c: [_copy(c[0]), _copy(c[2]), _copy(c[3]), c[4]],
        call=lambda f, a: f.apply(a[0], a[1], a[2], a[3]),
        grads={"x": 0, "weight": 1, "bias": 2},
        supports=lambda c: _last_dim_norm(c, ("weight", "bias")),
    ),
    "softmax": Adapter(
        "LigerSoftmaxFunction",
        inputs=lambda c: [_copy(c[0])],
        call=lambda f, a: f.apply(a[0]),
        grads={"x": 0},
        supports=lambda c: None if c[1] == c[0].dim() - 1 else "Liger-Kernel's softmax is over the last dimension only",
    ),
    "swiglu": Adapter(
        "LigerSiLUMulFunction",
        inputs=lambda c: [_copy(c[0]), _copy(c[1])],
        call=lambda f, a: f.apply(a[0], a[1]),
        grads={"gate": 0, "up": 1},
        overwrites=(0, 1),  # its backward stores the gradients into the saved gate and up
        supports=lambda c: None if c[0].shape == c[1].shape else "Liger-Kernel's SiLU-mul takes gate and up of one shape",
    ),
    "rotary_embedding": Adapter(
        "LigerRopeFunction",
        inputs=_rope_inputs,
        call=lambda f, a: f.apply(a[0].transpose(1, 2), a[1].transpose(1, 2), a[2], a[3])[0],
        grads={"x": 0},
        grad_layout=_grad_heads,
        overwrites_grad=True,
        supports=_rope_supports,
    ),
    "cross_entropy": Adapter(
        "LigerCrossEntropyFunction",
        inputs=lambda c: [_copy(c[0]), c[1], c[2], c[3], c[4]],
        # (logits, target, class weight, ignore_index, lse_square_scale, label_smoothing, reduction)
        call=lambda f, a: f.apply(a[0], a[1], None, a[2], 0.0, a[3], a[4])[0],
        grads={"logits": 0},
        overwrites=(0,),  # with gradients, its forward stores the gradient into the logits
        fused_grad=True,
    ),
    "linear_cross_entropy": Adapter(
        "LigerFusedLinearCrossEntropyFunction",
        inputs=lambda c: [_copy(c[0]), _copy(c[1]), c[2], _copy(c[3]), c[4], c[5], c[6]],
        # (x, weight, target, bias, class weight, ignore_index, lse_square_scale, label_smoothing, reduction)
        call=lambda f, a: f.apply(a[0], a[1], a[2], a[3], None, a[4], 0.0, a[5], a[6])[0],
        grads={"x": 0, "weight": 1, "bias": 3},
        fused_grad=True,
        # reduction='none' makes Liger defer the gradient to its backward: not the fused path timed here
        supports=lambda c: "reduction='none' is not set up as a Liger-Kernel peer" if c[6] == "none" else None,
    ),
}


def _device(canon: tuple) -> torch.device:
    return next(a.device for a in canon if isinstance(a, torch.Tensor))


def peer(op: str, mode: str, canon: tuple, wrt: Sequence[str] = (), grad_out: Optional[torch.Tensor] = None) -> Peer:
    """The Liger-Kernel peer of ``op`` timed as ``mode`` ("forward", "backward" or "train") on
    hal's canonical arguments ``canon`` (with ``wrt`` the inputs that get gradients and, for
    "backward", the ``grad_out`` the other columns use), or the reason it cannot run."""
    adapter = ADAPTERS.get(op)
    if adapter is None:
        return Peer(reason=f"Liger-Kernel has no kernel for {op}")
    reason = import_reason()
    if reason is None and _device(canon).type != "cuda":
        reason = f"Liger-Kernel's Triton kernels need a GPU (this run is on {_device(canon).type})"
    if reason is None:
        reason = adapter.supports(canon)
    if reason is None and mode == "backward" and adapter.fused_grad:
        reason = f"{adapter.function} computes the gradient in its forward pass: timed in the train fwd+bwd row"
    missing = [n for n in wrt if n not in adapter.grads]
    if reason is None and missing:
        reason = f"{adapter.function} gives no gradient for {', '.join(missing)}"
    if reason is not None:
        return Peer(reason=reason)
    fn = getattr(_library(), adapter.function)
    detail = f"{fn.__module__}.{adapter.function} (Liger-Kernel {version()})"
    args = adapter.inputs(canon)
    if mode == "forward":
        return Peer(run=lambda: adapter.call(fn, args), detail=detail)
    leaves = []
    for name in wrt:
        i = adapter.grads[name]
        args[i] = args[i].requires_grad_(True)
        leaves.append(args[i])
    if mode == "backward":
        assert grad_out is not None, "a backward peer needs the grad_out of the other columns"
        with torch.enable_grad():
            out = adapter.call(fn, args)
        grad = adapter.grad_layout(grad_out)
        if grad is grad_out:
            grad = grad_out.clone()  # the peer's own: Liger may write into it, the other columns must not see that
        restore = _restorer(args + [grad], adapter.overwrites + ((len(args),) if adapter.overwrites_grad else ()))
        return Peer(run=lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True), restore=restore, detail=detail)
    if mode != "train":
        raise ValueError(f"unknown mode {mode!r}: forward, backward or train")
    restore = _restorer(args, adapter.overwrites)

    def step() -> Any:  # a loss: its result is a scalar
        with torch.enable_grad():
            return torch.autograd.grad(adapter.call(fn, args), leaves)

    return Peer(run=step, restore=restore, detail=detail)


def _restorer(args: list, overwrites: tuple[int, ...]) -> Optional[Callable[[], None]]:
    """Copies the pristine values back into the arguments a run overwrites. Through ``.data``: the
    copy must not count as an in-place change of a tensor saved for backward (Liger's own writes
    do not either)."""
    if not overwrites:
        return None
    pristine = [(args[i], args[i].detach().clone()) for i in overwrites]

    def restore() -> None:
        for t, p in pristine:
            t.data.copy_(p)

    return restore
