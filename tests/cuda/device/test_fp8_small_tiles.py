"""On a GPU with FP8: the per-tensor Triton casts of hal_triton on small and batched arrays whose
rows are shorter than a tile (K 9 or 12 against 16 columns), where the conformance suite found
fp8_quantize_transpose_amax's hardware cast writing wrong codes on an H100 (at 66d0b65: the
``batched`` (3, 20, 9) and ``noncontig`` (6, 9, 12) cases, every input dtype, right signs, wrong
magnitudes in 13-40% of the elements), while the 2-D and the wide batched cases passed.

Two tests:

* the dispatched kernels (what hal.ops runs) equal cpu_ref bit for bit over a grid of such shapes,
  plain and transposed, given scales, current scales and the fused amax;
* a probe over the same grid with each cast forced, the hardware one also where ``hal_triton.fp8``
  keeps launches off it (``-s`` prints how many codes each cast gets wrong per configuration): the
  emulated cast must get none; the counts of the hardware cast are the evidence for which launches
  ``hal_triton.fp8`` keeps off it (``_EMULATE_BATCHED_TRANSPOSE``, ``_EMULATE_TRANSPOSE_BELOW_K``).

Skipped without a CUDA device (CI); run on the device machine:
``pytest -q -s tests/cuda/device/test_fp8_small_tiles.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.cuda._support import assert_bits, fresh_seed
from tests.cuda.device._fp8 import DEV, formats, kern

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

if torch.cuda.is_available():
    from hal_backend_cpu_ref import fp8 as ref
    from hal_triton import fp8 as f8

#: (shape, dtype): rows shorter than a tile's 16 columns, batched and not, and wider controls
SHAPES = [((3, 20, 9), torch.float32), ((6, 9, 12), torch.bfloat16), ((60, 9), torch.float16), ((20, 9), torch.float32),
          ((2, 7, 33), torch.bfloat16), ((4, 64, 16), torch.float16), ((5, 130, 24), torch.float32), ((12, 40), torch.bfloat16)]

#: (name, op, arguments after x): the per-tensor casts
CASTS = [("given", "fp8_quantize", lambda s, f: (f, "tensor", s, 128)),
         ("current", "fp8_quantize", lambda s, f: (f, "tensor", None, 128)),
         ("amax", "fp8_quantize_amax", lambda s, f: (s, f))]


def _fmt() -> str:
    have = formats()
    if not have:
        pytest.skip("this GPU has no FP8 format")
    return have[0]


def _want(kind: str, x: torch.Tensor, scale: torch.Tensor, fmt: str, transpose: bool):
    xs = x.float().cpu().numpy()
    with np.errstate(all="ignore"):
        if kind == "amax":
            fn = ref.fp8_quantize_transpose_amax if transpose else ref.fp8_quantize_amax
            return fn(xs, scale.cpu().numpy(), fmt)
        fn = ref.fp8_quantize_transpose if transpose else ref.fp8_quantize
        return fn(xs, fmt, "tensor", scale.cpu().numpy() if kind == "given" else None, 128)


def _forced(kind: str, x: torch.Tensor, scale: torch.Tensor, fmt: str, transpose: bool, hw: bool):
    if kind == "amax":
        return f8.quantize_amax(x, fmt, scale, transpose, hw, 1024, 4)
    return f8.quantize(x, fmt, "tensor", scale if kind == "given" else None, 128, transpose, hw, 1024, 4)


def _wrong(got, want) -> list[int]:
    return [int((g.cpu() != torch.from_numpy(np.array(w))).sum()) for g, w in zip(got, want) if g.dtype == torch.uint8]


@pytest.mark.parametrize("transpose", [False, True], ids=["plain", "transposed"])
@pytest.mark.parametrize("kind", [c[0] for c in CASTS])
def test_dispatched_casts_bit_for_bit_on_short_rows(kind: str, transpose: bool) -> None:
    fmt = _fmt()
    gen = torch.Generator().manual_seed(fresh_seed())
    name, op, args = next(c for c in CASTS if c[0] == kind)
    if transpose:
        op = op.replace("fp8_quantize", "fp8_quantize_transpose")
    for shape, dtype in SHAPES:
        x = (torch.randn(shape, generator=gen) * 5.0).to(dtype).to(DEV)
        scale = (torch.rand((), generator=gen) * 0.05 + 1e-3).to(DEV)
        torch.full((1 << 20,), 0x7E, dtype=torch.uint8, device=DEV)  # poison what the allocator hands out next
        got = kern(op)(x, *args(scale, fmt))
        torch.cuda.synchronize()
        want = _want(kind, x, scale, fmt, transpose)
        for g, w in zip(got, want):
            assert_bits(g, w, f"{op} {fmt} {shape} {dtype}")


def test_probe_each_cast_on_short_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(f8, "_EMULATE_BATCHED_TRANSPOSE", False)  # the hardware cast where hw=True, everywhere
    monkeypatch.setattr(f8, "_EMULATE_TRANSPOSE_BELOW_K", 0)
    fmt = _fmt()
    gen = torch.Generator().manual_seed(0)
    emulated_wrong = []
    for kind, _, _ in CASTS:
        for transpose in (False, True):
            for shape, dtype in SHAPES:
                x = (torch.randn(shape, generator=gen) * 5.0).to(dtype).to(DEV)
                scale = (torch.rand((), generator=gen) * 0.05 + 1e-3).to(DEV)
                want = _want(kind, x, scale, fmt, transpose)
                counts = {}
                for hw in (True, False):
                    torch.full((1 << 20,), 0x7E, dtype=torch.uint8, device=DEV)
                    counts[hw] = _wrong(_forced(kind, x, scale, fmt, transpose, hw), want)
                print(f"{kind:8s} transpose={transpose!s:5s} {str(shape):14s} {str(dtype):15s} hardware {counts[True]} emulated {counts[False]}")
                if any(counts[False]):
                    emulated_wrong.append((kind, transpose, shape, counts[False]))
    assert not emulated_wrong, emulated_wrong
