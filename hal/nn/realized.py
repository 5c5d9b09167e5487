"""``realized(x)``: inside a ``torch.compile`` graph, ``x`` computed once and read from memory by
each of its consumers, rather than recomputed inside each of them.

Inductor inlines a cheap elementwise producer into every consumer that reads it. That is right for
an add; it is not for a decoder's rotary angles: Hugging Face models compute ``cos`` and ``sin`` once
per forward from the position ids (an outer product, ``cos``, ``sin``), and every layer's rotary
embedding reads them, forward and backward. Inlined, each of those 64 kernels of a 16-layer model
recomputes two transcendental functions per element of q and k: in hal.optimize's compiled step of
a Hugging Face Llama at Llama-3.2-1B's shape on an H100 (2026-12-07, ``benchmarks/levers40.py``) the
rotary kernels took 2.38 ms where reading and writing q and k once each way moves about 0.5 ms of
memory. The angles themselves are 512 KiB each at that shape. Read through ``realized``, cos and sin
are one 3 us kernel and the rotary kernels took 0.56 ms (the same step, H100, ``d19b2fd``).

An opaque operator asks Inductor to write a tensor without a compiler option: its input is made a
buffer, and its output (a copy) is a buffer that the consumers load. Outside a compiled graph
``realized`` returns ``x`` itself (eager code computes the angles once already).
"""

from __future__ import annotations

import torch


@torch.library.custom_op("hal_nn::realized", mutates_args=())
def _realized(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_realized.register_fake
def _realized_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def realized(x: torch.Tensor) -> torch.Tensor:
    """``x``, written to memory once inside a torch.compile graph (module docstring); ``x`` itself
    in eager code. ``x`` carries no gradient (the operator has no backward): rotary angles do not."""
    return _realized(x.detach()) if torch.compiler.is_compiling() else x
