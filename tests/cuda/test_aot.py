"""Every Triton kernel of hal_triton compiles ahead of time, with no GPU, for sm_80, sm_90 (the
CUDA plugin) and gfx90a (the ROCm plugin reuses the sources); the FP8 variants for the architectures with
those formats (sm_90: e4m3fn, e5m2; gfx942: the fnuz formats)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402

from hal_triton import aot  # noqa: E402

TARGETS = {"sm_80": GPUTarget("cuda", 80, 32), "sm_90": GPUTarget("cuda", 90, 32), "gfx90a": GPUTarget("hip", "gfx90a", 64),
           "gfx942": GPUTarget("hip", "gfx942", 64)}
SPECS = aot.specs()
#: where each kind of variant compiles: FP8 hardware casts and tensor-core GEMMs only for the
#: architectures with those formats (e4m3fn on sm_80, or fnuz on NVIDIA, does not lower)
FP8_TARGETS = {"": ("sm_80", "sm_90", "gfx90a"), "ocp": ("sm_90",), "fnuz": ("gfx942",)}
PAIRS = [(spec, target) for spec in SPECS for target in FP8_TARGETS[spec.fp8]]


def test_every_kernel_has_a_compile_spec() -> None:
    covered = {(s.family, s.kernel) for s in SPECS}
    assert aot.kernel_names() - covered == set(), "kernels without an AOT spec in kits/triton/aot.py"
    assert covered - aot.kernel_names() == set(), "specs naming kernels that do not exist"


@pytest.mark.parametrize("spec,target", PAIRS, ids=[f"{s.id}-{t}" for s, t in PAIRS])
def test_compiles(spec: aot.Spec, target: str) -> None:
    compiled = spec.compile(TARGETS[target])
    binary = "hsaco" if target.startswith("gfx") else "cubin"
    assert compiled.asm.get(binary), f"{spec.id} produced no {binary} for {target}"
    if target == "sm_90" and dict(spec.params).get("MMA") in (0, 1):  # tensor-core GEMM tiles
        assert "wgmma" in compiled.asm["ptx"], f"{spec.id}: no Hopper warpgroup MMA in the sm_90 PTX"


#: streaming kernels whose sizes and strides Triton keeps specialised, so that sizes divisible by 16
#: give 16-byte accesses (with those arguments unspecialised every access was scalar: measured
#: 45% and 24-29% of the H200's copy bandwidth for swiglu and cross_entropy on 2026-12-01, 99% and
#: 44-56% once specialised, 2026-12-02; the rotary kernel, unspecialised, 36%)
VECTORISED = ("swiglu_kernel", "swiglu_bwd_kernel", "ce_forward_kernel", "ce_backward_kernel", "rotary_kernel",
              # the multi-tensor kernels read their tensors' addresses from a table: vector accesses
              # only in the ALIGNED launches, where the host vouched for the alignment (scalar in all
              # before 2026-12-07; fused AdamW at 70% of the H200's copy bandwidth)
              "adamw_kernel", "unscale_kernel")


def _vectorisable(spec: aot.Spec) -> bool:
    if spec.family == "batchnorm":
        # along the channels of channels_last (ResNet's layout) once C and every stride are
        # specialised (scalar in all before 2026-12-08); NCHW tiles stay scalar where a chunk's
        # first position is not provably aligned
        return "channels-last" in spec.variant
    if "launch candidate" in spec.variant:
        # the transposed FP8 casts' tiles (hal_triton.aot.FP8_TRANSPOSE_TILES): 16-byte loads of x and
        # stores of q and q_t in every tile (today's 64 x 64 had them and reached 0.48 of an H100's
        # copy bandwidth on 2026-12-07: the candidates change the tile, and must keep the vectors);
        # the fnuz ones compile for gfx942 only
        return spec.fp8 != "fnuz"
    return spec.kernel in VECTORISED and dict(spec.params).get("ALIGNED", True)


@pytest.mark.parametrize("spec", [s for s in SPECS if _vectorisable(s)], ids=lambda s: s.id)
def test_streaming_kernels_issue_vector_loads(spec: aot.Spec) -> None:
    import re

    assert not set(spec.div16) & _unspecialised(spec), f"{spec.id}: the spec assumes 16 divides an argument the JIT never specialises"
    ptx = spec.compile(TARGETS["sm_90"]).asm["ptx"]
    assert re.search(r"ld\.global(\.\w+)*\.v[248]\.", ptx), f"{spec.id}: no vector load in the sm_90 PTX"
    if spec.kernel == "fp8_encode_kernel":
        assert re.search(r"st\.global(\.\w+)*\.v[248]\.", ptx), f"{spec.id}: no vector store in the sm_90 PTX"


def _unspecialised(spec: aot.Spec) -> set[str]:
    """The arguments the kernel's @triton.jit(do_not_specialize=...) names."""
    import importlib

    fn = getattr(importlib.import_module(f"hal_triton.{spec.family}"), spec.kernel)
    return {fn.arg_names[i] if isinstance(i, int) else i for i in getattr(fn, "do_not_specialize", ())}


#: the instructions of the FP8 variants: NVIDIA's saturating round-to-nearest conversion and
#: Hopper's FP8 warpgroup MMA; gfx942's packed FP8 / BF8 conversions and FP8 MFMA
FP8_NAMES = {0: "e4m3", 1: "e5m2", 2: "fp8", 3: "bf8"}


@pytest.mark.parametrize("spec", [s for s in SPECS if s.fp8], ids=lambda s: s.id)
def test_fp8_variants_use_the_hardware_fp8_instructions(spec: aot.Spec) -> None:
    import re

    params = dict(spec.params)
    if spec.fp8 == "ocp":
        ptx = spec.compile(TARGETS["sm_90"]).asm["ptx"]
        if spec.kernel == "fp8_gemm_kernel":
            a, b = FP8_NAMES[params["A_FMT"]], FP8_NAMES[params["B_FMT"]]
            assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.{a}\.{b}", ptx), f"{spec.id}: no FP8 wgmma"
        else:
            assert f"cvt.rn.satfinite.{FP8_NAMES[params['FMT']]}x2.f32" in ptx, f"{spec.id}: no saturating FP8 conversion"
    else:
        amdgcn = spec.compile(TARGETS["gfx942"]).asm["amdgcn"]
        if spec.kernel == "fp8_gemm_kernel":
            a, b = FP8_NAMES[params["A_FMT"]], FP8_NAMES[params["B_FMT"]]
            # the MFMA names its operands in either order (Triton may multiply the transposed tiles)
            assert re.search(rf"v_mfma_f32_\w+_({a}_{b}|{b}_{a})\b", amdgcn), f"{spec.id}: no FP8 MFMA"
        else:
            assert f"v_cvt_pk_{FP8_NAMES[params['FMT']]}_f32" in amdgcn, f"{spec.id}: no packed FP8 conversion"
