"""Measured kernel choices: when several kernels can run a call, the dispatcher times them once per
device model and problem (:mod:`hal.dispatch.measure`) and keeps the winner in
:class:`hal.tuning.cache.TuneCache`, a per-device JSON file that survives restarts and is shared
safely by concurrent processes. :func:`tune` (:mod:`hal.tuning.runner`) measures a step's calls
ahead of time; it is loaded on first use, since the dispatcher itself imports the cache from here."""

from __future__ import annotations

import importlib
from typing import Any

from hal.tuning.cache import Record, TuneCache, cache_dir


def __getattr__(name: str) -> Any:
    if name in ("tune", "TuneReport", "for_compile"):
        return getattr(importlib.import_module("hal.tuning.runner"), name)
    raise AttributeError(f"module 'hal.tuning' has no attribute {name!r}")


__all__ = ["Record", "TuneCache", "TuneReport", "cache_dir", "for_compile", "tune"]
