"""What the two-rank agreement tests (test_agreement.py and test_local_agreement.py) share: the
record of a call's outcome, and the layers they build (a column-parallel, a row-parallel and a
vocabulary-parallel linear layer and a vocabulary-parallel embedding, each beside the full float64
layer it was cut from, the full layers' parameters drawn from the caller's generator: every rank
draws the same numbers in the same order)."""

from __future__ import annotations

import types
from typing import Any, Callable

import torch

#: vocabulary: 6 ids per rank of two, the last row of rank 1's slice is padding
V = 11


def reference_layers(g: torch.Generator, **head_options: Any) -> types.SimpleNamespace:
    """``column_full`` (8 -> 6), ``row_full`` (6 -> 8), ``head_full`` (5 -> V) and ``table`` (V x 5),
    their parameters drawn from ``g`` in that order, and ``column`` (gathering its output), ``row``
    (taking the whole input), ``emb`` and ``head`` (``head_options`` for its loss) made from them."""
    from hal.parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelLMHead

    column_full, row_full, head_full = (torch.nn.Linear(*io, dtype=torch.float64) for io in ((8, 6), (6, 8), (5, V)))
    table = torch.nn.Embedding(V, 5, dtype=torch.float64)
    with torch.no_grad():
        for p in [*column_full.parameters(), *row_full.parameters(), *head_full.parameters(), table.weight]:
            p.copy_(torch.randn(*p.shape, generator=g, dtype=torch.float64))
    return types.SimpleNamespace(
        column_full=column_full, row_full=row_full, head_full=head_full, table=table,
        column=ColumnParallelLinear.from_linear(column_full, gather_output=True),
        row=RowParallelLinear.from_linear(row_full, input_is_parallel=False),
        emb=VocabParallelEmbedding.from_embedding(table),
        head=VocabParallelLMHead.from_linear(head_full, **head_options))


def outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    """What ``fn()`` did, as a rank reports it: the exception's classes and message, or its value."""
    try:
        value = fn()
    except Exception as exc:  # recorded for the test to judge
        return {"raised": [c.__name__ for c in type(exc).__mro__], "message": f"{type(exc).__name__}: {exc}", "value": None}
    return {"raised": [], "message": "", "value": value}
