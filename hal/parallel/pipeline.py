"""Pipeline parallelism: a hal model cut into stages and run by ``torch.distributed.pipelining`` schedules.

:func:`split_model` cuts an ``nn.Sequential`` (by children) or a Llama-style decoder (embedding, a
list of blocks, final norm and LM head) into contiguous stages; :class:`PipelineParallel` keeps this
rank's stages, wraps each in a ``PipelineStage`` with static shapes (found by running an example
microbatch through the whole model on this rank, so no shape metadata travels) and steps them with
``ScheduleGPipe``, ``Schedule1F1B`` or ``ScheduleInterleaved1F1B``. The stages compute with hal's ops
(the blocks' own, plus ``hal.ops.rms_norm`` for a parameter norm and ``hal.ops.linear_cross_entropy``
for the LM head and loss of a Llama-style last stage).

Transfers. ``torch.distributed.pipelining`` issues its activation and gradient transfers itself
(``dist.isend``/``dist.irecv`` through its private ``schedules._batch_p2p`` and waits through
``schedules._wait_batch_p2p``). During :meth:`PipelineParallel.step` hal swaps those two functions
for its own, so every transfer of the schedule goes through ``hal.dist.send`` / ``hal.dist.recv``
(``hal.explain``, the ``hal.dist.set_timeout`` bound, :class:`hal.dist.CommError`). What stays
torch's own: the one-time warm-up of the first step (torch 2.13's ``PipelineStage`` exchanges a
static/dynamic vote with blocking ``dist.send``/``dist.recv``; torch 2.11 sends one small tensor to
each neighbour, through the swapped functions). On NCCL the schedule keeps its own transfers (it
must post a stage's sends and receives as one coalesced batch, which hal.dist has no call for; one
by one they can deadlock), as does a torch release without those private functions
(:attr:`PipelineParallel.p2p_through_hal` says which); any engine failure during a step still
surfaces as :class:`hal.dist.CommError`.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

import hal
import hal.dist as hd
from hal.errors import HalError, InvalidArgumentError
from hal.parallel.expert import GroupLike, resolve_group

try:  # present in torch 2.11 and 2.13
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
    from torch.distributed.pipelining import schedules as _schedules
except ImportError as _exc:  # pragma: no cover - a torch without pipelining
    PipelineStage = Schedule1F1B = ScheduleGPipe = ScheduleInterleaved1F1B = None  # type: ignore[assignment,misc]
    _schedules = None
    _IMPORT_ERROR: Optional[BaseException] = _exc
else:
    _IMPORT_ERROR = None

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B"}
_MULTI_STAGE = {"interleaved_1f1b"}


# --- cutting a model ------------------------------------------------------------------------------


def _cuts(count: int, num_stages: int, boundaries: Optional[Sequence[int]], what: str) -> list[range]:
    """Contiguous ranges of ``count`` items for ``num_stages`` stages (near-equal unless ``boundaries``)."""
    if not isinstance(num_stages, int) or num_stages < 1:
        raise InvalidArgumentError(what, "num_stages", "a positive int", repr(num_stages))
    if boundaries is None:
        if num_stages > count:
            raise InvalidArgumentError(what, "num_stages", f"at most the model's {count} layers", repr(num_stages))
        q, r = divmod(count, num_stages)
        sizes = [q + (1 if s < r else 0) for s in range(num_stages)]
        bounds = [sum(sizes[:s]) for s in range(1, num_stages)]
    else:
        bounds = list(boundaries)
        ok = len(bounds) == num_stages - 1 and all(isinstance(b, int) for b in bounds)
        if not ok or bounds != sorted(bounds) or (bounds and not (0 < bounds[0] and bounds[-1] < count)) or len(set(bounds)) != len(bounds):
            raise InvalidArgumentError(
                what, "boundaries", f"{num_stages - 1} increasing layer indices in (0, {count}) where a new stage starts", repr(boundaries)
            )
    edges = [0, *bounds, count]
    return [range(edges[s], edges[s + 1]) for s in range(num_stages)]


def split_sequential(model: nn.Sequential, num_stages: int, boundaries: Optional[Sequence[int]] = None) -> list[nn.Module]:
    """``model``'s children in ``num_stages`` contiguous ``nn.Sequential`` pieces (sharing the modules)."""
    children = list(model.children())
    return [nn.Sequential(*children[r.start:r.stop]) for r in _cuts(len(children), num_stages, boundaries, "split_sequential")]


def _first_attr(model: nn.Module, names: Sequence[str]) -> Any:
    for name in names:
        value = getattr(model, name, None)
        if value is not None:
            return value
    return None


