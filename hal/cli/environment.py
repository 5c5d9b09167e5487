"""Backends and ``HAL_*`` settings checked before a command measures anything: a backend that is not
installed or not usable, or an environment variable hal cannot read, would otherwise make every call
of the run fail one by one (or end in a traceback)."""

from __future__ import annotations

import os

import hal
from hal.cli.usage import CommandLineError
from hal.errors import InvalidArgumentError


def usable_backend(name: str, source: str) -> hal.BackendRecord:
    """The installed, usable backend ``name`` (given by ``source``: ``--backend``, ``HAL_BACKEND=``);
    :class:`CommandLineError` saying what to do otherwise."""
    records = hal.backends()
    state = {b.name: b for b in records}.get(name)
    if state is None:
        raise CommandLineError(f"{source}{name}: no backend of that name is installed; installed: "
                               f"{', '.join(b.name for b in records)}")
    if not state.available:
        raise CommandLineError(f"{source}{name}: the backend is not usable here: {state.reason}")
    return state


def check() -> None:
    """Raise :class:`CommandLineError` for a ``HAL_*`` setting that hal's calls would refuse."""
    from hal import config

    try:
        config.check_environment()
        config.tune_mode()
        config.env_flag("HAL_STRICT")
        config.env_flag("HAL_TORCH_AUTOGRAD", True)
    except InvalidArgumentError as exc:
        raise CommandLineError(f"{exc.arg} must be {exc.expected}; got {exc.got}") from None
    forced = os.environ.get("HAL_BACKEND", "").strip()
    if forced:
        try:
            usable_backend(forced, "HAL_BACKEND=")
        except CommandLineError as exc:
            raise CommandLineError(f"{exc}; unset HAL_BACKEND or set it to a usable backend") from None
