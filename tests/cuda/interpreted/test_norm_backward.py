"""The layer_norm / rms_norm backward (hal_triton.norm.norm_backward) in every launch configuration
the plugins' tables offer the autotuner, in the Triton interpreter, against torch's autograd.

Each configuration of the CUDA and ROCm candidates at the benchmark shapes (rows per block,
prefetch, vendor options), and each of the interpreter's own candidates, runs at small sizes with
several program counts: one program walking every block, a few, and more programs than blocks; rows
not a multiple of the block or of the programs, row lengths not powers of two, with and without a
weight. The reference is torch's autograd of F.layer_norm / F.rms_norm on float64 copies (a weight
of ones where there is none: the op's grad_weight and grad_bias exist either way); grad_x, grad_weight
and grad_bias within the op's tolerance, NaN and infinities where torch has them. Fresh random
inputs per test (the seed printed; HAL_TEST_SEED replays), every buffer the call allocates filled
with junk first. Run by tests/cuda/test_interpreter.py with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

from hal.conformance.poison import filled_empties
from tests.cuda._support import assert_close, fresh_seed

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="run by tests/cuda/test_interpreter.py with TRITON_INTERPRET=1"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # NumPy's "invalid value" inside the interpreter
]

if os.environ.get("TRITON_INTERPRET") == "1":
    from hal_backend_cuda.launch import TABLES as CUDA_TABLES
    from hal_backend_rocm.launch import RocmTables
    from hal_triton import norm as triton_norm
    from hal_triton.config import NormBwdConfig, next_pow2
    from hal_triton.tables import INTERPRETER

#: the shapes the tables are asked about (those of benchmarks/norm_backward_bw.py)
TABLE_SHAPES = (((32768, 4096), torch.bfloat16), ((16384, 8192), torch.bfloat16), ((8192, 2048), torch.bfloat16),
                ((16384, 4096), torch.float32))
#: (x shape, normalised length): rows not a multiple of 2 or 4 blocks nor of 3 programs, lengths not powers of two
SHAPES = (((37, 20), 20), ((5, 3, 24), 24), ((11, 32), 32))
PROGRAMS = (1, 3, 64)
JUNK = -7777.0


def table_candidates() -> list["NormBwdConfig"]:
    """Every candidate of the CUDA and ROCm tables at the table shapes, and the interpreter's."""
    out = list(INTERPRETER.norm_backward(20))
    for shape, dtype in TABLE_SHAPES:
        x = torch.empty(shape, dtype=dtype, device="meta")
        for tables in (CUDA_TABLES, RocmTables("gfx90a"), RocmTables("gfx942")):
            out += tables.norm_backward_candidates(x, shape[-1])
    return out


def structures() -> list[tuple[int, bool, tuple]]:
    """What of a candidate changes the kernel at a small size: (rows per block, prefetch, options)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return []
    return sorted({(c.block_m, c.prefetch, c.options) for c in table_candidates()})


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(fresh_seed())


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, shift: float = 0.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float64) + shift).to(dtype)


def poisoned_allocations():
    """torch.empty / torch.empty_like fill what they return with junk while inside: an element a
    kernel leaves unwritten (grad_x, a partial row) shows."""
    return filled_empties(lambda t: t.fill_(JUNK) if t.is_floating_point() else t)


def reference(g: torch.Tensor, x: torch.Tensor, n: int, weight: Optional[torch.Tensor], eps: float, rms: bool) -> tuple:
    """(grad_x, grad_weight, grad_bias) by torch's autograd in float64; a weight of ones without one
    (grad_bias None for rms_norm)."""
    x64 = x.double().requires_grad_(True)
    w64 = (weight.double() if weight is not None else torch.ones(n, dtype=torch.float64)).requires_grad_(True)
    b64 = torch.zeros(n, dtype=torch.float64, requires_grad=True)
    if rms:
        y = F.rms_norm(x64, (n,), w64, eps)
        inputs = (x64, w64)
    else:
        y = F.layer_norm(x64, (n,), w64, b64, eps)
        inputs = (x64, w64, b64)
    grads = torch.autograd.grad(y, inputs, g.double())
    return grads if not rms else (*grads, None)


def run(g: torch.Tensor, x: torch.Tensor, n: int, weight: Optional[torch.Tensor], eps: float, rms: bool, cfg: "NormBwdConfig") -> tuple:
    with poisoned_allocations():
        return triton_norm.norm_backward(g, x, n, weight, eps, rms, **vars(cfg))


def config(structure: tuple[int, bool, tuple], n: int, programs: int) -> "NormBwdConfig":
    """The candidate's kernel at row length n (a block of the whole row: the tile kernel)."""
    block_m, prefetch, options = structure
    return NormBwdConfig(block_m, next_pow2(n), 4, programs, prefetch, options)


