"""A call's decision (steps 1-4 of :mod:`hal.dispatch.dispatcher`): the value the dispatcher makes
and the plan, ``hal.explain`` and torch.compile's decisions read. It lives apart from the dispatcher
so that :mod:`~hal.dispatch.explain`, which the dispatcher calls, reads it without importing the
dispatcher back."""

from __future__ import annotations

import dataclasses
from typing import Optional

from hal.config import Choice
from hal.errors import HalError

from .measure import Outcome
from .route import Route
from .select import Selection
from .validate import Prepared


@dataclasses.dataclass(frozen=True)
class Decided:
    """A call's decision (steps 1-4): the validated call, the selection, and the route to run (None
    with an error), how it was chosen among its alternatives, and whether it may be cached."""

    prepared: Prepared
    choice: Choice
    selection: Selection
    route: Optional[Route]
    alternatives: tuple[Route, ...] = ()
    outcome: Optional[Outcome] = None

    @property
    def error(self) -> Optional[HalError]:
        return self.selection.error
