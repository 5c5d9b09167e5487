"""The error a collective raises when the transfer itself fails: a rank died, stalled, or the engine broke."""

from __future__ import annotations

from hal.errors import HalError


class CommError(HalError, RuntimeError):
    """A collective did not complete: a peer died or stalled past the timeout, or the engine failed.

    The process group is unusable afterwards (its transfers are out of step): destroy it and
    restart the job, as torchrun's elastic restarts do.
    """
