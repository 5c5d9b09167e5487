"""Poisoning the memory a kernel's outputs are allocated from, so that an element the kernel never
writes cannot hold the right value by chance (the reference's freed buffer, a previous run's result,
fresh zero pages).

Kernels allocate their outputs themselves (the API is functional), so the suite poisons the
allocators right before each kernel call, knowing the sizes of the outputs from the reference:

The poison is the byte 0x7B repeated: a huge finite value in every float dtype (float16 61280,
bfloat16 and float32 1.3e36, float64 6.5e286), so an unwritten element fails even where the
reference is NaN or infinite (a NaN poison would match a NaN reference); int8 123. For uint8 outputs,
where 123 is a common value, it is 0xFE (254).

- CUDA and ROCm (torch's caching allocator): empty the cache (so no stale free block, such as the
  previous kernel's output of this very case, can be handed out instead), then for each output size
  allocate two blocks, fill them with the poison and free them; the caching allocator keeps them and
  hands them to the kernel's next allocations of that size on the same stream (two, so that a
  temporary of the output's size does not take the only one). This is best effort: a kernel that
  allocates other sizes first may be handed other parts of the poisoned segments, or fresh ones.
- CPU with glibc: ``mallopt(M_PERTURB, p)`` (through ctypes) makes malloc fill every block it hands
  out with the byte ``p ^ 0xFF``, heap or mmap, and is switched on for the kernel call only.
  ``M_MMAP_THRESHOLD`` is raised to 32 MiB so large blocks stay on the heap and are recycled,
  instead of being mapped and unmapped around every call. NumPy keeps freed blocks under 1024
  bytes in its own cache, out of malloc's reach; those are poisoned like CUDA blocks: for each small
  output size, eight blocks are taken from NumPy, filled and given back, so the cache holds only
  poisoned blocks of that size.
- Anywhere else (musl, macOS, Windows) CPU poisoning is off, and the report says so; the NumPy
  cache is still poisoned.

:meth:`Poisoner.self_test` checks on the spot that an output-sized allocation comes back poisoned.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import torch

M_MMAP_THRESHOLD = -3
M_PERTURB = -6
MMAP_THRESHOLD = 32 * 1024 * 1024
NUMPY_SMALL_CACHE = 1024  # NumPy caches data blocks smaller than this many bytes, ...
NUMPY_CACHE_DEPTH = 8  # ... up to 7 per size
DEVICE_COPIES = 2  # poisoned device blocks per output size


def poison_byte(dtype: str) -> int:
    """The byte an output of ``dtype`` is poisoned with (see the module docstring)."""
    return 0xFE if dtype == "uint8" else 0x7B


def _glibc() -> tuple[Optional[ctypes.CDLL], str]:
    """glibc with mallopt, or None and why not."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        version = libc.gnu_get_libc_version
        version.restype = ctypes.c_char_p
        name = f"glibc {version().decode()}"
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        return libc, name
    except (OSError, AttributeError) as exc:
        return None, f"no glibc mallopt here ({exc}); CPU outputs above {NUMPY_SMALL_CACHE} bytes are not poisoned"


class Poisoner:
    """Poisons the allocator of one device before each kernel call (see the module docstring)."""

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.device = torch.device(device)
        self.enabled = enabled
        self._libc: Optional[ctypes.CDLL] = None
        if not enabled:
            self.method = "off (disabled)"
        elif self.device.type == "cpu":
            libc, name = _glibc()
            if libc is not None and libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1:
                self._libc = libc
                self.method = f"{name} M_PERTURB while kernels run, M_MMAP_THRESHOLD {MMAP_THRESHOLD >> 20} MiB; NumPy small-block cache"
            else:
                self.method = f"NumPy small-block cache only: {name}"
        else:
            self.method = f"caching allocator emptied, then {DEVICE_COPIES} poisoned blocks per output size freed into it"

    def arm(self, outputs: Sequence[tuple[int, str]]) -> None:
        """Poison the allocator for outputs of these (bytes, dtype name) before a kernel call."""
        if not self.enabled:
            return
        held: list = []  # all blocks stay allocated until every one is filled, so none is reused early
        if self.device.type != "cpu":
            with torch.cuda.device(self.device):
                torch.cuda.empty_cache()
        for nbytes, dtype in outputs:
            if self.device.type != "cpu":
                for _ in range(DEVICE_COPIES):
                    held.append(torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device).fill_(poison_byte(dtype)))
            elif nbytes < NUMPY_SMALL_CACHE:
                for _ in range(NUMPY_CACHE_DEPTH):
                    held.append(np.empty(nbytes, np.uint8))
                    held[-1].fill(poison_byte(dtype))
        del held  # back to the caches, poisoned
        if self._libc is not None:
            fill = poison_byte("uint8") if any(dtype == "uint8" for _, dtype in outputs) else poison_byte("float32")
            self._libc.mallopt(M_PERTURB, fill ^ 0xFF)

    def disarm(self) -> None:
        """Stop poisoning (after the kernel call)."""
        if self._libc is not None:
            self._libc.mallopt(M_PERTURB, 0)

    @contextlib.contextmanager
    def around(self, outputs: Sequence[tuple[int, str]]) -> Iterator[None]:
        self.arm(outputs)
        try:
            yield
        finally:
            self.disarm()

    def self_test(self) -> tuple[bool, str]:
        """Whether output-sized allocations really come back poisoned: a small and a large float32
        array (NumPy on the CPU, torch on a device) must hold no finite value below 1e30."""
        if not self.enabled:
            return False, self.method
        failures = []
        for n in (24, 300_000):
            with self.around([(4 * n, "float32")]):
                if self.device.type == "cpu":
                    fresh = torch.from_numpy(np.empty(n, np.float32))
                else:
                    fresh = torch.empty(n, dtype=torch.float32, device=self.device).cpu()
            plausible = torch.isfinite(fresh) & (fresh.abs() < 1e30)
            if bool(plausible.any()):
                failures.append(f"{int(plausible.sum())} of {n} float32 elements allocated after poisoning were not poisoned")
        if failures:
            return False, f"{self.method}; self-test failed: " + "; ".join(failures)
        return True, self.method


@contextlib.contextmanager
def filled_empties(fill: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """While inside, ``torch.empty`` and ``torch.empty_like`` return what ``fill`` makes of their
    tensors, so an element a kernel leaves unwritten shows the fill: for harnesses that call a kit's
    host functions directly (interpreted kernel tests, device benchmarks), which allocate their
    outputs with torch.empty where the suite's :class:`Poisoner` does not reach. ``fill`` gets every
    tensor, of any dtype, and returns it (filled or not). Not thread-safe: it swaps torch's functions."""
    empty, empty_like = torch.empty, torch.empty_like
    torch.empty = lambda *a, **k: fill(empty(*a, **k))
    torch.empty_like = lambda *a, **k: fill(empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like
