"""The answer to "which kernel runs this call, and why": what `hal.explain` returns."""

from __future__ import annotations

import dataclasses
from typing import Optional

from hal.errors import HalError

FALLBACK_WORDS = {
    "composite": "the op's composite decomposition",
    "backend": "a lower-priority backend",
    "host": "a CPU backend, copying data through the host",
}


@dataclasses.dataclass
class Candidate:
    """One kernel (or composite, or backend) that was considered."""

    backend: str
    kernel: str
    reasons: list[str]
    chosen: bool = False
    note: str = ""  # "host fallback", "forced", ...

    @property
    def supported(self) -> bool:
        return not self.reasons


@dataclasses.dataclass
class Decision:
    """The chosen backend and kernel of a call, with every candidate and its rejection reasons."""

    op: str
    inputs: list[str]  # one line per array argument
    device: str
    backend: Optional[str] = None
    kernel: Optional[str] = None
    #: None when the device's preferred path runs; else "composite", "backend" or "host".
    fallback: Optional[str] = None
    forced: list[str] = dataclasses.field(default_factory=list)
    strict: bool = False
    candidates: list[Candidate] = dataclasses.field(default_factory=list)
    #: the error a call with these inputs raises (no kernel, strict mode, missing backend).
    error: Optional[HalError] = None

    @property
    def chosen(self) -> Optional[Candidate]:
        return next((c for c in self.candidates if c.chosen), None)

    def __str__(self) -> str:
        lines = [f"hal.explain: {self.op} on {self.device}"]
        for line in self.inputs:
            lines.append(f"  {line}")
        if self.forced:
            lines.append("forced: " + "; ".join(self.forced))
        if self.strict:
            lines.append("strict mode: fallbacks raise")
        if self.backend is not None:
            how = f"  (fallback to {FALLBACK_WORDS[self.fallback]})" if self.fallback else ""
            lines.append(f"chosen: {self.backend}/{self.kernel}{how}")
        if self.error is not None:
            lines.append(f"error: {type(self.error).__name__}: {self.error}")
        lines.append("candidates:")
        for c in self.candidates:
            mark = "->" if c.chosen else ("ok" if c.supported else "no")
            note = f" [{c.note}]" if c.note else ""
            lines.append(f"  {mark} {c.backend}/{c.kernel}{note}")
            for r in c.reasons:
                lines.append(f"       - {r}")
        return "\n".join(lines)
