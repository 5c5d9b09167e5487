"""What a training step changes, saved before :func:`hal.optimize` measures candidate steps and put
back afterwards, so that measuring does not train the model.

A step changes the parameters, the buffers (batch-norm running statistics and counters), the
gradients (accumulated into, then set to None), the optimizer's state (moments and step counts;
created on the first step), the loss scaler's scale and history, and the random generators (dropout).
:class:`Snapshot` copies all of these and :meth:`Snapshot.restore` writes them back *in place*
(the same tensor objects, so that nothing holding them, such as an optimizer's cached launches, is
left pointing at stale copies); optimizer state that measuring created is deleted, so the first real
step creates it afresh, exactly as a plain loop's first step would.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable, Optional, Sequence, Union

import torch
from torch import nn

#: a device snapshot is taken only where this much more free device memory stays free (a GPU near
#: its limit gets a snapshot in host memory instead: slower to take, but it cannot run out)
_DEVICE_HEADROOM = 2.0


def _tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Snapshot:
    """Copies of the tensors and state a training step mutates (module docstring).

    ``modules``: the model (and a loss module, if any): parameters, buffers and gradients.
    ``optimizers``: one or several (the user's and hal's, over the same parameters): each one's
    ``state`` per parameter (tensors copied, other values kept) and the parameters it steps.
    ``others``: objects (a loss scaler) whose attributes are saved: tensors copied, everything else
    deep-copied."""

    def __init__(self, modules: list[nn.Module], optimizers: Union[None, torch.optim.Optimizer, Sequence[torch.optim.Optimizer]],
                 others: list[Any]) -> None:
        if optimizers is None:
            optimizers = []
        elif isinstance(optimizers, torch.optim.Optimizer):
            optimizers = [optimizers]
        tensors: dict[int, torch.Tensor] = {}
        for m in modules:
            for t in (*m.parameters(), *m.buffers()):
                tensors.setdefault(id(t), t)
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    tensors.setdefault(id(p), p)
        self._tensors = list(tensors.values())
        self.where = self._choose_place()
        self._saved = [self._copy(t.detach()) for t in self._tensors]
        self._grads = [None if getattr(t, "grad", None) is None else self._copy(t.grad) for t in self._tensors]
        self._opt_states = [(optimizer, self._copy_state(optimizer)) for optimizer in optimizers]
        self._others = [(obj, _save_attributes(obj, self._copy)) for obj in others]
        self._rng_cpu = torch.get_rng_state()
        self._rng_cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def _choose_place(self) -> str:
        """``"device"`` (copies beside the tensors) or ``"host"`` (a GPU without room for them)."""
        cuda = [t for t in self._tensors if t.is_cuda]
        if not cuda:
            return "device"
        try:
            free, _ = torch.cuda.mem_get_info(cuda[0].device)
        except Exception:  # noqa: BLE001 - no answer: play safe
            return "host"
        # parameters, their gradients and about two optimizer tensors per parameter
        need = 4 * _tensor_bytes(cuda)
        return "device" if free > _DEVICE_HEADROOM * need else "host"

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            if self.where == "host" and t.is_cuda:
                return t.detach().to("cpu", copy=True)
            return t.detach().clone()

    def _copy_state(self, optimizer: torch.optim.Optimizer) -> dict[Any, dict[str, Any]]:
        """``optimizer.state``: per parameter, each value as (the object, a copy)."""
        return {p: {k: (v, self._copy(v)) if isinstance(v, torch.Tensor) else (v, copy.deepcopy(v)) for k, v in state.items()}
                for p, state in optimizer.state.items()}

    @property
    def nbytes(self) -> int:
        """Bytes held by the copies of parameters, buffers and gradients."""
        return _tensor_bytes(self._saved) + _tensor_bytes(g for g in self._grads if g is not None)

    def restore(self) -> None:
        """Put every saved value back, in place; delete optimizer state created since the snapshot."""
        with torch.no_grad():
            for t, saved in zip(self._tensors, self._saved):
                t.copy_(saved)
            for t, grad in zip(self._tensors, self._grads):
                if not isinstance(t, nn.Parameter) and not t.requires_grad:
                    continue
                if grad is None:
                    t.grad = None
                elif t.grad is not None and t.grad.shape == grad.shape:
                    t.grad.copy_(grad)
                else:
                    t.grad = grad.to(t.device, copy=True)
        for opt, opt_state in self._opt_states:
            for p in [p for p in opt.state if p not in opt_state]:
                del opt.state[p]
            for p, saved in opt_state.items():
                state = opt.state[p]
                for k in [k for k in state if k not in saved]:
                    del state[k]
                for k, (ref, value) in saved.items():
                    if isinstance(ref, torch.Tensor):
                        with torch.no_grad():
                            ref.copy_(value)
                        state[k] = ref
                    else:
                        state[k] = copy.deepcopy(value)
        for obj, attrs in self._others:
            _restore_attributes(obj, attrs)
        torch.set_rng_state(self._rng_cpu)
        if self._rng_cuda is not None:
            torch.cuda.set_rng_state_all(self._rng_cuda)


def _save_attributes(obj: Any, copy_tensor: Any) -> dict[str, tuple[Any, Any]]:
    """``vars(obj)``: each attribute as (the object, a copy): tensors copied with ``copy_tensor``,
    other values deep-copied (kept as they are where they cannot be copied)."""
    saved: dict[str, tuple[Any, Any]] = {}
    for name, value in vars(obj).items():
        if isinstance(value, torch.Tensor):
            saved[name] = (value, copy_tensor(value))
        else:
            try:
                saved[name] = (value, copy.deepcopy(value))
            except Exception:  # noqa: BLE001 - an attribute that cannot be copied (a lock, a stream) is left alone
                saved[name] = (value, value)
    return saved


def _restore_attributes(obj: Any, saved: dict[str, tuple[Any, Any]]) -> None:
    for name in [n for n in vars(obj) if n not in saved]:
        delattr(obj, name)
    for name, (ref, value) in saved.items():
        if isinstance(ref, torch.Tensor):
            with torch.no_grad():
                ref.copy_(value)
            setattr(obj, name, ref)
        else:
            setattr(obj, name, value if value is ref else copy.deepcopy(value))
