"""The options of ``hal bench --collectives`` (declared by :mod:`hal.dist.bench`) checked before any
rank starts, by :func:`hal.dist.bench.problems` (which ``python -m hal.dist.bench`` runs too), and
reported as a :class:`~hal.cli.usage.CommandLineError`."""

from __future__ import annotations

import argparse

from hal.cli.usage import CommandLineError


def check(args: argparse.Namespace) -> None:
    """Raise :class:`CommandLineError` listing every bad collectives option."""
    from hal.dist.bench import problems  # (hal bench imports hal.dist.bench where it is installed)

    found = problems(args)
    if found:
        raise CommandLineError("; ".join(found))
