"""Registering the hal_triton kernels into a GPU plugin: one call per vendor plugin.

    from hal_triton.kernels import VendorLibs, register
    register(plugin, CudaTables(), archs=sm(80), vendor=VendorLibs("cudnn", conv, conv_grads, "cublas", linear))

Every op family with a Triton kernel gets it here, under the same names on every vendor: ``triton``
for the kernels that are Triton alone, ``<conv_name>_triton`` for the convolution of the vendor's
library followed by the Triton batch norm (+ ReLU), and ``<blas_name>_triton`` for the vendor's
GEMM followed by the Triton activation pass. Launch configurations come from the plugin's
:class:`~hal_triton.tables.LaunchTables`; autotuned GEMM tiles are cached per device model
(:mod:`hal_triton.autotune`). Importing this module, or calling :func:`register`, imports no Triton:
a kernel family is imported on the first call of one of its kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from types import ModuleType
from typing import Any, Callable, Optional

import torch

from hal.plugin import Archs, Plugin
from hal.plugin_sdk.fp8_hardware import fp8_device
from hal.plugin_sdk.linear import grads_of_rows

from . import autotune
from .checks import Check, contiguous_vectors, flat_lists, fp8_block_reason, fp8_gemm_block_reason, triton_check
from .config import GemmConfig
from .layouts import rotary_geometry, swiglu_geometry
from .tables import INTERPRETER, LaunchTables, PerGeometry, interpreted

FLOATS = ("float16", "bfloat16", "float32", "float64")
NOT_F64 = ("float16", "bfloat16", "float32")
QRANGE = {"int8": (-128, 127), "uint8": (0, 255)}
QDTYPES = {"int8": torch.int8, "uint8": torch.uint8}
OUT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@functools.lru_cache(maxsize=None)
def family(name: str) -> ModuleType:
    """The hal_triton kernel family ``name``, imported on first use (importing it imports Triton)."""
    return importlib.import_module(f"hal_triton.{name}")


@dataclasses.dataclass(frozen=True)
class VendorLibs:
    """The vendor-library calls the kit's mixed kernels build on, and the names they give them.

    ``conv(x, weight, bias, stride, padding, dilation, groups)`` takes canonical arguments (padding
    as (top, bottom, left, right)); ``conv_grads(grad_out, x, weight, stride, padding, dilation,
    groups)`` returns (grad_x, grad_weight, grad_bias); ``linear(x2, weight, bias)`` is a 2-D GEMM
    with the bias; ``gemm_f32(a, b, acc=None)`` is ``a @ b`` of 2-D operands accumulated and
    returned in float32 (float64 for float64; half-precision operands read as they are), or, given
    ``acc`` (float32), added into ``acc`` and ``acc`` returned. Each keeps the vendor's float32
    semantics (hal's float32 is IEEE float32).
    """

    conv_name: str  # "cudnn", "miopen"
    conv: Callable[..., torch.Tensor]
    conv_grads: Callable[..., tuple]
    blas_name: str  # "cublas", "hipblas"
    linear: Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]
    gemm_f32: Callable[..., torch.Tensor]


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _numel(shape: Any) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _fp8_granularity(scale: torch.Tensor, operand: torch.Tensor) -> str:
    """A GEMM scale's granularity as one letter: t(ensor), r(ow), b(lock) (told apart by shape)."""
    if scale.dim() == 0:
        return "t"
    return "r" if tuple(scale.shape) == (int(operand.shape[0]), 1) else "b"


def _fp8_block_scale(scale: Any, operand: torch.Tensor) -> bool:
    """Whether a GEMM scale is block-wise (neither 0-d nor one per row)."""
    return isinstance(scale, torch.Tensor) and _fp8_granularity(scale, operand) == "b"


def _grad_dtype(param: Optional[torch.Tensor], x: torch.Tensor) -> torch.dtype:
    return (param if param is not None else x).dtype


def register(plugin: Plugin, tables: LaunchTables, *, archs: Optional[Archs], vendor: VendorLibs,
             backend: Optional[str] = None) -> dict[tuple[str, str], Callable[..., Any]]:
    """Register every hal_triton kernel on ``plugin`` (its own backend unless ``backend`` names
    another), launched with ``tables``. Returns the kernel functions by (op, name), for vendor
    kernels that build on them (a choice between a library GEMM and the Triton one, say)."""
    registered: dict[tuple[str, str], Callable[..., Any]] = {}
    tables = PerGeometry(tables)  # type: ignore[assignment]  (the same answers, each computed once per geometry)

    def kernel(op: str, name: str, priority: int, dtypes: Optional[tuple[str, ...]] = FLOATS,
               checks: tuple[Check, ...] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        all_checks = (triton_check, *checks)

        def check(inputs: Any) -> list[str]:
            return [r for c in all_checks for r in (c(inputs) or [])]

        def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
            plugin.kernel(op, name=name, backend=backend, priority=priority, dtypes=dtypes, archs=archs, check=check)(fn)
            registered[(op, name)] = fn
            return fn

        return wrap

    def gemm_config(x: torch.Tensor, key: str, candidates: tuple[GemmConfig, ...], run: Callable[[GemmConfig], Any], flops: float) -> GemmConfig:
        """FMA tiles for float64, interpreter tiles on the CPU, else the fastest candidate measured
        on this device for this problem (cached)."""
        if x.dtype == torch.float64:
            return tables.fma_gemm(x)
        if interpreted(x):
            return INTERPRETER.gemm
        return autotune.choose(tables, x.device, key, candidates, run, flops)

    # --- batch norm, and the vendor's convolution followed by it ---------------------------------

    bn_vectors = contiguous_vectors("running_mean", "running_var", "weight", "bias")

    @kernel("batch_norm", "triton", 20, checks=(bn_vectors,))
    def batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps):
        bn = family("batchnorm")
        xd = bn.dense(x)
        return bn.batch_norm_forward(xd, weight, bias, running_mean, running_var, training, momentum, eps, False, tables.batch_norm(xd))

    @kernel("batch_norm_backward", "triton", 20, checks=(contiguous_vectors("running_mean", "running_var", "weight"),))
    def batch_norm_backward(grad_out, x, running_mean, running_var, weight, training, eps):
        bn = family("batchnorm")
        xd = bn.dense(x)
        dt = _grad_dtype(weight, x)
        return bn.batch_norm_backward(grad_out, xd, weight, None, running_mean, running_var, training, eps, False, tables.batch_norm(xd), (dt, dt))

    fused_vectors = contiguous_vectors("running_mean", "running_var", "bn_weight", "bn_bias", "conv_bias")
    conv, conv_grads = vendor.conv, vendor.conv_grads

    @kernel("fused_conv_bn_relu", f"{vendor.conv_name}_triton", 20, checks=(fused_vectors,))
    def fused_conv_bn_relu(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, momentum, training):
        """The library convolution without its bias (it cancels in the normalisation and goes into
        the running mean), then the Triton statistics and normalise + ReLU passes."""
        bn = family("batchnorm")
        # eval at eps = 0: the bias stays in the convolution, since with an infinite scale a (a zero
        # running variance) conv * a + bias * a gives other infinities than the op's (conv + bias) * a
        inside = conv_bias if not training and eps == 0 else None
        y = bn.dense(conv(x, conv_weight, inside, stride, padding, dilation, groups))
        return bn.batch_norm_forward(y, bn_weight, bn_bias, running_mean, running_var, training, momentum, eps, True,
                                     tables.batch_norm(y), conv_bias=None if inside is not None else conv_bias)

    @kernel("fused_conv_bn_relu_backward", f"{vendor.conv_name}_triton", 20, checks=(fused_vectors,))
    def fused_conv_bn_relu_backward(grad_out, x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding, dilation, groups, eps, training):
        """Recomputes the convolution output, runs the batch-norm backward with the ReLU mask, then
        the library's convolution backward. In training the convolution bias gets an exact zero
        gradient (the batch mean absorbs it; a sum of rounded values that cancel would be noise)."""
        bn = family("batchnorm")
        y = bn.dense(conv(x, conv_weight, None, stride, padding, dilation, groups))
        dtypes = (_grad_dtype(bn_weight, x), _grad_dtype(bn_bias, x))
        dy, g_gamma, g_beta = bn.batch_norm_backward(grad_out, y, bn_weight, bn_bias, running_mean, running_var, training, eps, True,
                                                     tables.batch_norm(y), dtypes, conv_bias=conv_bias)
        gx, gw, gb = conv_grads(dy, x, conv_weight, stride, padding, dilation, groups)
        if training:
            gb = torch.zeros_like(gb)
        return gx, gw, gb, g_gamma, g_beta

    # --- scale_shift_act ----------------------------------------------------------------------

    @kernel("scale_shift_act", "triton", 20)
    def scale_shift_act(x, scale, shift, act):
        return family("elementwise").affine_act(x, scale, shift, act, **tables.elementwise(x))

    @kernel("scale_shift_act_backward", "triton", 20)
    def scale_shift_act_backward(grad_out, x, scale, shift, act, output_mask):
        return family("elementwise").affine_act_backward(grad_out, x, scale, shift, act, output_mask, **tables.elementwise(x))

    # --- linear: the vendor's GEMM + a Triton activation pass, or one Triton GEMM with epilogue ---

    blas_linear = vendor.linear

    @kernel("linear", f"{vendor.blas_name}_triton", 20)
    def linear_blas_triton(x, weight, bias, act):
        y = blas_linear(_rows(x), weight, bias)
        if act != "none":
            family("elementwise").affine_act(y, 1.0, 0.0, act, out=y, **tables.elementwise(y))
        return y.view(*x.shape[:-1], weight.shape[0])

    @kernel("linear", "triton", 10)
    def linear_triton(x, weight, bias, act):
        gemm = family("gemm")
        x2 = _rows(x)
        m, k = x2.shape
        n = weight.shape[0]
        key = f"linear/{x.dtype}/m{autotune.bucket(m)}/k{k}/n{n}"
        cfg = gemm_config(x, key, tables.gemm_candidates(x), lambda c: gemm.linear(x2, weight, bias, act, c), 2.0 * m * n * k)
        return gemm.linear(x2, weight, bias, act, cfg).view(*x.shape[:-1], n)

    @kernel("linear_backward", f"{vendor.blas_name}_triton", 20)
    def linear_backward(grad_out, x, weight, bias, act, output_mask):
        """The pre-activation is recomputed by the library GEMM; one Triton pass turns grad_out
        into its gradient; then the GEMMs (and the bias sum) output_mask asks for."""
        x2 = _rows(x)
        g2 = _rows(grad_out)
        if act == "none":
            gz = g2
        else:
            z = blas_linear(x2, weight, bias)
            gz = family("elementwise").affine_act_backward(g2, z, 1.0, 0.0, act, (True, False, False), **tables.elementwise(z))[0]
        return grads_of_rows(gz, x2, x, weight, output_mask)

    # --- grouped_gemm (group sizes stay on the device: no synchronisation, capturable) ---------

    @kernel("grouped_gemm", "triton", 20)
    def grouped_gemm(x, weight, group_sizes):
        """On the GPU the group sizes are not read back: rows past sum(group_sizes) come out as
        zeros and groups past x's rows are cut (the op's contract asks for sum == rows)."""
        gg = family("grouped_gemm")
        flops = 2.0 * x.shape[0] * weight.shape[1] * weight.shape[2]
        cfg = gemm_config(x, autotune.grouped_key("grouped_gemm", x, weight), tables.gemm_candidates(x),
                          lambda c: gg.grouped_gemm(x, weight, group_sizes, c), flops)
        return gg.grouped_gemm(x, weight, group_sizes, cfg)

    @kernel("grouped_gemm_backward", "triton", 20)
    def grouped_gemm_backward(grad_out, x, weight, group_sizes):
        gg = family("grouped_gemm")
        flops = 2.0 * x.shape[0] * weight.shape[1] * weight.shape[2]
        sg, sk, sn = weight.stride()
        k = int(weight.shape[1])
        cfg_x = gemm_config(x, autotune.grouped_key("grouped_gemm_dx", x, weight), tables.gemm_candidates(x),
                            lambda c: gg.grouped_matmul(grad_out, weight, (sg, sn, sk), k, group_sizes, c), flops)
        cfg_w = gemm_config(x, autotune.grouped_key("grouped_gemm_dw", x, weight), tables.wgrad_candidates(x),
                            lambda c: gg.grouped_gemm_backward(grad_out, x, weight, group_sizes, cfg_x, c), flops)
        return gg.grouped_gemm_backward(grad_out, x, weight, group_sizes, cfg_x, cfg_w)

    # --- layer_norm and rms_norm --------------------------------------------------------------

    def norm_forward(x, normalized_shape, weight, bias, eps, rms):
        n = _numel(normalized_shape)
        return family("norm").norm_forward(x, n, weight, bias, eps, rms, **tables.rows(x, n))

    def norm_backward(grad_out, x, normalized_shape, weight, eps, rms):
        n = _numel(normalized_shape)
        return family("norm").norm_backward(grad_out, x, n, weight, eps, rms, programs=tables.persistent_programs(x), **tables.rows(x, n))

    @kernel("layer_norm", "triton", 20)
    def layer_norm(x, normalized_shape, weight, bias, eps):
        return norm_forward(x, normalized_shape, weight, bias, eps, False)

    @kernel("layer_norm_backward", "triton", 20)
    def layer_norm_backward(grad_out, x, normalized_shape, weight, eps):
        dx, dw, db = norm_backward(grad_out, x, normalized_shape, weight, eps, False)
        return dx, dw.view(normalized_shape), db.view(normalized_shape)

    @kernel("rms_norm", "triton", 20)
    def rms_norm(x, normalized_shape, weight, eps):
        return norm_forward(x, normalized_shape, weight, None, eps, True)

    @kernel("rms_norm_backward", "triton", 20)
    def rms_norm_backward(grad_out, x, normalized_shape, weight, eps):
        dx, dw, _ = norm_backward(grad_out, x, normalized_shape, weight, eps, True)
        return dx, dw.view(normalized_shape)

    # --- softmax --------------------------------------------------------------------------------

    def softmax_cfg(x: torch.Tensor, dim: int) -> dict[str, int]:
        return {**tables.rows(x, int(x.shape[dim])), "block_i": tables.columns(x)}

    def has_rows(inputs: Any) -> list[str]:
        x = inputs["x"] if "x" in inputs.op.param_names else inputs["out"]
        return [] if x.ndim else ["0-d input (a softmax over one value: the torch kernel runs it)"]

    @kernel("softmax", "triton", 20, checks=(has_rows,))
    def softmax(x, dim):
        return family("softmax").softmax(x, dim, **softmax_cfg(x, dim))

    @kernel("softmax_backward", "triton", 20, checks=(has_rows,))
    def softmax_backward(grad_out, out, dim):
        return family("softmax").softmax_backward(grad_out, out, dim, **softmax_cfg(out, dim))

    # --- multi-tensor optimizer kernels (one launch per list, nothing read back) ----------------

    @kernel("amp_unscale_", "triton", 20, checks=(flat_lists("tensors"),))
    def amp_unscale_(tensors, inv_scale):
        if not tensors:
            return torch.zeros((), dtype=torch.float32, device=inv_scale.device if isinstance(inv_scale, torch.Tensor) else "cuda")
        t0 = tensors[0]
        return family("optim").amp_unscale(tensors, inv_scale, device=t0.device, **tables.multi_tensor(t0))

    adamw_lists = flat_lists("params", "grads", "exp_avgs", "exp_avg_sqs", "master_params")

    @kernel("fused_adamw_", "triton", 20, dtypes=NOT_F64, checks=(adamw_lists,))
    def fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step, master_params, inv_scale, found_inf):
        if not params:
            return None
        family("optim").fused_adamw(
            params, grads, exp_avgs, exp_avg_sqs, master_params, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay, step=step, inv_scale=inv_scale, found_inf=found_inf, **tables.multi_tensor(params[0]),
        )
        return None

    # --- quantisation -----------------------------------------------------------------------------

    @kernel("quantize", "triton", 20)
    def quantize(x, scale, zero_point, axis, dtype):
        qmin, qmax = QRANGE[dtype]
        return family("quant").quantize(x, scale, zero_point, axis, QDTYPES[dtype], qmin, qmax, **tables.elementwise(x))

    @kernel("dequantize", "triton", 20, dtypes=("int8", "uint8"))
    def dequantize(q, scale, zero_point, axis):
        out = scale.dtype if isinstance(scale, torch.Tensor) else torch.float32
        return family("quant").dequantize(q, scale, zero_point, axis, out, **tables.elementwise(q))

    @kernel("fake_quantize", "triton", 20)
    def fake_quantize(x, scale, zero_point, quant_min, quant_max, axis):
        return family("quant").fake_quantize(x, scale, zero_point, quant_min, quant_max, axis, **tables.elementwise(x))

    @kernel("fake_quantize_backward", "triton", 20)
    def fake_quantize_backward(grad_out, x, scale, zero_point, quant_min, quant_max, axis):
        return family("quant").fake_quantize_backward(grad_out, x, scale, zero_point, quant_min, quant_max, axis, **tables.elementwise(x))

    @kernel("int8_linear", "triton", 20, dtypes=None)
    def int8_linear(x_q, w_q, x_scale, w_scale, bias, out_dtype):
        gemm = family("gemm")
        x2 = x_q.reshape(-1, x_q.shape[-1])
        m, k = x2.shape
        n = w_q.shape[0]
        out = OUT_DTYPES[out_dtype]
        if interpreted(x_q):
            cfg = INTERPRETER.int8_gemm
        else:
            key = f"int8_linear/m{autotune.bucket(m)}/k{k}/n{n}"
            cfg = autotune.choose(tables, x_q.device, key, tables.int8_candidates(x_q),
                                  lambda c: gemm.int8_linear(x2, w_q, x_scale, w_scale, bias, out, c), 2.0 * m * n * k)
        return gemm.int8_linear(x2, w_q, x_scale, w_scale, bias, out, cfg).view(*x_q.shape[:-1], n)

    # --- FP8: quantisation (amax fused, optionally transposed), dequantisation, the scaled GEMM ---

    def fp8_formats(*names: str) -> Check:
        """The device has hardware FP8 in the named format arguments (hal.plugin_sdk.fp8_hardware.fp8_device)."""

        def check(inputs: Any) -> list[str]:
            return fp8_device(inputs.device, [inputs[n] for n in names]) if isinstance(inputs.device, torch.device) else []

        return check

    def fp8_blocks(inputs: Any) -> list[str]:
        if inputs["granularity"] != "block":
            return []
        why = fp8_block_reason(inputs["block_size"])
        return [why] if why else []

    def fp8_gemm_blocks(inputs: Any) -> list[str]:
        blocks = any(_fp8_block_scale(inputs[s], inputs[o]) for s, o in (("a_scale", "a"), ("b_scale", "b")))
        why = fp8_gemm_block_reason(inputs["block_size"]) if blocks else None
        return [why] if why else []

    @kernel("fp8_quantize", "triton", 20, checks=(fp8_formats("format"), fp8_blocks))
    def fp8_quantize(x, format, granularity, scale, block_size):
        return family("fp8").quantize(x, format, granularity, scale, block_size, False, not interpreted(x), **tables.elementwise(x))

    @kernel("fp8_quantize_transpose", "triton", 20, checks=(fp8_formats("format"), fp8_blocks))
    def fp8_quantize_transpose(x, format, granularity, scale, block_size):
        return family("fp8").quantize(x, format, granularity, scale, block_size, True, not interpreted(x), **tables.elementwise(x))

    @kernel("fp8_dequantize", "triton", 20, dtypes=("uint8",), checks=(fp8_formats("format"),))
    def fp8_dequantize(q, scale, format, block_size, out_dtype):
        return family("fp8").dequantize(q, scale, format, block_size, OUT_DTYPES[out_dtype], **tables.elementwise(q))

    @kernel("fp8_scaled_mm", "triton", 20, dtypes=("uint8",), checks=(fp8_formats("a_format", "b_format"), fp8_gemm_blocks))
    def fp8_scaled_mm(a, b, a_scale, b_scale, bias, a_format, b_format, out_dtype, block_size):
        f8 = family("fp8")
        m, k = a.shape
        n = b.shape[0]
        out = OUT_DTYPES[out_dtype]

        def run(cfg: GemmConfig) -> torch.Tensor:
            return f8.scaled_mm(a, b, a_scale, b_scale, bias, a_format, b_format, out, block_size, cfg, interpreted(a))

        if interpreted(a):
            return run(INTERPRETER.int8_gemm)
        grans = "".join(_fp8_granularity(s, o) for s, o in ((a_scale, a), (b_scale, b)))
        key = f"fp8_scaled_mm/m{autotune.bucket(m)}/k{k}/n{n}/{grans}/{a_format}/{b_format}"
        return run(autotune.choose(tables, a.device, key, tables.int8_candidates(a), run, 2.0 * m * n * k))

    # --- transformer pieces: rotary embeddings, SwiGLU --------------------------------------------

    def rotary_layout(inputs: Any) -> list[str]:
        x = inputs["x"] if "x" in inputs.op.param_names else inputs["grad_out"]
        if rotary_geometry(x, inputs["cos"], inputs["sin"]) is None:
            return ["x has more than two leading dimensions that do not merge in memory (the torch kernel runs it)"]
        return []

    def rotary_cfg(x: torch.Tensor) -> dict[str, int]:
        cfg = tables.elementwise(x)
        rows = max(1, cfg["block_elems"] // max(1, int(x.shape[-1])))
        return {"block_r": 1 << (rows.bit_length() - 1), "num_warps": cfg["num_warps"]}  # a power of two

    @kernel("rotary_embedding", "triton", 20, checks=(rotary_layout,))
    def rotary_embedding(x, cos, sin, interleaved):
        return family("transformer").rotary(x, cos, sin, interleaved, False, **rotary_cfg(x))

    @kernel("rotary_embedding_backward", "triton", 20, checks=(rotary_layout,))
    def rotary_embedding_backward(grad_out, cos, sin, interleaved):
        return family("transformer").rotary(grad_out, cos, sin, interleaved, True, **rotary_cfg(grad_out))

    def swiglu_layout(*names: str) -> Check:
        def check(inputs: Any) -> list[str]:
            if swiglu_geometry(*(inputs[n] for n in names)) is not None:
                return []
            return [f"{', '.join(names)} broadcast, or are neither dense in one layout nor rows of their last dimension "
                    "(the torch kernel runs them)"]

        return check

    @kernel("swiglu", "triton", 20, checks=(swiglu_layout("gate", "up"),))
    def swiglu(gate, up):
        return family("transformer").swiglu(gate, up, **tables.elementwise(gate))

    @kernel("swiglu_backward", "triton", 20, checks=(swiglu_layout("grad_out", "gate", "up"),))
    def swiglu_backward(grad_out, gate, up):
        return family("transformer").swiglu_backward(grad_out, gate, up, **tables.elementwise(gate))

    # --- losses: cross-entropy, and the LM head with it (blocks of rows, never all logits) ---------

    def ce_cfg(z: torch.Tensor) -> dict[str, int]:
        cfg = tables.rows(z, int(z.shape[-1]))
        return {"block_c": cfg["block_n"], "num_warps": cfg["num_warps"]}

    @kernel("cross_entropy", "triton", 20)
    def cross_entropy(logits, target, ignore_index, label_smoothing, reduction):
        return family("loss").cross_entropy(logits, target, ignore_index, label_smoothing, reduction, **ce_cfg(logits))

    @kernel("cross_entropy_backward", "triton", 20)
    def cross_entropy_backward(grad_out, logits, target, ignore_index, label_smoothing, reduction):
        return family("loss").cross_entropy_backward(grad_out, logits, target, ignore_index, label_smoothing, reduction, **ce_cfg(logits))

    gemm_f32 = vendor.gemm_f32

    def lce_cfg(x: torch.Tensor, weight: torch.Tensor) -> dict[str, Any]:
        cfg = tables.rows(x, int(weight.shape[0]))
        return {"block_c": cfg["block_n"], "num_warps": cfg["num_warps"], "gemm_f32": gemm_f32,
                "block_elements": LCE_BLOCK_ELEMENTS if not interpreted(x) else 64}

    @kernel("linear_cross_entropy", f"{vendor.blas_name}_triton", 20)
    def linear_cross_entropy(x, weight, target, bias, ignore_index, label_smoothing, reduction):
        return family("loss").linear_cross_entropy(x, weight, target, bias, ignore_index, label_smoothing, reduction, **lce_cfg(x, weight))

    @kernel("linear_cross_entropy_backward", f"{vendor.blas_name}_triton", 20)
    def linear_cross_entropy_backward(grad_out, x, weight, target, bias, ignore_index, label_smoothing, reduction):
        return family("loss").linear_cross_entropy_backward(grad_out, x, weight, target, bias, ignore_index, label_smoothing, reduction,
                                                            **lce_cfg(x, weight))

    return registered


#: logits linear_cross_entropy holds at once on a GPU (float32: 1 GiB). Each block of rows adds its
#: part of grad_weight (vocab x hidden, float32) into the accumulator, so fewer, larger blocks move
#: less: at 2^26 a Llama-3 LM head (4096 tokens, vocab 128256, d 2048) took 8 blocks and 24.9 ms
#: forward + backward on an H100 against torch.compile's 10.1 (benchmarks/levers40.py, 2026-12-07)
LCE_BLOCK_ELEMENTS = 1 << 28


def int32_dequant(tables: LaunchTables, acc: torch.Tensor, x_scale: Any, w_scale: Any, bias: Optional[torch.Tensor], out_dtype: str) -> torch.Tensor:
    """int8_linear's epilogue after a library int8 GEMM: ``acc * x_scale * w_scale[n] + bias``."""
    return family("quant").int32_dequant(acc, x_scale, w_scale, bias, OUT_DTYPES[out_dtype], **tables.elementwise(acc))
