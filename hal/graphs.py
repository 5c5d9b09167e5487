"""Whole steps as CUDA graphs: ``hal.graphs.graphed(step)`` captures a training or inference step
once and replays it, so that a step costs one launch of host time instead of one per kernel.

Why: a step issues hundreds of kernels, each costing the host microseconds in Python, torch's
dispatcher and the driver. On the H200's host every model step of ``hal bench --models`` spent two to
three times its device time on the host (2026-12-02: ResNet-50 training 37 ms of host time for 15 ms
of kernels), so faster kernels did not make faster steps. A CUDA graph replays all of a step's
kernels with one call. hal's ops never synchronise with the host and allocate through torch's
caching allocator, which is what capture needs.

    step = hal.graphs.graphed(train_step)      # train_step(x, y) -> loss
    for x, y in batches:
        loss = step(x, y)                      # eager for `warmup` calls, then captured, then replayed

How it works, per *signature* of the arguments (each tensor's shape, strides, dtype and device; every
other value itself; grad and inference mode):

1. the first ``warmup`` calls run eagerly on a side stream (lazy initialisation, cuDNN and Triton
   autotuning, hal's decisions and optimizer state happen there, outside any capture);
2. the next call copies the tensor arguments into static buffers and captures ``step`` on them
   (``torch.cuda.graph``);
3. every later call copies its tensors into those buffers and replays the graph. Tensor results are
   copied out of the graph's memory (fresh tensors, safe to keep across steps); other results are
   the values the captured call returned.

Kernels for replays: the warm-up calls and the capture run inside :func:`device_bound`, where the
dispatcher ranks kernels by their *graph priority* (``Plugin.kernel(graph_priority=)``) instead of
their priority. A replay costs no host time per kernel, so a kernel that launches more slowly but
runs faster on the device can win there (the CUDA backend's C++ batch norm: ResNet-50's graphed
training step 15.47 -> 13.66 ms on the H200, 2026-12-02). ``hal.explain`` inside
:func:`device_bound` shows those decisions; ``graphed(step, device_bound=False)`` keeps the eager
ones.

A call that cannot be captured runs eagerly instead, and :meth:`GraphedStep.explain` says why: no
CUDA tensor or CUDA device, a CPU tensor among the arguments (its values would be baked in), or the
capture itself failing (a host synchronisation such as ``loss.item()`` inside the step, a CPU-GPU
copy, an optimizer that is not capturable). Such a failure is logged at WARNING; the step's Python
code has then run once without its GPU work (its host-side state, a learning-rate scheduler's count
say, has advanced once more than its kernels).

What a captured step must be (as for any CUDA graph): the same kernels on the same addresses at
every call. Parameters and optimizer state are updated in place (``torch.optim`` optimizers with
``capturable=True``; ``hal.optim.AdamW`` always is); data enters only through the arguments. Python
code inside the step runs once, at capture: ``hal.stats()`` counts the captured call, not the
replays, and ``hal.amp.DynamicLossScaler.history`` records no replayed step. Data-dependent control
flow on the host (a loss-scaler skipping ``optimizer.step`` on overflow through Python) is frozen
at capture; hal's loss scaler and AdamW skip on overflow on the device, so they replay correctly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable, Hashable, Iterator, Optional

import torch
from torch.utils import _pytree as pytree

from hal import config

log = logging.getLogger("hal")

#: eager calls per signature before the capture (torch's documentation warms up with three; two
#: cover what hal needs: the first call decides and autotunes, the second creates lazy state)
DEFAULT_WARMUP = 2


@contextlib.contextmanager
def device_bound() -> Iterator[None]:
    """hal calls made inside (this thread) choose kernels for a step that will be replayed from a
    CUDA graph: ranked by their graph priority, where host time per launch does not count. For a
    capture of your own (``torch.cuda.graph``) run the warm-up and the capture inside it;
    :func:`graphed` does."""
    with config.scope(device_bound=True):
        yield


@dataclasses.dataclass
class _Entry:
    """One argument signature: its state, its graph and static buffers once captured."""

    warm: int = 0  # eager calls made so far
    eager_reason: Optional[str] = None  # set: this signature always runs eagerly, and why
    graph: Optional["torch.cuda.CUDAGraph"] = None
    #: static buffers and the position of the flattened argument each is filled from (one buffer per
    #: distinct argument tensor: a tensor passed twice has one buffer, as it had one storage)
    inputs: tuple[tuple[int, torch.Tensor], ...] = ()
    output: Any = None  # the captured call's result (its tensors live in the graph's memory)
    replays: int = 0


class GraphedStep:
    """``step`` captured as a CUDA graph per argument signature and replayed (module docstring).

    ``warmup``: eager calls per signature before capturing. ``copy_outputs``: return tensor results
    copied out of the graph's memory (default); with False they are the graph's own buffers, which
    the next replay overwrites (one copy kernel less per result)."""

    def __init__(self, step: Callable[..., Any], warmup: int = DEFAULT_WARMUP, copy_outputs: bool = True,
                 device_bound: bool = True) -> None:
        if warmup < 1:
            raise ValueError(f"hal.graphs.graphed: warmup must be at least 1 (the capture needs a warmed-up step), not {warmup}")
        self.step = step
        self.warmup = warmup
        self.copy_outputs = copy_outputs
        self.device_bound = device_bound
        self._entries: dict[Hashable, _Entry] = {}
        self._side: Optional[torch.cuda.Stream] = None

    # --- the call ------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        key, reason = _signature(leaves)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(eager_reason=_no_cuda_reason() or reason)
        if entry.graph is not None:
            return self._replay(entry, leaves)
        if entry.eager_reason is not None:
            return self.step(*args, **kwargs)
        if entry.warm < self.warmup:
            entry.warm += 1
            return self._warm(args, kwargs)
        return self._capture(entry, leaves, spec)

    def _warm(self, args: tuple, kwargs: dict) -> Any:
        """One eager call on a side stream (as torch's documentation prescribes before a capture)."""
        if self._side is None:
            self._side = torch.cuda.Stream()
        current = torch.cuda.current_stream()
        self._side.wait_stream(current)
        with torch.cuda.stream(self._side), self._ranking():
            out = self.step(*args, **kwargs)
        current.wait_stream(self._side)
        for t in pytree.tree_leaves(out):  # made on the side stream, used on the caller's
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(current)
        return out

    def _capture(self, entry: _Entry, leaves: list, spec: Any) -> Any:
        static = _static_copies(leaves)
        args, kwargs = pytree.tree_unflatten(static, spec)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        restore = _capture_state()
        try:
            with torch.cuda.graph(graph), self._ranking():
                output = self.step(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure inside the capture: run this signature eagerly
            restore()
            entry.eager_reason = f"the capture failed ({type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''})"
            log.warning("hal.graphs: %s runs eagerly: %s", _name(self.step), entry.eager_reason)
            args, kwargs = pytree.tree_unflatten(leaves, spec)
            return self.step(*args, **kwargs)
        if not any(isinstance(t, torch.Tensor) and t.is_cuda for t in (*static, *pytree.tree_leaves(output))):
            # nothing says the step runs on the GPU: its CPU work ran during the capture (once, for
            # real) and a replay would repeat none of it
            entry.eager_reason = "the step takes and returns no CUDA tensor (a CPU step: nothing to capture)"
            return output
        entry.graph, entry.output = graph, output
        firsts = {id(s): i for i, s in reversed(list(enumerate(static))) if isinstance(s, torch.Tensor)}
        entry.inputs = tuple((i, static[i]) for i in sorted(firsts.values()))
        return self._replay(entry, leaves)  # the capture recorded the GPU work without running it

    def _ranking(self) -> contextlib.AbstractContextManager:
        """The kernel ranking of the warm-up calls and the capture (see :func:`device_bound`)."""
        return device_bound() if self.device_bound else contextlib.nullcontext()

    def _replay(self, entry: _Entry, leaves: list) -> Any:
        with torch.no_grad():
            for i, buffer in entry.inputs:
                x = leaves[i]
                if buffer.data_ptr() != x.data_ptr():
                    buffer.copy_(x, non_blocking=True)
        entry.graph.replay()
        entry.replays += 1
        if not self.copy_outputs:
            return entry.output
        return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, entry.output)

    # --- introspection -------------------------------------------------------------------------

    def explain(self) -> str:
        """One line per argument signature seen: captured (and how often replayed), warming up, or
        eager and why."""
        if not self._entries:
            return f"hal.graphs: {_name(self.step)} has not been called yet"
        lines = [f"hal.graphs: {_name(self.step)}, {len(self._entries)} argument signature(s)"]
        for i, entry in enumerate(self._entries.values()):
            if entry.graph is not None:
                state = f"captured after {entry.warm} eager call(s), replayed {entry.replays} time(s)"
            elif entry.eager_reason is not None:
                state = f"eager: {entry.eager_reason}"
            else:
                state = f"warming up ({entry.warm} of {self.warmup} eager calls before the capture)"
            lines.append(f"  [{i}] {state}")
        return "\n".join(lines)

    def captured(self) -> int:
        """How many argument signatures have a captured graph."""
        return sum(e.graph is not None for e in self._entries.values())

    def reset(self) -> None:
        """Drop every graph and its memory (the next calls warm up and capture again)."""
        self._entries.clear()


def graphed(step: Callable[..., Any], warmup: int = DEFAULT_WARMUP, copy_outputs: bool = True, device_bound: bool = True) -> GraphedStep:
    """``step`` as a :class:`GraphedStep`: captured once per argument signature, then replayed;
    ``device_bound``: its hal calls choose kernels for replays (:func:`device_bound`)."""
    return GraphedStep(step, warmup, copy_outputs, device_bound)


# --- helpers ---------------------------------------------------------------------------------------


def _signature(leaves: list) -> tuple[Hashable, Optional[str]]:
    """The cache key of a call's flattened arguments, and a reason to stay eager (or None)."""
    parts: list[Hashable] = [torch.is_grad_enabled(), torch.is_inference_mode_enabled()]
    reason = None
    seen: dict[int, int] = {}
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            if id(x) in seen:  # the same tensor again (labels=input_ids): its own signature, one buffer
                parts.append(("same as", seen[id(x)]))
                continue
            seen[id(x)] = i
            if x.device.type != "cuda" and reason is None:
                reason = (f"a {x.device.type} tensor among the arguments (a graph would keep the values it had at "
                          "capture): move it to the GPU before the call")
            parts.append((tuple(x.shape), x.stride(), x.dtype, x.device, x.requires_grad))
        else:
            try:
                hash(x)
            except TypeError:
                # one key per type: keyed by the object, every call would add an entry that is never used again
                return ("unhashable", type(x)), f"an argument of type {type(x).__name__} that cannot be part of a signature"
            parts.append((type(x), x))
    return tuple(parts), reason


def _no_cuda_reason() -> Optional[str]:
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    if torch.cuda.is_current_stream_capturing():
        return "called inside another capture"
    return None


def _capture_state() -> Callable[[], None]:
    """What a failed capture can leave behind, saved before it, and the function that puts it back.

    When CUDA ends an invalidated capture (a synchronisation inside it), ``torch.cuda.graph`` raises
    from ``capture_end`` before it restores the caller's stream and before the device's random
    generator leaves its capture mode (every later random draw then fails with "Offset increment
    outside graph capture"). The stream and a copy of the generator's state taken here are set back."""
    stream = torch.cuda.current_stream()
    generator = torch.cuda.default_generators[stream.device.index if stream.device.index is not None else torch.cuda.current_device()]
    saved = generator.clone_state()

    def restore() -> None:
        torch.cuda.set_stream(stream)
        generator.graphsafe_set_state(saved)
        torch.cuda.synchronize()

    return restore


def _static_copies(leaves: list) -> list:
    """The flattened arguments with each tensor replaced by a static copy, one copy per distinct
    tensor: a tensor passed twice (``model(input_ids=t, labels=t)``) stays one tensor. Two copies
    would change what a torch.compile'd step sees (Dynamo guards on arguments being the same
    tensor): it compiled again inside the capture, which failed ("operation failed due to a
    previous error during capture") for every Hugging Face causal LM step given its tokens as labels."""
    copies: dict[int, torch.Tensor] = {}
    out = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            if id(x) not in copies:
                copies[id(x)] = _static_copy(x)
            out.append(copies[id(x)])
        else:
            out.append(x)
    return out


def _static_copy(x: torch.Tensor) -> torch.Tensor:
    """A buffer with ``x``'s shape, strides, dtype and values (the capture reads it at every replay)."""
    out = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    with torch.no_grad():
        out.copy_(x)
    return out.requires_grad_(x.requires_grad)


def _name(step: Callable[..., Any]) -> str:
    return getattr(step, "__qualname__", None) or type(step).__name__


__all__ = ["GraphedStep", "graphed", "device_bound", "DEFAULT_WARMUP"]
