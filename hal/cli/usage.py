"""What every ``hal`` command shares about bad input: the exit statuses, the error a command raises
for an argument it cannot use, and argument types that refuse bad values while parsing.

A user error never ends in a traceback: it is one line on stderr, ``hal <command>: <what is wrong and
what to do>``, and exit status 2 (argparse's own usage errors also exit 2, with the command's usage).
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional

from hal.errors import HalError

#: the command did what it was asked and found nothing wrong
EXIT_OK = 0
#: the command ran and found failures (a conformance case failed, a bench case or model errored)
EXIT_FAILED = 1
#: the command could not run as asked: a bad argument, a missing module or file, an unusable backend
EXIT_USAGE = 2
#: the user interrupted the command (Ctrl-C): 128 + SIGINT, what a shell shows for it
EXIT_INTERRUPTED = 130


class CommandLineError(HalError):
    """An argument or setting a command cannot use; the message says what is wrong and what to do.
    :func:`run_command` prints it on one line and exits with :data:`EXIT_USAGE`."""


def run_command(prog: str, run: Callable[[argparse.Namespace], Optional[int]], args: argparse.Namespace) -> int:
    """``run(args)``'s exit status, or :data:`EXIT_USAGE` after printing a :class:`CommandLineError`
    as ``prog: message``."""
    try:
        return int(run(args) or EXIT_OK)
    except CommandLineError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_USAGE


def names(text: str) -> list[str]:
    """Argument type of a comma-separated list of names (``--ops a,b``); an empty list is refused
    (an empty ``--ops ""`` would otherwise mean every op)."""
    out = [t.strip() for t in text.split(",") if t.strip()]
    if not out:
        raise argparse.ArgumentTypeError(f"{text!r} names nothing: give one or more names separated by commas")
    return out


def at_least(low: int) -> Callable[[str], int]:
    """Argument type of an integer no smaller than ``low`` (``--world-size``, ``--jobs``, ...)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is too small: give {low} or more")
        return value

    return parse
