"""Every Triton kernel of hal_triton compiles ahead of time, with no GPU, for sm_80, sm_90 (the
CUDA plugin) and gfx90a (the ROCm plugin reuses the sources)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402

from hal_triton import aot  # noqa: E402

TARGETS = {"sm_80": GPUTarget("cuda", 80, 32), "sm_90": GPUTarget("cuda", 90, 32), "gfx90a": GPUTarget("hip", "gfx90a", 64)}
SPECS = aot.specs()


def test_every_kernel_has_a_compile_spec() -> None:
    covered = {(s.family, s.kernel) for s in SPECS}
    assert aot.kernel_names() - covered == set(), "kernels without an AOT spec in kits/triton/aot.py"
    assert covered - aot.kernel_names() == set(), "specs naming kernels that do not exist"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("spec", SPECS, ids=[s.id for s in SPECS])
def test_compiles(spec: aot.Spec, target: str) -> None:
    compiled = spec.compile(TARGETS[target])
    binary = "hsaco" if target == "gfx90a" else "cubin"
    assert compiled.asm.get(binary), f"{spec.id} produced no {binary} for {target}"
    if target == "sm_90" and dict(spec.params).get("MMA") in (0, 1):  # tensor-core GEMM tiles
        assert "wgmma" in compiled.asm["ptx"], f"{spec.id}: no Hopper warpgroup MMA in the sm_90 PTX"


#: streaming kernels whose sizes and strides Triton keeps specialised, so that sizes divisible by 16
#: give 16-byte accesses (with those arguments unspecialised every access was scalar: measured
#: 45% and 24-29% of the H200's copy bandwidth for swiglu and cross_entropy on 2026-12-01, 99% and
#: 44-56% once specialised, 2026-12-02; the rotary kernel, unspecialised, 36%)
VECTORISED = ("swiglu_kernel", "swiglu_bwd_kernel", "ce_forward_kernel", "ce_backward_kernel", "rotary_kernel")


@pytest.mark.parametrize("spec", [s for s in SPECS if s.kernel in VECTORISED], ids=lambda s: s.id)
def test_streaming_kernels_issue_vector_loads(spec: aot.Spec) -> None:
    import re

    assert not set(spec.div16) & _unspecialised(spec), f"{spec.id}: the spec assumes 16 divides an argument the JIT never specialises"
    ptx = spec.compile(TARGETS["sm_90"]).asm["ptx"]
    assert re.search(r"ld\.global(\.\w+)*\.v[248]\.", ptx), f"{spec.id}: no vector load in the sm_90 PTX"


def _unspecialised(spec: aot.Spec) -> set[str]:
    """The arguments the kernel's @triton.jit(do_not_specialize=...) names."""
    import importlib

    fn = getattr(importlib.import_module(f"hal_triton.{spec.family}"), spec.kernel)
    return {fn.arg_names[i] if isinstance(i, int) else i for i in getattr(fn, "do_not_specialize", ())}
