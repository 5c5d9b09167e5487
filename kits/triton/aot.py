"""Ahead-of-time compilation of every hal_triton kernel, with no GPU: a representative signature per
kernel (and per major variant), compiled for a target such as ``GPUTarget("cuda", 90, 32)`` or
``GPUTarget("hip", "gfx90a", 64)``. CI uses it to prove the sources build for sm_80, sm_90 and
gfx90a; a vendor plugin can use it to warm a cache.

A signature maps each parameter to a Triton type string ("*bf16" a pointer, "i32", "fp32") or, for
a compile-time constant, to its value.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Iterator

import triton
import triton.language as tl

from .kernels import FAMILIES

_TYPES = ("i1", "i8", "i16", "i32", "i64", "u8", "u32", "u64", "fp16", "bf16", "fp32", "fp64")


def _is_type(v: Any) -> bool:
    return isinstance(v, str) and (v.startswith("*") or v in _TYPES)


@dataclasses.dataclass(frozen=True)
class Spec:
    """One kernel variant to compile."""

    family: str
    kernel: str
    variant: str
    params: tuple[tuple[str, Any], ...]
    options: tuple[tuple[str, Any], ...] = ()
    #: integer parameters known to be multiples of 16 (pointers always are: torch allocations
    #: are aligned, and Triton's JIT specialises the same way at run time)
    div16: tuple[str, ...] = ()
    #: the hardware FP8 formats the variant compiles to ("ocp": NVIDIA sm_89+, "fnuz": AMD gfx942;
    #: "" for none): such variants are compiled for those targets only
    fp8: str = ""

    @property
    def id(self) -> str:
        return f"{self.family}.{self.kernel}[{self.variant}]"

    def source(self) -> Any:
        from triton.compiler import ASTSource

        fn = getattr(importlib.import_module(f"hal_triton.{self.family}"), self.kernel)
        signature = {name: (v if _is_type(v) else "constexpr") for name, v in self.params}
        constexprs = {name: v for name, v in self.params if not _is_type(v)}
        attrs = {
            (fn.arg_names.index(name),): [["tt.divisibility", 16]]
            for name, v in self.params
            if _is_type(v) and (v.startswith("*") or name in self.div16)
        }
        return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)

    def compile(self, target: Any) -> Any:
        """The compiled kernel for ``target`` (its ``asm`` holds ptx/cubin or amdgcn/hsaco)."""
        options = {"enable_fp_fusion": True, **dict(self.options)}
        return triton.compile(self.source(), target=target, options=options)


def _spec(family: str, kernel: str, variant: str, options: dict[str, Any] | None = None, div16: tuple[str, ...] = (), fp8: str = "",
          **params: Any) -> Spec:
    return Spec(family, kernel, variant, tuple(params.items()), tuple((options or {}).items()), div16, fp8)


def _ints(*names: str) -> dict[str, str]:
    return {n: "i32" for n in names}


F32 = tl.float32


def _elementwise() -> Iterator[Spec]:
    common = dict(
        **_ints("R", "C", "n_col_blocks", "D1", "D2", "ss0", "ss1", "ss2", "ss3", "hs0", "hs1", "hs2", "hs3"),
        ACT=2, BLOCK_R=4, BLOCK_C=256, COMPUTE=F32,
    )
    yield _spec("elementwise", "affine_act_kernel", "bf16 tensor scale, bias", x_ptr="*bf16", out_ptr="*bf16", scale_ptr="*fp32",
                shift_ptr="*bf16", scale_val="fp32", shift_val="fp32", SCALE_TENSOR=1, SHIFT_TENSOR=2, **common)
    yield _spec("elementwise", "affine_act_backward_kernel", "fp16 scalars", g_ptr="*fp16", x_ptr="*fp16", gx_ptr="*fp16",
                dz_ptr="*fp32", part_ptr="*fp32", scale_ptr="*fp16", shift_ptr="*fp16", scale_val="fp32", shift_val="fp32",
                SCALE_TENSOR=0, SHIFT_TENSOR=0, WRITE_DZ=False, PARTIALS=True, **common)


def _norm() -> Iterator[Spec]:
    for rms in (False, True):
        v = "rms" if rms else "layer"
        yield _spec("norm", "norm_fwd_tile_kernel", v, x_ptr="*bf16", w_ptr="*bf16", b_ptr="*bf16", y_ptr="*bf16", amax_ptr="*bf16",
                    **_ints("M", "N"), eps="fp32", eps_lo="fp32", HAS_W=True, HAS_B=not rms, RMS=rms, BLOCK_M=1, BLOCK_N=4096, COMPUTE=F32,
                    AMAX=False)
        # the backward's default launch, and the prefetching candidates of the plugins' tables: one row
        # over 8 warps (NVIDIA, at most 128 registers a thread; AMD launches 4 waves and no such
        # option), two rows over 16 warps
        bwd = dict(div16=("N",), g_ptr="*bf16", x_ptr="*bf16", w_ptr="*bf16", dx_ptr="*bf16", part_ptr="*fp32", **_ints("M", "N"), eps="fp32",
                   eps_lo="fp32", HAS_W=True, RMS=rms, BLOCK_N=4096, COMPUTE=F32)
        yield _spec("norm", "norm_bwd_tile_kernel", v, options={"num_warps": 8}, BLOCK_M=1, PREFETCH=False, **bwd)
        yield _spec("norm", "norm_bwd_tile_kernel", f"{v}, prefetch", options={"num_warps": 8, "maxnreg": 128}, BLOCK_M=1,
                    PREFETCH=True, **bwd)
        yield _spec("norm", "norm_bwd_tile_kernel", f"{v}, prefetch, 2 rows, 16 warps", options={"num_warps": 16}, BLOCK_M=2,
                    PREFETCH=True, **bwd)
    # rms_norm_amax: the amax of y (as written) atomically maxed into an int32 word
    yield _spec("norm", "norm_fwd_tile_kernel", "rms, amax", x_ptr="*bf16", w_ptr="*bf16", b_ptr="*bf16", y_ptr="*bf16", amax_ptr="*i32",
                **_ints("M", "N"), eps="fp32", eps_lo="fp32", HAS_W=True, HAS_B=False, RMS=True, BLOCK_M=1, BLOCK_N=4096, COMPUTE=F32,
                AMAX=True)
    yield _spec("norm", "norm_fwd_loop_kernel", "fp32", x_ptr="*fp32", w_ptr="*fp32", b_ptr="*fp32", y_ptr="*fp32", amax_ptr="*fp32",
                N="i32", eps="fp32", eps_lo="fp32", HAS_W=True, HAS_B=True, RMS=False, BLOCK_N=2048, COMPUTE=F32, AMAX=False)
    yield _spec("norm", "norm_fwd_loop_kernel", "fp32 rms, amax", x_ptr="*fp32", w_ptr="*fp32", b_ptr="*fp32", y_ptr="*fp32",
                amax_ptr="*i32", N="i32", eps="fp32", eps_lo="fp32", HAS_W=True, HAS_B=False, RMS=True, BLOCK_N=2048, COMPUTE=F32, AMAX=True)
    for rms in (False, True):  # rms_norm's loop writes no bias partials
        yield _spec("norm", "norm_bwd_loop_kernel", "fp32 rms" if rms else "fp32", g_ptr="*fp32", x_ptr="*fp32", w_ptr="*fp32",
                    dx_ptr="*fp32", part_ptr="*fp32", **_ints("M", "N"), eps="fp32", eps_lo="fp32", HAS_W=True, RMS=rms, BLOCK_N=2048,
                    COMPUTE=F32)


def _softmax() -> Iterator[Spec]:
    yield _spec("softmax", "softmax_rows_kernel", "bf16", x_ptr="*bf16", y_ptr="*bf16", **_ints("M", "N"),
                BLOCK_M=1, BLOCK_N=4096, COMPUTE=F32)
    yield _spec("softmax", "softmax_rows_loop_kernel", "fp16", x_ptr="*fp16", y_ptr="*fp16", N="i32", BLOCK_N=4096, COMPUTE=F32)
    yield _spec("softmax", "softmax_cols_kernel", "fp32", x_ptr="*fp32", y_ptr="*fp32", **_ints("D", "INNER", "n_inner_blocks"),
                BLOCK_I=256, COMPUTE=F32)
    yield _spec("softmax", "softmax_bwd_rows_kernel", "bf16", g_ptr="*bf16", y_ptr="*bf16", dx_ptr="*bf16", **_ints("M", "N"),
                BLOCK_M=1, BLOCK_N=4096, COMPUTE=F32)
    yield _spec("softmax", "softmax_bwd_rows_loop_kernel", "fp16", g_ptr="*fp16", y_ptr="*fp16", dx_ptr="*fp16", N="i32",
                BLOCK_N=4096, COMPUTE=F32)
    yield _spec("softmax", "softmax_bwd_cols_kernel", "fp32", g_ptr="*fp32", y_ptr="*fp32", dx_ptr="*fp32",
                **_ints("D", "INNER", "n_inner_blocks"), BLOCK_I=256, COMPUTE=F32)


def _batchnorm() -> Iterator[Spec]:
    grid = _ints("N", "C", "S", "sN", "sC", "sS", "n_per", "s_per", "n_sgroups", "n_cblocks")
    tile = _ints("C", "S", "sN", "sC", "sS", "n_cblocks", "n_sblocks")
    yield _spec("batchnorm", "bn_stats_kernel", "bf16", x_ptr="*bf16", part_ptr="*fp32", **grid, BLOCK_C=64, BLOCK_S=32, COMPUTE=F32)
    for update in (True, False):  # the forward updates the running statistics, the backward only reads them
        yield _spec("batchnorm", "bn_finalize_kernel", "training" + ("" if update else ", backward"), x_ptr="*bf16", part_ptr="*fp32",
                    vec_ptr="*fp32", w_ptr="*fp32", b_ptr="*fp32", rm_ptr="*fp32", rv_ptr="*fp32", cbias_ptr="*bf16",
                    **_ints("n_chunks", "C", "sC"), count="fp32", momentum_hi="fp32", momentum_lo="fp32", eps_hi="fp32", eps_lo="fp32",
                    TRAINING=True, UPDATE_RUNNING=update, HAS_W=True, HAS_B=True, HAS_CONV_BIAS=True, BLOCK_C=128, BLOCK_R=32, COMPUTE=F32)
    yield _spec("batchnorm", "bn_apply_kernel", "bf16 relu", x_ptr="*bf16", y_ptr="*bf16", vec_ptr="*fp32", **tile,
                RELU=True, BLOCK_C=64, BLOCK_S=32, COMPUTE=F32)
    yield _spec("batchnorm", "bn_bwd_reduce_kernel", "fp16 relu", g_ptr="*fp16", x_ptr="*fp16", part_ptr="*fp32", vec_ptr="*fp32",
                **grid, RELU=True, BLOCK_C=4, BLOCK_S=512, COMPUTE=F32)
    yield _spec("batchnorm", "bn_bwd_finalize_kernel", "training", part_ptr="*fp32", vec_ptr="*fp32", w_ptr="*fp32", gw_ptr="*fp32",
                gb_ptr="*fp32", **_ints("n_chunks", "C"), count="fp32", TRAINING=True, HAS_W=True, BLOCK_C=128, BLOCK_R=32, COMPUTE=F32)
    yield _spec("batchnorm", "bn_bwd_apply_kernel", "fp16 relu", g_ptr="*fp16", x_ptr="*fp16", dx_ptr="*fp16", vec_ptr="*fp32", **tile,
                RELU=True, BLOCK_C=4, BLOCK_S=512, COMPUTE=F32)
    # channels_last as ResNet's layers call them (C a multiple of 16, unit channel stride; CUDA's
    # tiles of hal_backend_cuda.launch): the accesses along the channels move 16 bytes each
    last = dict(sC=1, div16=("C", "S", "sN", "sS"))
    cl_grid = {**grid, **last}
    cl_tile = {**tile, **last}
    yield _spec("batchnorm", "bn_stats_kernel", "bf16 channels-last", x_ptr="*bf16", part_ptr="*fp32", **cl_grid,
                BLOCK_C=64, BLOCK_S=128, COMPUTE=F32, options={"num_warps": 8})
    yield _spec("batchnorm", "bn_apply_kernel", "bf16 relu channels-last", x_ptr="*bf16", y_ptr="*bf16", vec_ptr="*fp32", **cl_tile,
                RELU=True, BLOCK_C=64, BLOCK_S=32, COMPUTE=F32)
    yield _spec("batchnorm", "bn_bwd_reduce_kernel", "bf16 relu channels-last", g_ptr="*bf16", x_ptr="*bf16", part_ptr="*fp32",
                vec_ptr="*fp32", **cl_grid, RELU=True, BLOCK_C=64, BLOCK_S=128, COMPUTE=F32, options={"num_warps": 8})
    yield _spec("batchnorm", "bn_bwd_apply_kernel", "bf16 relu channels-last", g_ptr="*bf16", x_ptr="*bf16", dx_ptr="*bf16",
                vec_ptr="*fp32", **cl_tile, RELU=True, BLOCK_C=64, BLOCK_S=32, COMPUTE=F32)


def _gemms() -> Iterator[Spec]:
    yield _spec("grouped_gemm", "gg_setup_kernel", "i64 sizes", sizes_ptr="*i64", meta_ptr="*i32", G="i32", M="i32", BLOCK_M=128, BLOCK_G=256)
    mma = {"num_warps": 8, "num_stages": 4}
    # unit strides are compile-time 1 and sizes multiples of 16, as Triton's JIT specialises them
    div = ("meta_stride", "K", "N", "sxm", "swg", "swk", "sym", "sam", "sbn", "scm")
    yield _spec("grouped_gemm", "gg_forward_kernel", "bf16 128x128x64", options=mma, div16=div, x_ptr="*bf16", w_ptr="*bf16",
                y_ptr="*bf16", meta_ptr="*i32", **_ints("meta_stride", "G", "K", "N", "n_tiles_n", "sxm", "swg", "swk", "sym"),
                sxk=1, swn=1, syn=1, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, EVEN_K=True, MMA=0, ACC=F32, DOT_F32=False)
    yield _spec("grouped_gemm", "gg_weight_grad_kernel", "bf16 128x128x64", options=mma, div16=div, x_ptr="*bf16", dy_ptr="*bf16",
                dw_ptr="*bf16", meta_ptr="*i32", **_ints("meta_stride", "K", "N", "n_tiles_k", "n_tiles_n", "sxm", "sym", "swg", "swk"),
                sxk=1, syn=1, swn=1, BLOCK_K=128, BLOCK_N=128, BLOCK_R=64, MMA=0, ACC=F32, DOT_F32=False)
    gemm = dict(xs_val="fp32", ws_val="fp32", **_ints("M", "N", "K", "sam", "sbn", "scm", "act"), sak=1, sbk=1, scn=1,
                BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, EVEN_K=True, DOT_F32=False)
    yield _spec("gemm", "gemm_kernel", "bf16 bias+act", options=mma, div16=div, a_ptr="*bf16", b_ptr="*bf16", c_ptr="*bf16", bias_ptr="*bf16",
                xs_ptr="*bf16", ws_ptr="*bf16", HAS_BIAS=True, INT8=False, XS_TENSOR=False, WS_MODE=0, MMA=0, ACC=F32, COMPUTE=F32, **gemm)
    yield _spec("gemm", "gemm_kernel", "fp64 FMA", a_ptr="*fp64", b_ptr="*fp64", c_ptr="*fp64", bias_ptr="*fp64",
                xs_ptr="*fp64", ws_ptr="*fp64", HAS_BIAS=True, INT8=False, XS_TENSOR=False, WS_MODE=0, MMA=2,
                ACC=tl.float64, COMPUTE=tl.float64, **{**gemm, "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16})
    yield _spec("gemm", "gemm_kernel", "int8 dequant", options=mma, div16=div, a_ptr="*i8", b_ptr="*i8", c_ptr="*fp16", bias_ptr="*fp32",
                xs_ptr="*fp32", ws_ptr="*fp32", HAS_BIAS=True, INT8=True, XS_TENSOR=True, WS_MODE=2, MMA=1, ACC=tl.int32, COMPUTE=F32, **gemm)


def _optim() -> Iterator[Spec]:
    # bf16 params with masters: bf16 grads, or fp32 ones (bf16 copies of fp32 weights, hal.nn.weight_copies)
    for step_tensor, grads, aligned in ((False, tl.bfloat16, True), (True, tl.bfloat16, True), (True, F32, True), (True, tl.bfloat16, False)):
        variant = ("bf16 + masters" + (", fp32 grads" if grads is F32 else "") + (", device step" if step_tensor else "")
                   + ("" if aligned else ", unaligned"))
        yield _spec("optim", "adamw_kernel", variant, table_ptr="*i64",
                    prefix_ptr="*i64", T="i32", found_ptr="*fp32", inv_ptr="*fp32", inv_val="fp32", step_ptr="*fp32", lr="fp32",
                    decay="fp32", step_size="fp32", bc2_sqrt="fp32", beta1="fp32", beta2="fp32", eps="fp32", P_DT=tl.bfloat16,
                    G_DT=grads, S_DT=F32, HAS_MASTER=True, HAS_FOUND=True, INV_TENSOR=True, STEP_TENSOR=step_tensor, BLOCK=2048,
                    ITERS=8, COMPUTE=F32, ALIGNED=aligned)
    for aligned in (True, False):
        yield _spec("optim", "unscale_kernel", "fp16" + ("" if aligned else ", unaligned"), table_ptr="*i64", prefix_ptr="*i64", T="i32",
                    found_ptr="*fp32", inv_ptr="*fp32", inv_val="fp32", DT=tl.float16, INV_TENSOR=False, BLOCK=2048, ITERS=8, COMPUTE=F32,
                    ALIGNED=aligned)


def _quant() -> Iterator[Spec]:
    nofma = {"enable_fp_fusion": False}
    modes = dict(S_MODE=2, Z_MODE=2, PER_ROW=True, BLOCK_R=4, BLOCK_C=256)
    tile = _ints("R", "C", "n_col_blocks", "channels")
    qr = _ints("qmin", "qmax")
    yield _spec("quant", "quantize_kernel", "bf16 per-channel", options=nofma, x_ptr="*bf16", q_ptr="*i8", s_ptr="*fp32",
                z_ptr="*i32", s_val="fp32", z_val="fp32", **tile, **qr, **modes)
    yield _spec("quant", "dequantize_kernel", "u8 per-channel", options=nofma, q_ptr="*u8", out_ptr="*fp32", s_ptr="*fp32",
                z_ptr="*u8", s_val="fp32", z_val="fp32", **tile, **modes)
    yield _spec("quant", "fake_quantize_kernel", "fp16 per-tensor", options=nofma, x_ptr="*fp16", out_ptr="*fp16", s_ptr="*fp32",
                z_ptr="*fp32", s_val="fp32", z_val="fp32", **tile, **qr, S_MODE=0, Z_MODE=0, PER_ROW=False, BLOCK_R=1, BLOCK_C=1024)
    yield _spec("quant", "fake_quantize_bwd_kernel", "fp32 per-channel", options=nofma, g_ptr="*fp32", x_ptr="*fp32", dx_ptr="*fp32",
                s_ptr="*fp32", z_ptr="*i64", s_val="fp32", z_val="fp32", **tile, **qr, **modes)
    yield _spec("quant", "int32_dequant_kernel", "fp16 out", options=nofma, acc_ptr="*i32", out_ptr="*fp16", xs_ptr="*fp32",
                ws_ptr="*fp32", bias_ptr="*fp16", xs_val="fp32", ws_val="fp32", **_ints("R", "C", "n_col_blocks"),
                XS_MODE=1, WS_MODE=2, HAS_BIAS=True, BLOCK_R=8, BLOCK_C=128)


#: the transposed FP8 casts' launch candidates (block_r, block_c, num_warps) of the plugins' tables
#: (hal_backend_cuda.launch and hal_backend_rocm.launch: today's 64 x 64 elementwise tile first, then
#: their FP8_TRANSPOSE_TILES), by the hardware formats of each vendor's FP8 targets;
#: tests/cuda/test_fp8_transpose_tuning.py checks that every one the tables offer is here
FP8_TRANSPOSE_TILES = {"ocp": ((64, 64, 8), (64, 64, 4), (32, 128, 4), (64, 128, 4), (64, 128, 8), (128, 64, 8), (128, 128, 8)),
                       "fnuz": ((64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 8))}


def _fp8_transpose_candidates(encode: dict[str, Any], nofma: dict[str, Any]) -> Iterator[Spec]:
    """The transposed casts' launch candidates: each tile of each vendor in the per-tensor current
    cast (the hardware cast of its formats), the largest in every other transposed mode, and every
    tile in the amax pass of row-wise scaling (which takes the candidate's tile too)."""
    tiles = dict(encode, AMAX=False)
    for kind, fmt, fid in (("ocp", "e4m3fn", 0), ("fnuz", "e4m3fnuz", 2)):
        for r, c, w in FP8_TRANSPOSE_TILES[kind]:
            yield _spec("fp8", "fp8_encode_kernel", f"{fmt} bf16, tensor amax, transposed, launch candidate {r}x{c} {w} warps",
                        fp8=kind, x_ptr="*bf16", FMT=fid, SCALE=1, TRANSPOSE=True, HW=True,
                        **{**tiles, "options": {**nofma, "num_warps": w}, "BLOCK_R": r, "BLOCK_C": c})
    big = {**encode, "options": {**nofma, "num_warps": 8}, "BLOCK_R": 128, "BLOCK_C": 128}
    yield _spec("fp8", "fp8_encode_kernel", "e5m2 fp16, given tensor scale, transposed, launch candidate 128x128 8 warps", fp8="ocp",
                x_ptr="*fp16", FMT=1, SCALE=0, TRANSPOSE=True, HW=True, **{**big, "AMAX": False})
    yield _spec("fp8", "fp8_encode_kernel", "e4m3fn bf16, given tensor scale, amax, transposed, launch candidate 128x128 8 warps",
                fp8="ocp", x_ptr="*bf16", FMT=0, SCALE=0, TRANSPOSE=True, HW=True, **{**big, "AMAX": True})
    yield _spec("fp8", "fp8_encode_kernel", "emulated e4m3fn fp32, rows and columns, transposed, launch candidate 128x128 8 warps",
                x_ptr="*fp32", FMT=0, SCALE=3, TRANSPOSE=True, HW=False, **{**big, "AMAX": False})
    yield _spec("fp8", "fp8_encode_kernel", "emulated e5m2 bf16, given blocks, transposed, launch candidate 128x128 8 warps",
                x_ptr="*bf16", FMT=1, SCALE=4, TRANSPOSE=True, HW=False, **{**big, "AMAX": False})
    for r, c, w in dict.fromkeys(FP8_TRANSPOSE_TILES["ocp"] + FP8_TRANSPOSE_TILES["fnuz"]):
        yield _spec("fp8", "fp8_amax_kernel", f"rows and columns, launch candidate {r}x{c} {w} warps", options={"num_warps": w},
                    div16=("M", "K"), x_ptr="*bf16", amax_ptr="*i32", amaxt_ptr="*i32", **_ints("M", "K", "n_tm", "n_tk"), MODE=1,
                    BLOCK_R=r, BLOCK_C=c)


def _fp8() -> Iterator[Spec]:
    """The FP8 kernels: the hardware casts and FP8 tensor-core GEMMs of each vendor's formats (OCP
    e4m3fn / e5m2 for sm_90, fnuz for gfx942), and the emulated cast every target compiles."""
    nofma = {"enable_fp_fusion": False}
    tile = dict(**_ints("M", "K", "n_tm", "n_tk", "kb", "bs"))
    div = ("M", "K")
    yield _spec("fp8", "fp8_amax_kernel", "rows and columns", div16=div, x_ptr="*bf16", amax_ptr="*i32", amaxt_ptr="*i32",
                **_ints("M", "K", "n_tm", "n_tk"), MODE=1, BLOCK_R=16, BLOCK_C=256)
    encode = dict(options=nofma, div16=div, q_ptr="*u8", qt_ptr="*u8", s_ptr="*fp32", st_ptr="*fp32", amax_ptr="*i32",
                  amaxt_ptr="*i32", **tile, BLOCK_R=16, BLOCK_C=256)
    no_amax = dict(encode, AMAX=False)
    for fmt, fid, kind in (("e4m3fn", 0, "ocp"), ("e5m2", 1, "ocp"), ("e4m3fnuz", 2, "fnuz"), ("e5m2fnuz", 3, "fnuz")):
        yield _spec("fp8", "fp8_encode_kernel", f"{fmt} bf16, tensor amax, transposed", fp8=kind, x_ptr="*bf16", FMT=fid,
                    SCALE=1, TRANSPOSE=True, HW=True, **no_amax)
    yield _spec("fp8", "fp8_encode_kernel", "e4m3fn bf16, given tensor scale", fp8="ocp", x_ptr="*bf16", FMT=0, SCALE=0,
                TRANSPOSE=False, HW=True, **no_amax)
    for fmt, fid, kind in (("e4m3fn", 0, "ocp"), ("e4m3fnuz", 2, "fnuz")):  # delayed scaling: the amax reduced by the cast
        yield _spec("fp8", "fp8_encode_kernel", f"{fmt} bf16, given tensor scale, amax, transposed", fp8=kind, x_ptr="*bf16", FMT=fid,
                    SCALE=0, TRANSPOSE=True, HW=True, AMAX=True, **encode)
    yield _spec("fp8", "fp8_encode_kernel", "emulated e4m3fn fp32, given blocks", x_ptr="*fp32", FMT=0, SCALE=4, TRANSPOSE=False,
                HW=False, **no_amax)
    yield _spec("fp8", "fp8_encode_kernel", "emulated e4m3fnuz fp16, rows and columns", x_ptr="*fp16", FMT=2, SCALE=3, TRANSPOSE=True,
                HW=False, **no_amax)
    yield from _fp8_transpose_candidates(encode, nofma)
    yield _spec("fp8", "fp8_rows_kernel", "e4m3fn bf16, loop", options=nofma, fp8="ocp", div16=("K",), x_ptr="*bf16", q_ptr="*u8",
                s_ptr="*fp32", **_ints("R", "K"), FMT=0, HW=True, ONE_TILE=False, BLOCK_R=1, BLOCK_C=4096)
    yield _spec("fp8", "fp8_rows_kernel", "e4m3fn bf16, one tile of 8192, 16 warps", options={**nofma, "num_warps": 16}, fp8="ocp",
                div16=("K",), x_ptr="*bf16", q_ptr="*u8", s_ptr="*fp32", **_ints("R", "K"), FMT=0, HW=True, ONE_TILE=True, BLOCK_R=1,
                BLOCK_C=8192)
    yield _spec("fp8", "fp8_rows_kernel", "e4m3fnuz fp32, one tile", options=nofma, fp8="fnuz", div16=("K",), x_ptr="*fp32", q_ptr="*u8",
                s_ptr="*fp32", **_ints("R", "K"), FMT=2, HW=True, ONE_TILE=True, BLOCK_R=4, BLOCK_C=1024)
    blocks = dict(options=nofma, div16=div, x_ptr="*bf16", q_ptr="*u8", qt_ptr="*u8", s_ptr="*fp32", **_ints("M", "K", "mb", "kb"),
                  bs=128, TRANSPOSE=True, HW=True, BLOCK_S=128, SUB_R=32)
    yield _spec("fp8", "fp8_blocks_kernel", "e4m3fn 128x128, transposed", fp8="ocp", FMT=0, **blocks)
    yield _spec("fp8", "fp8_blocks_kernel", "e4m3fnuz 128x128, transposed", fp8="fnuz", FMT=2, **blocks)
    yield _spec("fp8", "fp8_decode_kernel", "e5m2 blocks to bf16", div16=div, q_ptr="*u8", out_ptr="*bf16", s_ptr="*fp32", s_val="fp32",
                **tile, FMT=1, SCALE=4, BLOCK_R=16, BLOCK_C=256)
    gemm = dict(options={"num_warps": 8, "num_stages": 3}, div16=("N", "K", "sam", "sbn", "scm"), a_ptr="*u8", b_ptr="*u8",
                c_ptr="*bf16", sa_ptr="*fp32", sb_ptr="*fp32", bias_ptr="*bf16", **_ints("M", "N", "K", "sam", "sbn", "scm", "kb"),
                bs=128, HAS_BIAS=True, DECODE=False, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8)
    yield _spec("fp8", "fp8_gemm_kernel", "e4m3fn x e4m3fn, 128x128 blocks", fp8="ocp", A_FMT=0, B_FMT=0, SA=2, SB=2, **gemm)
    yield _spec("fp8", "fp8_gemm_kernel", "e5m2 x e4m3fn, rows", fp8="ocp", A_FMT=1, B_FMT=0, SA=1, SB=1, **gemm)
    yield _spec("fp8", "fp8_gemm_kernel", "e4m3fnuz x e4m3fnuz, 128x128 blocks", fp8="fnuz", A_FMT=2, B_FMT=2, SA=2, SB=2, **gemm)
    yield _spec("fp8", "fp8_gemm_kernel", "e5m2fnuz x e4m3fnuz, tensor", fp8="fnuz", A_FMT=3, B_FMT=2, SA=0, SB=0, **gemm)


def _transformer() -> Iterator[Spec]:
    strides = _ints("sxa", "sxb", "sxt", "sya", "syb", "syt", "sca", "scb", "sct", "ssa", "ssb", "sst")
    for interleaved in (False, True):
        yield _spec("transformer", "rotary_kernel", "bf16, fp32 tables" + (", interleaved" if interleaved else ""),
                    div16=("HALF", *strides), x_ptr="*bf16", c_ptr="*fp32", s_ptr="*fp32", y_ptr="*bf16", **_ints("R", "T", "B", "HALF"), **strides,
                    sxd=1, syd=1, scd=1, ssd=1, INTERLEAVED=interleaved, NEGATE_SIN=interleaved, BLOCK_R=16, BLOCK_H=64, COMPUTE=F32)
    rows = ("R", "C", "col_blocks")
    for amax in (False, True):  # swiglu, and swiglu_amax (the amax of y into an int32 word)
        yield _spec("transformer", "swiglu_kernel", "bf16 rows" + (", amax" if amax else ""), div16=("C", "sg", "su", "sy"), g_ptr="*bf16",
                    u_ptr="*bf16", y_ptr="*bf16", amax_ptr="*i32" if amax else "*bf16", **_ints(*rows, "sg", "su", "sy"), BLOCK_R=2,
                    BLOCK_C=2048, COMPUTE=F32, AMAX=amax)
    yield _spec("transformer", "swiglu_bwd_kernel", "fp16 flat", div16=("C", "so", "sg", "su", "sdg", "sdu"), go_ptr="*fp16",
                g_ptr="*fp16", u_ptr="*fp16", dg_ptr="*fp16", du_ptr="*fp16", **_ints(*rows, "so", "sg", "su", "sdg", "sdu"),
                BLOCK_R=1, BLOCK_C=1024, COMPUTE=F32)


def _loss() -> Iterator[Spec]:
    yield _spec("loss", "ce_forward_kernel", "fp32 logits, i64 targets", div16=("C", "stride"), z_ptr="*fp32", t_ptr="*i64",
                loss_ptr="*fp32", **_ints("N", "C", "stride", "ignore_index"), eps="fp64", BLOCK_C=4096, COMPUTE=F32)
    # cross_entropy_backward writes its own gradient buffer (mode 0); linear_cross_entropy's blocks
    # write the gradient over their logits (mode 2, IN_PLACE: a barrier between loads and stores):
    # the backward's recomputed blocks alone, a training forward's with the rows' losses (WITH_LOSS)
    for mode, in_place, with_loss in ((0, False, False), (2, True, False), (2, True, True)):
        yield _spec("loss", "ce_backward_kernel",
                    f"bf16 grads{' over the logits' if in_place else ''}{' with the losses' if with_loss else ''}, mode {mode}",
                    div16=("C", "z_stride", "g_stride"), z_ptr="*fp32", t_ptr="*i32", go_ptr="*fp32", count_ptr="*fp32", dz_ptr="*bf16",
                    loss_ptr="*fp32", **_ints("N", "C", "z_stride", "g_stride", "ignore_index"), eps="fp64",
                    MODE=mode, BLOCK_C=4096, COMPUTE=F32, IN_PLACE=in_place, WITH_LOSS=with_loss)


def specs() -> list[Spec]:
    """Every kernel variant that CI compiles ahead of time."""
    return [*_elementwise(), *_norm(), *_softmax(), *_batchnorm(), *_gemms(), *_optim(), *_quant(), *_fp8(), *_transformer(), *_loss()]


def kernel_names() -> set[tuple[str, str]]:
    """(family, name) of every entry kernel (``*_kernel``) of the hal_triton families."""
    out = set()
    for family in FAMILIES:
        module = importlib.import_module(f"hal_triton.{family}")
        for name, obj in vars(module).items():
            if name.endswith("_kernel") and hasattr(obj, "fn") and getattr(obj.fn, "__module__", "") == module.__name__:
                out.add((family, name))
    return out