class LlamaStage(nn.Module):
    """A contiguous piece of a Llama-style decoder: the embedding on the first stage, blocks
    ``layers``, the final norm on the last stage (``forward`` returns the normalised hidden state
    there), and :meth:`loss`, the LM head with its cross-entropy in one ``hal.ops.linear_cross_entropy``
    (or the head's own loss for a :class:`hal.parallel.VocabParallelLMHead`).

    The decoder needs an embedding (``embed``, ``embed_tokens`` or ``tok_embeddings``), a block list
    (``blocks`` or ``layers``), a final norm (``norm``: a module, or a weight applied with
    ``hal.ops.rms_norm`` and the model's ``eps``) and an LM head (``lm_head`` or ``output``). Blocks
    are called ``block(x, cos, sin)`` when the model has rotary ``cos``/``sin`` buffers (hal's
    benchmark decoder), else ``block(x)``. Modules and parameters are shared with the model.
    """

    def __init__(self, model: nn.Module, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        blocks = _first_attr(model, ("blocks", "layers"))
        self.embed = _first_attr(model, ("embed", "embed_tokens", "tok_embeddings")) if first else None
        self.blocks = nn.ModuleList([blocks[i] for i in layers])
        self.layer_ids = list(layers)
        self.first, self.last = first, last
        self.norm = model.norm if last else None
        self.head = _first_attr(model, ("lm_head", "output")) if last else None
        self.eps = getattr(model, "eps", None)
        cos, sin = getattr(model, "cos", None), getattr(model, "sin", None)
        self.rope = isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)
        if self.rope:
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        t = x.shape[1]
        for blk in self.blocks:
            x = blk(x, self.cos[:t], self.sin[:t]) if self.rope else blk(x)
        if self.last:
            x = self.norm(x) if isinstance(self.norm, nn.Module) else hal.ops.rms_norm(x, (x.shape[-1],), self.norm, self.eps)
        return x

    def loss(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of the LM head on ``hidden`` (this is the last stage)."""
        if self.head is None:
            raise InvalidArgumentError("LlamaStage.loss", "self", "the last stage (the one holding the LM head)", f"stage of layers {self.layer_ids}")
        h = hidden.reshape(-1, hidden.shape[-1])
        if _is_vocab_parallel(self.head):  # its rows split over tensor-parallel ranks: its own loss
            return self.head(h, target.reshape(-1))
        return hal.ops.linear_cross_entropy(h, self.head.weight, target.reshape(-1), getattr(self.head, "bias", None))


def _is_vocab_parallel(head: Any) -> bool:
    try:
        from hal.parallel.vocab import VocabParallelLMHead
    except ImportError:  # pragma: no cover - built without vocabulary parallelism
        return False
    return isinstance(head, VocabParallelLMHead)


def split_llama(model: nn.Module, num_stages: int, boundaries: Optional[Sequence[int]] = None) -> list[LlamaStage]:
    """A Llama-style decoder in ``num_stages`` :class:`LlamaStage` pieces, the blocks split contiguously."""
    blocks = _first_attr(model, ("blocks", "layers"))
    missing = [n for n, v in (("embedding", _first_attr(model, ("embed", "embed_tokens", "tok_embeddings"))), ("blocks", blocks),
                              ("norm", getattr(model, "norm", None)), ("lm_head", _first_attr(model, ("lm_head", "output")))) if v is None]
    if missing:
        raise InvalidArgumentError("split_llama", "model", "a Llama-style decoder (embed, blocks, norm, lm_head)", f"{type(model).__name__} without {', '.join(missing)}")
    cuts = _cuts(len(blocks), num_stages, boundaries, "split_llama")
    return [LlamaStage(model, r, s == 0, s == num_stages - 1) for s, r in enumerate(cuts)]


def split_model(model: nn.Module, num_stages: int, boundaries: Optional[Sequence[int]] = None) -> list[nn.Module]:
    """:func:`split_sequential` for an ``nn.Sequential``, :func:`split_llama` for a Llama-style decoder."""
    if isinstance(model, nn.Sequential):
        return split_sequential(model, num_stages, boundaries)
    return list(split_llama(model, num_stages, boundaries))


# --- the schedule's transfers through hal.dist ------------------------------------------------------

_swap_lock = threading.RLock()
_swap_depth = 0
_saved_p2p: tuple[Any, Any] = (None, None)  # pipelining's own functions while hal's are swapped in


def _hal_batch_p2p(p2p_ops: list[Any], desc: Optional[str] = None) -> list[Any]:
    """Each P2POp of the schedule as an asynchronous hal.dist send or recv (tag 0, as the stages use)."""
    works = []
    for op in p2p_ops:
        if getattr(op, "tag", 0) != 0 or op.op not in (dist.isend, dist.irecv):  # not one of the stages' own
            works.append(op.op(op.tensor, op.peer, op.group, op.tag))
        elif op.op is dist.isend:
            works.append(hd.send(op.tensor, op.peer, group=op.group, async_op=True))
        else:
            works.append(hd.recv(op.tensor, op.peer, group=op.group, async_op=True))
    return works


def _hal_wait(works: list[Any]) -> None:
    for w in works:
        w.wait()


def p2p_swappable() -> bool:
    """Whether this torch's pipelining has the private transfer functions hal swaps for its own."""
    return _schedules is not None and callable(getattr(_schedules, "_batch_p2p", None)) and callable(getattr(_schedules, "_wait_batch_p2p", None))


@contextlib.contextmanager
def _p2p_through_hal() -> Iterator[bool]:
    """Route the schedule's transfers through hal.dist for the duration (True when it could)."""
    global _swap_depth, _saved_p2p
    if not p2p_swappable():
        yield False
        return
    with _swap_lock:
        if _swap_depth == 0:
            _saved_p2p = (_schedules._batch_p2p, _schedules._wait_batch_p2p)
            _schedules._batch_p2p, _schedules._wait_batch_p2p = _hal_batch_p2p, _hal_wait
        _swap_depth += 1
    try:
        yield True
    finally:
        with _swap_lock:
            _swap_depth -= 1
            if _swap_depth == 0:
                _schedules._batch_p2p, _schedules._wait_batch_p2p = _saved_p2p


# --- running the stages ----------------------------------------------------------------------------


_DIST_ERRORS = tuple(c for c in (getattr(dist, "DistError", None),) if c is not None)


def _is_transfer_failure(exc: BaseException) -> bool:
    """An engine's failure (a peer gone, a timeout) rather than a bug in a stage's computation."""
    text = str(exc).lower()
    return isinstance(exc, _DIST_ERRORS) or any(w in text for w in ("gloo", "nccl", "connection", "timed out", "timeout", "peer"))


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return value if isinstance(value, tuple) else (value,)


def _meta(values: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
    """Meta tensors of the values; floating ones marked as needing gradients (torch 2.13's stages
    receive output gradients only for outputs whose metadata says so)."""
    return tuple(v.detach().to("meta").requires_grad_(v.is_floating_point() or v.is_complex()) for v in values)


class PipelineParallel:
    """This rank's stages of ``model`` under a ``torch.distributed.pipelining`` schedule.

    ``group``: the pipeline ranks (a ProcessGroup, a 1-D DeviceMesh, or None for the default group);
    the model is cut into ``group size x stages_per_rank`` stages and stage ``s`` runs on group rank
    ``s % size`` (the looped placement the interleaved schedule expects). ``schedule``: ``gpipe``,
    ``1f1b`` or ``interleaved_1f1b`` (``stages_per_rank`` 2 by default there, 1 otherwise).
    ``microbatch``: an example microbatch of the inputs (a tensor or a tuple); each step's batch must
    split into ``n_microbatches`` of that shape along dim 0. Every stage's shapes come from running
    it through the whole model on this rank (stages with collectives inside then run them on every
    rank, in the same order), or, with ``activation`` (an example of what passes between stages,
    e.g. a Llama-style microbatch's hidden state; a meta tensor will do), from that alone: every
    stage then outputs a tensor like it.
    ``loss_fn(output, target)``: the loss of one microbatch on the last stage (default for a
    Llama-style model: :meth:`LlamaStage.loss`); gradients are those of the mean over microbatches.
    Every rank must hold the whole ``model`` when this is built (it is cut here); afterwards only
    :attr:`modules` (this rank's stages) are used: build the optimizer on :meth:`parameters`.
    """

    def __init__(
        self,
        model: nn.Module,
        group: GroupLike = None,
        *,
        microbatch: Any,
        n_microbatches: int,
        schedule: str = "1f1b",
        loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
        stages_per_rank: Optional[int] = None,
        boundaries: Optional[Sequence[int]] = None,
        activation: Optional[torch.Tensor] = None,
    ) -> None:
        what = "PipelineParallel"
        if _IMPORT_ERROR is not None:
            raise hal.BackendUnavailableError(f"torch.distributed.pipelining cannot be imported: {_IMPORT_ERROR}")
        name = schedule.lower().replace("-", "_") if isinstance(schedule, str) else schedule
        name = "interleaved_1f1b" if name == "interleaved" else name
        if name not in SCHEDULES:
            raise InvalidArgumentError(what, "schedule", f"one of {', '.join(SCHEDULES)}", repr(schedule))
        if not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise InvalidArgumentError(what, "n_microbatches", "a positive int", repr(n_microbatches))
        per_rank = stages_per_rank if stages_per_rank is not None else (2 if name in _MULTI_STAGE else 1)
        if not isinstance(per_rank, int) or per_rank < 1 or (per_rank > 1 and name not in _MULTI_STAGE):
            raise InvalidArgumentError(what, "stages_per_rank", f"1 for {name} (several stages per rank need interleaved_1f1b)", repr(stages_per_rank))
        self.group = resolve_group(group, what)
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.schedule_name, self.n_microbatches = name, n_microbatches
        num_stages = self.size * per_rank
        if name == "1f1b" and n_microbatches < num_stages:
            raise InvalidArgumentError(what, "n_microbatches", f"at least the {num_stages} stages for 1f1b (or use gpipe)", repr(n_microbatches))
        pieces = split_model(model, num_stages, boundaries)
        self.stage_ids = list(range(self.rank, num_stages, self.size))
        self.modules = [pieces[s] for s in self.stage_ids]
        self.has_first, self.has_last = 0 in self.stage_ids, num_stages - 1 in self.stage_ids
        if loss_fn is None and isinstance(pieces[-1], LlamaStage):
            loss_fn = pieces[-1].loss
        if loss_fn is None:
            raise InvalidArgumentError(what, "loss_fn", "a function (output, target) -> loss for an nn.Sequential", "None")
        self.loss_fn = loss_fn
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        if activation is None:
            shapes = self._shapes(pieces, _as_tuple(microbatch))
        else:  # every boundary carries a tensor like `activation`; nothing runs here
            act = _meta((activation,))
            shapes = [(_meta(_as_tuple(microbatch)) if s == 0 else act, act) for s in range(num_stages)]
        self.stages = [
            PipelineStage(pieces[s], s, num_stages, device, input_args=shapes[s][0], output_args=shapes[s][1], group=self.group)
            for s in self.stage_ids
        ]
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}[name]
        target = self.stages if name in _MULTI_STAGE else self.stages[0]
        self.schedule = cls(target, n_microbatches, loss_fn=self.loss_fn)
        self._step_kwargs = {"return_outputs": False} if "return_outputs" in inspect.signature(self.schedule.step).parameters else {}
        # NCCL needs a batch of sends and receives between two ranks issued as one group (torch's
        # batch_isend_irecv coalesces them; one by one they can deadlock): hal routes gloo's only
        self.p2p_through_hal = p2p_swappable() and dist.get_backend(self.group) == "gloo"

    @staticmethod
    def _shapes(pieces: list[nn.Module], microbatch: tuple[Any, ...]) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
        """Each stage's (inputs, outputs) as meta tensors, from the example microbatch run on this rank."""
        out = []
        values = microbatch
        with torch.no_grad():
            for piece in pieces:
                result = _as_tuple(piece(*values))
                out.append((_meta(values), _meta(result)))
                values = result
        return out

    def parameters(self) -> list[nn.Parameter]:
        """The parameters of this rank's stages (each once)."""
        seen: dict[int, nn.Parameter] = {}
        for m in self.modules:
            for p in m.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def step(self, *inputs: Any, target: Any = None) -> Optional[torch.Tensor]:
        """Forward and backward of one batch through the pipeline (gradients accumulate in
        :meth:`parameters`). Every rank calls it with the same arguments; the inputs are used where
        the first stage lives, the target where the last does. Returns the mean loss over the
        microbatches on the rank of the last stage, None elsewhere."""
        losses: Optional[list[torch.Tensor]] = [] if self.has_last else None
        args = inputs if self.has_first else ()
        tgt = target if self.has_last else None
        if self.has_last and target is None:
            raise InvalidArgumentError("PipelineParallel.step", "target", "the batch's targets (this rank holds the last stage)", "None")
        with _p2p_through_hal() if self.p2p_through_hal else contextlib.nullcontext():
            try:
                self.schedule.step(*args, target=tgt, losses=losses, **self._step_kwargs)
            except HalError:
                raise
            except RuntimeError as exc:
                if not _is_transfer_failure(exc):
                    raise
                # a transfer torch issued itself (the warm-up) failed
                text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise hd.CommError(
                    f"pipeline step ({self.schedule_name}, stages {self.stage_ids} of {self.size} ranks) failed at group rank "
                    f"{self.rank}: {text}. A peer rank died, stalled, or the ranks disagree on the schedule; destroy the "
                    "process group and restart the job."
                ) from exc
        if losses is None:
            return None
        return torch.stack([l.detach() for l in losses]).mean()


__all__ = ["PipelineParallel", "LlamaStage", "split_model", "split_sequential", "split_llama", "p2p_swappable", "SCHEDULES"]
