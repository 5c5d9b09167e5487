"""The exception hierarchy of hal. Every error hal raises on purpose derives from HalError, and
:func:`unknown_names`, the message for names that are not among the known ones."""

from __future__ import annotations

import difflib
from typing import Iterable, Optional


class HalError(Exception):
    """Base class of every error raised by hal."""


class InvalidArgumentError(HalError, ValueError):
    """An argument has the wrong shape, dtype, device, type or value.

    The message names the op, the argument, what was expected and what was given.
    """

    def __init__(self, op: str, arg: str, expected: str, got: str) -> None:
        self.op, self.arg, self.expected, self.got = op, arg, expected, got
        super().__init__(f"{op}: argument '{arg}' must be {expected}; got {got}")


class UnsupportedError(HalError, NotImplementedError):
    """No kernel can run these inputs; the message lists every candidate with its reasons."""


class BackendUnavailableError(HalError, RuntimeError):
    """A forced or needed backend is not installed or cannot be used here."""


class PluginError(HalError, ImportError):
    """A plugin failed to load, or was built for another plugin API version."""


def unknown_names(what: str, given: Iterable[str], known: Iterable[str]) -> Optional[str]:
    """None when every name of ``given`` is in ``known``, else a message naming the unknown ones, the
    closest known name of each where one is close, and every known name (the command line's, and
    the options of ``python -m hal.dist.bench``)."""
    known = sorted(set(known))
    bad = [g for g in given if g not in known]
    if not bad:
        return None
    hints = []
    for g in bad:
        close = difflib.get_close_matches(g, known, n=1)
        hints.append(f"{g!r} (did you mean {close[0]!r}?)" if close else repr(g))
    return f"unknown {what} {', '.join(hints)}; known: {', '.join(known)}"
