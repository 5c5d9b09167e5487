"""Every Triton kernel of hal.triton compiles ahead of time, with no GPU, for sm_80, sm_90 (the
CUDA plugin) and gfx90a (the ROCm plugin reuses the sources)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402

from hal.triton import aot  # noqa: E402

TARGETS = {"sm_80": GPUTarget("cuda", 80, 32), "sm_90": GPUTarget("cuda", 90, 32), "gfx90a": GPUTarget("hip", "gfx90a", 64)}
SPECS = aot.specs()


def test_every_kernel_has_a_compile_spec() -> None:
    covered = {(s.family, s.kernel) for s in SPECS}
    assert aot.kernel_names() - covered == set(), "kernels without an AOT spec in hal/triton/aot.py"
    assert covered - aot.kernel_names() == set(), "specs naming kernels that do not exist"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("spec", SPECS, ids=[s.id for s in SPECS])
def test_compiles(spec: aot.Spec, target: str) -> None:
    compiled = spec.compile(TARGETS[target])
    binary = "hsaco" if target == "gfx90a" else "cubin"
    assert compiled.asm.get(binary), f"{spec.id} produced no {binary} for {target}"
    if target == "sm_90" and dict(spec.params).get("MMA") in (0, 1):  # tensor-core GEMM tiles
        assert "wgmma" in compiled.asm["ptx"], f"{spec.id}: no Hopper warpgroup MMA in the sm_90 PTX"
