"""What a benchmark case times besides hal: callables, and named peers that need more than one.

A named peer is a plain callable, or a :class:`Peer` when it cannot run here (``reason`` says why,
and the table shows that sentence in the peer's cell) or when each run overwrites its own inputs
(``restore`` puts them back before every timed run, outside the timing, so that no run works on
what the previous one left: Liger-Kernel's SwiGLU backward writes its gradients into the saved
inputs, its cross-entropy writes the gradient into the logits).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Union

Fn = Callable[[], Any]


@dataclasses.dataclass
class Peer:
    run: Optional[Fn] = None
    reason: Optional[str] = None
    restore: Optional[Fn] = None
    detail: Optional[str] = None  # what is called, for the JSON document (e.g. Liger's function and module)

    def __post_init__(self) -> None:
        if (self.run is None) == (self.reason is None):
            raise ValueError("a Peer has either a run callable or a reason it cannot run, not both or neither")


PeerLike = Union[Fn, Peer]


def as_peer(p: PeerLike) -> Peer:
    """A plain callable as a Peer without restore."""
    return p if isinstance(p, Peer) else Peer(run=p)
