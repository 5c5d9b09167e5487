"""The largest batch a training step fits in device memory: a search by doubling, then bisecting
between the last batch that fitted and the first that ran out of memory (``hal bench --models
--max-batch``).

A try runs a few whole steps at one batch (the optimizer's state is created in the first, the
allocator's peak is reached by the second); running out of memory is ``torch.cuda.OutOfMemoryError``
(any other error ends the search: it is not an answer about memory). Between tries everything of
the failed try is freed (the exception and its traceback first, which hold the step's tensors) and
the allocator's cache emptied, so each try starts from the same empty device.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch


@dataclasses.dataclass
class BatchSearch:
    """The answer: ``largest`` fitted (0: not even ``start``), ``smallest_oom`` ran out of memory
    (None: the search stopped at ``limit`` without running out), every try in order as ``(batch,
    fitted)``."""

    largest: int
    smallest_oom: Optional[int]
    tries: list[tuple[int, bool]]

    def as_dict(self) -> dict:
        return {"largest": self.largest, "smallest_oom": self.smallest_oom, "tries": [list(t) for t in self.tries]}


def largest_batch(run: Callable[[int], None], start: int = 1, limit: int = 4096,
                  free: Callable[[], None] = lambda: None) -> BatchSearch:
    """The largest batch in ``[start, limit]`` for which ``run(batch)`` returns without raising
    ``torch.cuda.OutOfMemoryError``: batches ``start, 2 start, 4 start, ...`` until one runs out of
    memory (or ``limit`` fits), then bisection between the last that fitted and the first that did
    not. Assumes that a batch that fits fits all smaller ones. ``free()`` runs after every try."""
    if not 1 <= start <= limit:
        raise ValueError(f"the batch search needs 1 <= start <= limit (got start {start}, limit {limit})")
    tries: list[tuple[int, bool]] = []

    def fits(batch: int) -> bool:
        ok = True
        try:
            run(batch)
        except torch.cuda.OutOfMemoryError:
            ok = False  # the exception (and the frames its traceback holds) is released here
        free()
        tries.append((batch, ok))
        return ok

    good, bad = 0, None
    batch = start
    while bad is None:
        if fits(batch):
            good = batch
            if batch == limit:
                break
            batch = min(2 * batch, limit)
        else:
            bad = batch
    while good and bad is not None and bad - good > 1:  # below start is not searched
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return BatchSearch(largest=good, smallest_oom=bad, tries=tries)

