"""What is alive at a training step's peak of device memory, and who allocated it.

``torch.cuda.memory._record_memory_history`` records every allocation and free of the caching
allocator with the Python stack that made it. :func:`peak_anatomy` replays one step's events: the
bytes allocated rise and fall, and at their highest point every block still alive is charged to the
frame that allocated it (:func:`site_of`: the innermost frame outside torch's own files, where the
model's, hal's, Liger's or transformers' code asked for it) and to a phase (forward, backward,
optimizer: from the stack). Blocks allocated before the recording (weights, gradients kept across
steps, optimizer state) are one line, ``held before the step``.

Why: a peak figure (``torch.cuda.max_memory_allocated``) says how much, not what. Two variants of one
model (eager torch, ``hal.nn.patch``, Liger-Kernel) differ by a few GiB at the peak; the sites alive
there say which tensors make the difference, so the change that removes them is chosen by measurement.
``benchmarks/memory_anatomy.py`` runs it on ``hal bench --models`` workloads, one process per variant.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, Mapping, Optional, Sequence

#: frames from these paths are the allocator's callers inside torch: the site is the first frame
#: outside them (a tensor op called by user code is charged to the user code)
_TORCH_PATHS = ("/torch/", "torch/", "<built-in", "<frozen")
#: frames (their function names) that mark a phase of the step, looked for from the outermost frame in
_PHASES = (("optimizer", ("step", "_single_tensor_adamw", "_fused_adamw", "_multi_tensor_adamw", "fused_adamw_")),
           ("backward", ("backward", "_engine_run_backward", "run_backward")))
#: names too common to mark a phase on their own (a benchmark's ``def step()`` wraps the whole step):
#: they count only in a frame of an optimizer's module (torch/optim/..., hal/optim.py)
_OPTIMIZER_ONLY = {"step"}
_OPTIMIZER_PATH = re.compile(r"(^|/)optim(/|\.py$)")


@dataclasses.dataclass(frozen=True)
class Site:
    """Bytes alive at the peak charged to one allocating frame."""

    where: str  # "file.py:line (function)", or "held before the step"
    phase: str  # "forward", "backward", "optimizer", "before"
    bytes: int
    blocks: int


@dataclasses.dataclass(frozen=True)
class Anatomy:
    """One step's peak: ``peak_bytes`` allocated (``held_before`` + the step's blocks alive then),
    the event index of the peak among ``events``, and the sites alive at it, largest first."""

    peak_bytes: int
    held_before: int
    peak_event: int
    events: int
    sites: tuple[Site, ...]

    def by_phase(self) -> dict[str, int]:
        """Bytes alive at the peak by the phase that allocated them (``before``: held before the step)."""
        out: dict[str, int] = {}
        for s in self.sites:
            out[s.phase] = out.get(s.phase, 0) + s.bytes
        return out


def _frame_text(frame: Mapping[str, Any]) -> str:
    name = str(frame.get("filename", "?"))
    short = "/".join(name.split("/")[-2:])
    return f"{short}:{frame.get('line', '?')} ({frame.get('name', '?')})"


def site_of(frames: Sequence[Mapping[str, Any]]) -> str:
    """The innermost frame outside torch's files (frames are innermost first, as torch records
    them), else the innermost frame; ``"(no stack)"`` for an event recorded without one."""
    for frame in frames:
        name = str(frame.get("filename", ""))
        if name.endswith(".py") and not any(p in name for p in _TORCH_PATHS):
            return _frame_text(frame)
    return _frame_text(frames[0]) if frames else "(no stack)"


def phase_of(frames: Sequence[Mapping[str, Any]]) -> str:
    """``optimizer`` or ``backward`` where a frame of the stack is one of theirs (the optimizer's step
    wins: it may run inside a function named backward by nobody), else ``forward``."""
    names = {str(f.get("name", "")) for f in frames
             if str(f.get("name", "")) not in _OPTIMIZER_ONLY or _OPTIMIZER_PATH.search(str(f.get("filename", "")))}
    for phase, markers in _PHASES:
        if names.intersection(markers):
            return phase
    return "forward"


def _freed(action: str) -> bool:
    # a block is free for the allocated count when its owner frees it (free_requested); a record
    # without that action (older torch, or a block freed without stream uses) has free_completed only
    return action in ("free_requested", "free_completed")


def peak_anatomy(events: Sequence[Mapping[str, Any]], held_before: int, top: Optional[int] = None) -> Anatomy:
    """Replay ``events`` (``torch.cuda.memory._snapshot()["device_traces"][device]``: dicts with
    ``action``, ``addr``, ``size`` and ``frames``) from ``held_before`` bytes allocated: the peak, and
    every block alive at it by site (``top``: the largest that many, the rest as one ``other`` line).
    A free of a block allocated before the recording lowers the count below the blocks alive in it
    (it was part of ``held_before``)."""
    alive: dict[int, int] = {}
    current = peak = held_before
    peak_at = -1
    for i, e in enumerate(events):
        action, addr, size = e.get("action"), int(e.get("addr", 0)), int(e.get("size", 0))
        if action == "alloc":
            alive[addr] = size
            current += size
            if current > peak:
                peak, peak_at = current, i
        elif _freed(str(action)):
            if addr in alive:
                current -= alive.pop(addr)
            elif action == "free_requested":  # a block of held_before
                current -= size
    # second pass: the blocks alive at the peak, each with its allocating event
    blocks: dict[int, Mapping[str, Any]] = {}
    before_freed = 0
    for e in events[: peak_at + 1]:
        action, addr = e.get("action"), int(e.get("addr", 0))
        if action == "alloc":
            blocks[addr] = e
        elif _freed(str(action)):
            if addr in blocks:
                del blocks[addr]
            elif action == "free_requested":
                before_freed += int(e.get("size", 0))
    grouped: dict[tuple[str, str], list[int]] = {}
    for e in blocks.values():
        frames = e.get("frames") or ()
        key = (site_of(frames), phase_of(frames))
        entry = grouped.setdefault(key, [0, 0])
        entry[0] += int(e.get("size", 0))
        entry[1] += 1
    sites = sorted((Site(w, p, b, n) for (w, p), (b, n) in grouped.items()), key=lambda s: -s.bytes)
    if top is not None and len(sites) > top:
        rest = sites[top:]
        sites = sites[:top] + [Site("other sites", "mixed", sum(s.bytes for s in rest), sum(s.blocks for s in rest))]
    held = held_before - before_freed
    return Anatomy(peak, held_before, peak_at, len(events), (Site("held before the step", "before", held, 0), *sites))


def format_anatomy(label: str, a: Anatomy, gib: float = 2.0**30) -> list[str]:
    """Lines of text: the peak, by phase, then each site."""
    phases = ", ".join(f"{p} {b / gib:.2f}" for p, b in a.by_phase().items())
    lines = [f"== {label}: peak {a.peak_bytes / gib:.2f} GiB allocated at event {a.peak_event} of {a.events} "
             f"(held before the step {a.held_before / gib:.2f} GiB); alive at the peak by phase (GiB): {phases}"]
    for s in a.sites:
        lines.append(f"  {s.bytes / gib:8.3f} GiB  {s.blocks:6d} blocks  {s.phase:9s}  {s.where}")
    return lines


def as_json(a: Anatomy) -> dict[str, Any]:
    return {"peak_bytes": a.peak_bytes, "held_before": a.held_before, "peak_event": a.peak_event, "events": a.events,
            "by_phase": a.by_phase(), "sites": [dataclasses.asdict(s) for s in a.sites]}


def phases_side_by_side(anatomies: Iterable[tuple[str, Anatomy]], gib: float = 2.0**30) -> list[str]:
    """One line per variant: its peak and what was alive at it by phase, for comparing variants."""
    rows = list(anatomies)
    phases = ["before", "forward", "backward", "optimizer", "mixed"]
    head = "  variant".ljust(28) + "peak".rjust(9) + "".join(p.rjust(11) for p in phases)
    out = [head]
    for label, a in rows:
        by = a.by_phase()
        out.append(f"  {label}".ljust(28) + f"{a.peak_bytes / gib:9.2f}" + "".join(f"{by.get(p, 0) / gib:11.2f}" for p in phases))
    return out
