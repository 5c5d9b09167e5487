"""The key under which hal_triton._launch reuses a compiled specialisation must be at least as fine
as Triton's own specialisation: two argument lists with one key must be specialised identically by
Triton, or a launch could run a kernel compiled for other arguments (a pointer assumed 16-byte
aligned, an integer assumed to be 1). Checked against the installed Triton's specialiser (a private
function: skipped if this Triton has none), on a grid of edge values and on random draws.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from hal_triton._launch import _spec_key, live_key

from ._support import fresh_seed

try:
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    BACKEND = type(make_backend(GPUTarget("cuda", 90, 32)))
except (ImportError, AttributeError) as exc:  # another Triton: nothing to compare with
    pytest.skip(f"this Triton has no native_specialize_impl to compare with ({exc})", allow_module_level=True)


def triton_spec(a: object) -> tuple:
    """What Triton specialises a runtime argument on (alignment and value specialisation on)."""
    return tuple(native_specialize_impl(BACKEND, a, False, True, True))


def edge_values() -> list[object]:
    ints = [0, 1, 2, 15, 16, 17, 31, 32, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -(2**31), -(2**31) - 1, 2**40]
    buf = torch.empty(64, dtype=torch.uint8)
    tensors = [buf[i:].view(torch.uint8) for i in range(0, 20)]
    tensors += [torch.empty(33, dtype=d)[1:] for d in (torch.float16, torch.bfloat16, torch.float32, torch.int8)]
    tensors += [torch.empty(33, dtype=d) for d in (torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.int64)]
    return [*ints, 0.0, 1.0, 1.5, -2.0, float("inf"), True, False, None, *tensors]


def assert_finer(values: list[object]) -> None:
    by_key: dict[object, tuple] = {}
    for v in values:
        key, spec = _spec_key(v), triton_spec(v)
        seen = by_key.setdefault(key, spec)
        assert seen == spec, f"{v!r}: hal key {key} also covers Triton specialisation {seen}, but Triton gives {spec}"


def test_edge_values_never_share_a_key_across_triton_specialisations():
    values = edge_values()
    assert_finer(values)
    keys = {_spec_key(v) for v in values}
    assert len(keys) >= len({triton_spec(v) for v in values})  # finer, so at least as many keys


def test_random_integers_and_views():
    rng = np.random.default_rng(fresh_seed())
    ints = [int(v) for v in rng.integers(-(2**33), 2**33, 400)] + [int(v) * 16 for v in rng.integers(-(2**29), 2**29, 100)]
    base = torch.empty(4096, dtype=torch.float32)
    views = [base[int(i):] for i in rng.integers(0, 4000, 100)]
    assert_finer([*ints, *views])


def test_key_separates_what_changes_the_compiled_code():
    """The cases that must not share a compiled kernel: 1 against other integers, 32- against
    64-bit integers, 16-byte aligned against misaligned pointers, and pointer element types."""
    x = torch.empty(32, dtype=torch.float16)
    pairs = [(1, 2), (16, 32 + 1), (2**31 - 1, 2**31), (x, x[1:]), (x, x.view(torch.int16)), (True, False)]
    for a, b in pairs:
        assert _spec_key(a) != _spec_key(b), (a, b)
    for a, b in itertools.combinations([2, 3, 5, 7], 2):  # unaligned, not 1: one specialisation
        assert _spec_key(a) == _spec_key(b)


def test_a_plans_live_key_is_the_launch_key_of_each_argument():
    values = edge_values() + [torch.nn.Parameter(torch.empty(8))]  # a tensor subclass takes the general case
    assert live_key(values) == tuple(map(_spec_key, values))
