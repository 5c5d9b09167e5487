"""numba, imported lazily: whether it works here, and the compiled kernel families.

Nothing here runs at plugin import. ``unavailable_reason()`` imports numba the first time a
dispatch decision asks about a numba kernel; ``family(name)`` imports ``hal_backend_cpu._nb.<name>``,
whose ``@njit`` functions compile on their first call and are cached on disk. The cache directory is
``HAL_CPU_NUMBA_CACHE_DIR`` when set (mapped to numba's ``NUMBA_CACHE_DIR``), else numba's default
(``__pycache__`` beside the sources, or a user cache when that is not writable).

numba starts its thread pool once per process; with its OpenMP layer (the one chosen where torch
brings libgomp) the start calls ``omp_set_num_threads(NUMBA_NUM_THREADS)``, which is also torch's
intra-op thread count: ``torch.set_num_threads(1)`` then a first numba kernel left torch on every
core, and the CPU's tune cache, whose device slug holds torch's thread count, in a second file.
``family`` starts the pool itself, before any kernel runs, and puts torch's count back.
"""

from __future__ import annotations

import functools
import importlib
import os
import threading
from types import ModuleType
from typing import Optional

CACHE_DIR_ENV = "HAL_CPU_NUMBA_CACHE_DIR"
_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def unavailable_reason() -> Optional[str]:
    """None when numba imports and works here, else a sentence saying why not and what to do."""
    with _lock:
        cache_dir = os.environ.get(CACHE_DIR_ENV)
        if cache_dir:
            os.environ["NUMBA_CACHE_DIR"] = cache_dir
        try:
            import numba
        except ImportError as exc:
            return f"numba is not installed ({exc}); pip install numba to enable the numba kernels"
        except Exception as exc:  # a broken install (numba built against another NumPy ...)
            return f"numba failed to import ({type(exc).__name__}: {exc}); reinstall a numba matching this NumPy"
        if cache_dir:  # numba may have been imported before with another setting
            numba.config.CACHE_DIR = cache_dir
        return None


@functools.lru_cache(maxsize=None)
def family(name: str) -> ModuleType:
    """The numba kernel module ``name`` (imported on first use; its functions compile on first call)."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    _start_threads_keeping_torchs()
    return importlib.import_module(f"hal_backend_cpu._nb.{name}")


@functools.lru_cache(maxsize=None)
def _start_threads_keeping_torchs() -> None:
    """Start numba's thread pool now (``numba.get_num_threads`` does, once per process) and give
    torch back its intra-op thread count, which the OpenMP layer's start overwrites."""
    import numba
    import torch

    with _lock:
        threads = torch.get_num_threads()
        try:
            numba.get_num_threads()
        finally:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