def op_args(g: torch.Tensor, x: torch.Tensor, n: int, weight: Optional[torch.Tensor], eps: float) -> tuple:
    return (g, x, (n,), weight, eps)


def structure_id(s: tuple[int, bool, tuple]) -> str:
    return f"rows{s[0]}" + ("-prefetch" if s[1] else "") + "".join(f"-{k}{v}" for k, v in s[2])


@pytest.mark.parametrize("structure", structures(), ids=structure_id)
@pytest.mark.parametrize("programs", PROGRAMS)
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("shape,n", SHAPES)
def test_every_candidate_matches_torch(gen, structure, programs, rms, shape, n):
    dtype = torch.bfloat16 if programs == 3 else torch.float32
    op = "rms_norm_backward" if rms else "layer_norm_backward"
    eps = 1e-6 if rms else 1e-5
    x = randn(gen, *shape, dtype=dtype, shift=0.5)
    g = randn(gen, *shape, dtype=dtype)
    cfg = config(structure, n, programs)
    for weight in (randn(gen, n, dtype=dtype), None):
        got = run(g, x, n, weight, eps, rms, cfg)
        want = reference(g, x, n, weight, eps, rms)
        args = op_args(g, x, n, weight, eps)
        assert_close(op, got[0], want[0], args, what="grad_x")
        assert_close(op, got[1], want[1], args, what="grad_weight")
        if rms:
            assert got[2] is None
        else:
            assert_close(op, got[2], want[2], args, what="grad_bias")


@pytest.mark.parametrize("structure", structures(), ids=structure_id)
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_nan_and_inf_propagate_as_torchs(gen, structure, rms):
    """A NaN in one row of x, an infinity in another row of grad_out: the gradients are non-finite
    exactly where torch's are, NaN throughout the NaN row's grad_x and grad_weight, as torch's; the
    other rows of grad_x and grad_bias right. (In the infinity's row an element may come out as
    an infinity where torch's differently ordered sums give NaN: neither is a number.)"""
    m, n = 13, 24
    x = randn(gen, m, n, dtype=torch.float32, shift=0.5)
    g = randn(gen, m, n, dtype=torch.float32)
    x[3, 5] = float("nan")
    g[8, 17] = float("inf")
    w = randn(gen, n, dtype=torch.float32)
    got = run(g, x, n, w, 1e-5, rms, config(structure, n, 3))
    want = reference(g, x, n, w, 1e-5, rms)
    assert torch.isnan(got[0][3]).all() and torch.isnan(got[1]).all(), "the NaN row's gradients are NaN, as torch's"
    for name, a, b in zip(("grad_x", "grad_weight", "grad_bias"), got, want):
        if b is None:
            continue
        assert torch.equal(torch.isfinite(a), torch.isfinite(b)), f"{name}: non-finite elsewhere than torch's"
        finite = torch.isfinite(b)
        torch.testing.assert_close(a[finite].double(), b[finite], rtol=1e-4, atol=1e-5)
