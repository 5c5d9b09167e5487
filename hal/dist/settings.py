"""Process-wide settings of hal.dist: timeout, debug checks and topology.

Every rank of a group must use the same settings: they decide which algorithm runs, and the ranks
of a collective must run the same one (the debug check compares the choice across ranks).

* timeout of one collective: ``set_timeout(seconds)``, else ``HAL_DIST_TIMEOUT``, else the group's;
* cross-rank argument check: ``set_debug(True)``, else ``HAL_DIST_CHECK=1``;
* ranks per node: ``set_topology(ranks_per_node)``, else ``LOCAL_WORLD_SIZE`` (torchrun sets it).

The environment is read once, when first needed (hot paths never touch ``os.environ``); call
:func:`refresh` after changing these variables in a running process.
"""

from __future__ import annotations

import itertools
import os
from typing import Any, Callable, Optional

from hal.errors import InvalidArgumentError

_timeout_s: Optional[float] = None
_debug: Optional[bool] = None
_ranks_per_node: Optional[int] = None
_env: dict[str, Any] = {}  # values read from the environment, by variable
_version = itertools.count(1)
#: Bumped by every setter; caches keyed on settings (group layouts, decisions) compare against it.
version = 0


def bump_version() -> None:
    """Mark every cached layout and choice stale (called by each setter, here and in hal.dist.cost)."""
    global version
    version = next(_version)


def refresh() -> None:
    """Re-read HAL_DIST_TIMEOUT, HAL_DIST_CHECK, LOCAL_WORLD_SIZE and HAL_KERNEL_* (cached choices too)."""
    _env.clear()
    bump_version()


def _from_env(name: str, parse: Callable[[str], Any]) -> Any:
    try:
        return _env[name]
    except KeyError:
        value = _env[name] = parse(os.environ.get(name, "").strip())
        return value


def _seconds(text: str) -> Optional[float]:
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise InvalidArgumentError("hal.dist", "HAL_DIST_TIMEOUT", "a number of seconds", repr(text)) from None
    return value if value > 0 else None


def set_timeout(seconds: Optional[float]) -> None:
    """Bound the wait of every hal.dist collective to ``seconds`` (None: the process group's timeout).

    A collective that does not finish in time (a rank died or stalls) raises
    :class:`hal.dist.CommError` on the ranks that wait. On gloo the bound applies to each transfer
    the algorithm makes; on NCCL the process group's watchdog enforces its own timeout (with
    ``TORCH_NCCL_BLOCKING_WAIT=1`` the wait raises instead of aborting the process).
    """
    global _timeout_s
    if seconds is not None and not (isinstance(seconds, (int, float)) and seconds > 0):
        raise InvalidArgumentError("hal.dist.set_timeout", "seconds", "a positive number or None", repr(seconds))
    _timeout_s = None if seconds is None else float(seconds)
    bump_version()


def timeout() -> Optional[float]:
    """The timeout in seconds hal.dist applies to a collective's waits, or None (the group's own)."""
    if _timeout_s is not None:
        return _timeout_s
    return _from_env("HAL_DIST_TIMEOUT", _seconds)


def set_debug(enabled: Optional[bool]) -> None:
    """Turn the cross-rank argument check on or off (None: follow ``HAL_DIST_CHECK``).

    With the check on, each collective first exchanges a small signature (collective, algorithm,
    op, dtype, shape) between the ranks; a mismatch raises :class:`hal.InvalidArgumentError` on
    every rank, naming what each rank passed, instead of hanging or corrupting data. It costs one
    small extra collective per call.
    """
    global _debug
    _debug = None if enabled is None else bool(enabled)
    bump_version()


def debug() -> bool:
    """Whether the cross-rank argument check is on."""
    if _debug is not None:
        return _debug
    return _from_env("HAL_DIST_CHECK", lambda v: v.lower() in ("1", "true", "yes", "on"))


def set_topology(ranks_per_node: Optional[int] = None) -> None:
    """Declare how many consecutive global ranks share a node (None: read ``LOCAL_WORLD_SIZE``).

    Ranks are laid out as torchrun does: global rank ``r`` lives on node ``r // ranks_per_node``.
    The ``hierarchical`` algorithm and the ``auto`` cost model use this layout.
    """
    global _ranks_per_node
    if ranks_per_node is not None and not (isinstance(ranks_per_node, int) and ranks_per_node >= 1):
        raise InvalidArgumentError(
            "hal.dist.set_topology", "ranks_per_node", "a positive int or None", repr(ranks_per_node)
        )
    _ranks_per_node = ranks_per_node
    bump_version()


def ranks_per_node() -> Optional[int]:
    """Ranks per node from ``set_topology`` or ``LOCAL_WORLD_SIZE``; None when neither says."""
    if _ranks_per_node is not None:
        return _ranks_per_node
    return _from_env("LOCAL_WORLD_SIZE", lambda v: int(v) if v.isdigit() and int(v) >= 1 else None)
