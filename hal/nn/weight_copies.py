"""Half-precision copies of a model's ``nn.Linear`` weights, written once per optimizer step.

Under ``torch.autocast`` every ``nn.Linear`` casts its float32 weight to the autocast dtype in the
forward (read 4 bytes, write 2 per element), ``torch.compile`` casts it again in the backward
rather than keep the cast, and the weight's gradient leaves the GEMM in the autocast dtype to be
cast to float32 (write 2, read 2, write 4). At Llama-3.2-1B's shape these casts took 4.9 ms of a
79 ms compiled step on an H100 (``benchmarks/results``): they move about 16 bytes per weight each
step. Here the copy is made where the weight changes instead, after the optimizer step (read 4,
write 2) or, with ``hal.optim.AdamW``, in the update's own kernel (write 2 more:
:meth:`WeightCopies.hand_to`), the forward and backward read it, and the weight-gradient GEMM writes
float32 itself (``torch.mm(..., out_dtype=torch.float32)`` on CUDA: cuBLAS accumulates in float32
either way).

The numbers are autocast's: the copy is the float32 weight rounded as autocast's cast rounds it;
the input is cast as autocast casts it; the gradient of the input is the same GEMM; the weight's
gradient is the float32 accumulator before it would have been rounded (at least as exact as
autocast's, equal where the GEMM's float32 result is already a half-precision number).

Who may use a copy is narrow, so that a copy is never stale where it is read: :class:`WeightCopies`
swaps the class of eligible ``nn.Linear`` modules to :class:`CopyLinear`, which reads its copy only
inside :meth:`WeightCopies.active` (``hal.optimize``'s step, which refreshes every copy whose weight
changed outside the step before it runs, by the weight's version counter) and under autocast to the
copy's dtype; anywhere else it is ``nn.Linear``. Eligible: exactly ``nn.Linear``, a float32 weight
that requires grad, owned by no other module (a weight tied to an embedding is left: the embedding
reads it in float32).

A module of hal's that computes with its weight itself (``hal.nn.patch``'s LM head, whose fused loss
reads the weight; ``hal.fp8.Linear``, which quantises it) declares ``reads_weight_copy = True`` on
its class and reads the weight through :func:`weight_in` (or :func:`copy_for`): it gets a copy too,
also where its weight is tied to an embedding (only this module reads the copy; the embedding reads
the float32 weight, whose gradient sums both). At Llama-3.2-1B's shape the tied LM head's cast is a
1 GiB read per step (0.51 ms on an H100).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from hal.nn.modules import _cast

#: whether :class:`CopyLinear` reads its copy (set by :meth:`WeightCopies.active`; torch.compile
#: guards on it, so a graph compiled inside the step and one compiled outside stay apart)
_ACTIVE = False


def _gemm_float32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of half-precision matrices, in float32: cuBLAS writes its float32 accumulator on
    CUDA; elsewhere (torch has no such CPU kernel) the half-precision product is widened, which is
    what autocast's weight gradient is."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a, b).float()


class _LinearOnCopy(torch.autograd.Function):
    """``F.linear`` under autocast with the weight's half-precision copy (module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], copy: torch.Tensor) -> torch.Tensor:
        x_half = x.to(copy.dtype)
        ctx.save_for_backward(x_half, copy)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return F.linear(x_half, copy, None if bias is None else bias.to(copy.dtype))

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        x_half, copy = ctx.saved_tensors
        grad_out = grad_out.to(copy.dtype)
        grad_x = grad_out @ copy if ctx.needs_input_grad[0] else None
        rows = grad_out.reshape(-1, grad_out.shape[-1])
        grad_w = _gemm_float32(rows.t(), x_half.reshape(-1, x_half.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_b = rows.sum(0, dtype=torch.float32).to(ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


class CopyLinear(nn.Linear):
    """``nn.Linear`` that, inside :meth:`WeightCopies.active` and under autocast to its copy's
    dtype, computes with the half-precision copy of its weight (``weight_copy``); ``nn.Linear``
    everywhere else. Its state_dict, parameters and hooks are ``nn.Linear``'s."""

    weight_copy: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        copy = getattr(self, "weight_copy", None)
        if _ACTIVE and copy is not None and torch.is_autocast_enabled(x.device.type) \
                and torch.get_autocast_dtype(x.device.type) == copy.dtype:
            return _LinearOnCopy.apply(x, self.weight, self.bias, copy)
        return F.linear(x, self.weight, self.bias)


#: the module classes hal.nn's matchers take for a plain linear (a CopyLinear is one)
PLAIN_LINEARS = (nn.Linear, CopyLinear)


class _ReadCopy(torch.autograd.Function):
    """The half-precision copy standing for its float32 weight: the gradient reaches the weight in
    float32, as the gradient of autocast's cast does."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None]:
        return grad.to(torch.float32), None


def copy_for(module: nn.Module, dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
    """``module``'s copy of its weight where it may read it now: inside :meth:`WeightCopies.active`,
    a copy of ``dtype`` (a module whose class sets ``reads_weight_copy``); else None. For a module
    whose own autograd function takes the copy beside the float32 weight (the copy's values, the
    weight's gradient), as ``hal.fp8.Linear`` does."""
    copy = module.__dict__.get("weight_copy")
    return copy if _ACTIVE and copy is not None and copy.dtype == dtype else None


def weight_in(module: nn.Module, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """``module.weight`` as autocast would cast it to ``dtype`` (None: as it is): its copy inside
    :meth:`WeightCopies.active` where it has one of that dtype (a module whose class sets
    ``reads_weight_copy``), else the weight cast."""
    copy = copy_for(module, dtype)
    return _cast(module.weight, dtype) if copy is None else _ReadCopy.apply(module.weight, copy)


@dataclasses.dataclass
class _Entry:
    param: nn.Parameter
    copy: torch.Tensor
    version: int  # the weight's version when its copy was last written
    by_optimizer: bool = False  # the copy is written by the optimizer's step (WeightCopies.hand_to)
    reader: str = "nn.Linear"  # the kind of module that reads it


def _eligible(model: nn.Module) -> list[nn.Module]:
    """``model``'s ``nn.Linear`` modules whose float32 weight no other module holds, and its modules
    that read their weight through :func:`weight_in` (``reads_weight_copy``) with a float32 weight."""
    owners: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1

    def weight_ok(m: nn.Module) -> bool:
        weight = getattr(m, "weight", None)
        return isinstance(weight, nn.Parameter) and weight.dtype == torch.float32 and weight.requires_grad

    return [m for m in model.modules()
            if (type(m) in PLAIN_LINEARS and weight_ok(m) and owners[id(m.weight)] == 1)
            or (getattr(type(m), "reads_weight_copy", False) and weight_ok(m))]


def _copy(entries: list[_Entry]) -> None:
    """Each entry's copy written from its weight (one multi-tensor copy), its version noted."""
    if entries:
        with torch.no_grad():
            torch._foreach_copy_([e.copy for e in entries], [e.param.detach() for e in entries])
        for e in entries:
            e.version = e.param._version


class WeightCopies:
    """The half-precision copies of a model's eligible ``nn.Linear`` weights (module docstring)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"weight copies are bfloat16 or float16, not {dtype}")
        self.dtype = dtype
        self._entries: list[_Entry] = []
        self._writer: Optional[torch.optim.Optimizer] = None  # the optimizer that writes copies in its step
        self.attach(model)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(e.copy.numel() * e.copy.element_size() for e in self._entries)

    @property
    def readers(self) -> dict[str, int]:
        """How many copies each kind of module reads ("nn.Linear": 112, "_HalHead": 1)."""
        counts: dict[str, int] = {}
        for e in self._entries:
            counts[e.reader] = counts.get(e.reader, 0) + 1
        return counts

    @property
    def by_optimizer(self) -> int:
        """How many copies the optimizer writes in its step (:meth:`hand_to`)."""
        return sum(e.by_optimizer for e in self._entries)

    def attach(self, model: nn.Module) -> None:
        """Give ``model``'s eligible linears their copies (made now, or the ones their weights
        already have here: the same weights in another module tree share them); the modules'
        class becomes :class:`CopyLinear`."""
        by_param = {id(e.param): e for e in self._entries}
        known = len(self._entries)
        for m in _eligible(model):
            entry = by_param.get(id(m.weight))
            if entry is None:
                with torch.no_grad():
                    entry = _Entry(m.weight, m.weight.detach().to(self.dtype), m.weight._version,
                                   reader="nn.Linear" if type(m) in PLAIN_LINEARS else type(m).__name__)
                self._entries.append(entry)
                by_param[id(m.weight)] = entry
            if type(m) in PLAIN_LINEARS:
                m.__class__ = CopyLinear
            m.__dict__["weight_copy"] = entry.copy
        if self._writer is not None and len(self._entries) > known:
            self._hand()

    def detach(self, model: nn.Module) -> None:
        """Undo :meth:`attach` on ``model``: its copy-reading linears become ``nn.Linear`` again,
        and these copies are let go."""
        for m in model.modules():
            if type(m) is CopyLinear:
                m.__class__ = nn.Linear
            m.__dict__.pop("weight_copy", None)
        self._entries.clear()
        self._withdraw()

    def hand_to(self, optimizer: torch.optim.Optimizer) -> int:
        """Let ``optimizer`` write the copies in its step where it can: one with a ``write_copies``
        method (``hal.optim.AdamW``) writes the copy of each weight it steps in the update's own
        kernel, and :meth:`write` then writes only the others. Takes them back from an optimizer
        they were handed to before. Returns how many copies ``optimizer`` writes (0 for one without
        that method, such as torch's: :meth:`write` writes them all)."""
        if optimizer is not self._writer:
            self._withdraw()
        self._writer = optimizer if callable(getattr(optimizer, "write_copies", None)) else None
        self._hand()
        return self.by_optimizer

    def _hand(self) -> None:
        """Every (weight, copy) pair to the writer, if any; the entries it takes are marked."""
        taken = set(map(id, self._writer.write_copies([(e.param, e.copy) for e in self._entries]))) if self._writer else set()
        for e in self._entries:
            e.by_optimizer = id(e.param) in taken

    def _withdraw(self) -> None:
        """Take the copies back from the writer, if any: :meth:`write` writes them all again."""
        if self._writer is not None:
            self._writer.write_copies(())
            self._writer = None
        for e in self._entries:
            e.by_optimizer = False

    def refresh(self) -> int:
        """Re-make the copies whose weights changed since they were written (loaded weights, an
        update by another optimizer, a snapshot put back); returns how many."""
        stale = [e for e in self._entries if e.param._version != e.version]
        _copy(stale)
        return len(stale)

    def write(self) -> None:
        """After the optimizer step: write the copies it does not (one multi-tensor copy; all of them
        unless handed over, :meth:`hand_to`), and note as fresh those it wrote in its step or left
        as they were (a skipped step, a weight without a gradient: the copy is still its weight
        rounded). The note is the weight's version now: a kernel writing through pointers may not
        move the version counter."""
        _copy([e for e in self._entries if not e.by_optimizer])
        for e in self._entries:
            if e.by_optimizer:
                e.version = e.param._version

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """While inside, :class:`CopyLinear` modules read their copies (fresh ones: refreshed on entry)."""
        global _ACTIVE
        self.refresh()
        before, _ACTIVE = _ACTIVE, True
        try:
            yield
        finally:
            _ACTIVE = before
