"""Output paths of the commands, checked before any work is done: a report or export that cannot be
written is refused up front (exit 2, one line) instead of failing after minutes of measuring."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hal.cli.usage import CommandLineError


def _why(path: Path, exc: OSError) -> str:
    """What stops ``path`` from being a folder: a file on the way to it, else the OS's reason."""
    for parent in (path, *path.parents):
        if parent.exists():
            if not parent.is_dir():
                return f"{parent} is a file, not a folder"
            break
    return exc.strerror or str(exc)


def output_dir(path: Path, option: str) -> Path:
    """Create the folder ``path`` (and its parents) and check that a file can be written in it;
    :class:`CommandLineError` naming ``option`` otherwise."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise CommandLineError(f"{option} {path}: cannot write there ({_why(path, exc)}); give a folder you can write to") from None
    return path


def output_file(path: Path, option: str) -> Path:
    """Check that the file ``path`` can be written (its folder is created where missing)."""
    if path.is_dir():
        raise CommandLineError(f"{option} {path}: is a folder; give a file name")
    output_dir(path.parent, option)
    if path.exists() and not os.access(path, os.W_OK):
        raise CommandLineError(f"{option} {path}: the file is not writable; give another path")
    return path
