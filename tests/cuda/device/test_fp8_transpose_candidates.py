"""On a GPU with FP8: every launch candidate the vendor plugin's tables offer the transposed FP8 casts
(``fp8_transpose_candidates``), with the hardware cast wherever the mode uses it, writes the codes,
transposes, scales and amax of the emulated cast of today's launch bit for bit, over ragged shapes
(neither side a multiple of a tile), each input dtype and every format this GPU has, outputs
poisoned first; a failure lists every launch, shape and output that differed (today's launch
included: on an H100 at 7fc0fa7 the dispatched transposed casts failed tests/cuda/device/
test_fp8_small_tiles.py on shapes not yet named, so today's tile may show here too). The
interpreter checks the same tiles with the emulated cast
(tests/cuda/interpreted/test_fp8_transpose_candidates.py); the hardware cast has given wrong codes
in some launches before (hal_triton.fp8's ``_EMULATED_MODES``, ``_EMULATE_BATCHED_TRANSPOSE``), so
the tiles the autotuner may pick are checked with it here.

Skipped without a CUDA device (CI); run on the device machine:
``pytest -q tests/cuda/device/test_fp8_transpose_candidates.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.cuda.device._fp8 import DEV, poison

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

if torch.cuda.is_available():
    from hal_triton import fp8 as f8

    if getattr(torch.version, "hip", None):
        from hal_backend_rocm.launch import TABLES
    else:
        from hal_backend_cuda.launch import TABLES

#: ragged 2-D shapes (the transposed per-tensor casts of batched arrays keep the emulated cast)
SHAPES = [((67, 130), torch.bfloat16), ((130, 67), torch.float16), ((257, 300), torch.float32), ((1000, 1030), torch.bfloat16)]
#: (name, host function call with hw and pick): the modes that use the hardware cast, then row-wise scaling
CASTS = {
    "tensor current": lambda x, f, s, hw, p: f8.quantize(x, f, "tensor", None, 128, True, hw, **TABLES.elementwise(x), pick=p),
    "tensor given": lambda x, f, s, hw, p: f8.quantize(x, f, "tensor", s, 128, True, hw, **TABLES.elementwise(x), pick=p),
    "tensor amax": lambda x, f, s, hw, p: f8.quantize_amax(x, f, s, True, hw, **TABLES.elementwise(x), pick=p),
    "from amax": lambda x, f, s, hw, p: f8.quantize_from_amax(x, f, x.float().abs().amax(), True, hw, **TABLES.elementwise(x), pick=p),
    "rows current": lambda x, f, s, hw, p: f8.quantize(x, f, "row", None, 128, True, hw, **TABLES.elementwise(x), pick=p),
}


def _candidates() -> tuple:
    """The tables' candidates at Llama-3-8B's (4096, 4096) bf16 (every tile they offer)."""
    return TABLES.fp8_transpose_candidates(torch.empty(4096, 4096, dtype=torch.bfloat16, device=DEV), 4096, 4096)


@pytest.mark.parametrize("mode", list(CASTS))
def test_every_candidate_with_the_hardware_cast_writes_todays_codes(fmts: list[str], gen: torch.Generator, mode: str) -> None:
    cast = CASTS[mode]
    cands = _candidates()
    assert len(cands) > 1
    bad: list[str] = []
    for i, (shape, dtype) in enumerate(SHAPES):
        fmt = fmts[i % len(fmts)]
        x = (torch.randn(shape, generator=gen) * torch.exp(2.0 * torch.randn(shape, generator=gen))).to(dtype).to(DEV)
        scale = (torch.rand((), generator=gen) * 0.05 + 1e-3).to(DEV)
        want = [w.cpu() for w in cast(x, fmt, scale, False, None)]  # the emulated cast, today's launch
        for j, cfg in enumerate(cands):
            poison()
            got = cast(x, fmt, scale, True, lambda key, run, nbytes, cfg=cfg: cfg)
            torch.cuda.synchronize()
            for g, w, what in zip(got, want, ("q", "scale", "q_t", "scale_t or amax")):
                wrong = int((~((g.cpu() == w) | (g.cpu().isnan() & w.isnan())) if w.is_floating_point() else g.cpu() != w).sum())
                if wrong:
                    bad.append(f"{'(the 8B default) ' if j == 0 else ''}{cfg.block_r}x{cfg.block_c}/{cfg.num_warps} {fmt} {shape} {dtype} {what}: "
                               f"{wrong} of {w.numel()}")
        print(f"{mode} {shape} {dtype} {fmt}: {len(cands)} launches checked")
    assert not bad, "codes unlike the emulated cast's (every launch listed):\n" + "\n".join(bad)
