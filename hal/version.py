"""Version numbers of the core and of the plugin API it speaks, and the commit hal was built from.

This module imports nothing but the standard library: the build (setup.py) loads it by path to stamp
the commit into a wheel or sdist before hal itself can be imported.
"""

from __future__ import annotations

import importlib
import os
import subprocess
from pathlib import Path
from typing import Optional

__version__ = "0.1.0"

#: The plugin API this core implements. A plugin states the API version it was built for; the core
#: loads plugins of the same major version and refuses others with a :class:`hal.PluginError`.
API_VERSION = "1.0"

#: The module the build writes into a built package (never into a checkout): ``COMMIT`` and
#: ``DIRTY``, the commit of the checkout it was built from and whether that had uncommitted changes.
STAMP_MODULE = "_build_stamp"


def checkout_commit(root: Path) -> tuple[Optional[str], Optional[bool]]:
    """(HEAD commit, whether tracked files have uncommitted changes) of the git checkout whose top
    folder is ``root``; (None, None) where ``root`` is not the top of a checkout (an installed
    package inside some other repository is not that repository's code) or git is missing."""

    def git(*args: str) -> Optional[str]:
        try:
            done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != root.resolve():
        return None, None
    head = git("rev-parse", "HEAD")
    if head is None:
        return None, None
    status = git("status", "--porcelain", "--untracked-files=no")
    return head, None if status is None else bool(status)


def source_commit() -> tuple[Optional[str], Optional[bool]]:
    """(commit, uncommitted changes) of the hal that runs, for reports: ``HAL_COMMIT`` /
    ``HAL_DIRTY`` when set (a copy of the tree on another machine may carry another commit's .git),
    else the commit stamped into an installed wheel at build time, else git of the checkout hal runs
    from (an editable install); (None, None) when none of them knows."""
    if os.environ.get("HAL_COMMIT"):
        return os.environ["HAL_COMMIT"], (os.environ["HAL_DIRTY"] == "1") if "HAL_DIRTY" in os.environ else None
    try:
        stamp = importlib.import_module("hal._build_stamp")  # hal.STAMP_MODULE, named whole: it imports nothing of hal
    except ImportError:
        return checkout_commit(Path(__file__).resolve().parent.parent)
    return stamp.COMMIT, stamp.DIRTY
