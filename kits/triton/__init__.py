"""hal_triton: portable Triton kernel sources shared by the GPU plugins (CUDA now, ROCm later).

Each module holds the ``@triton.jit`` kernels of one op family and thin host functions that
allocate outputs, compute grids and launch. Launch configurations (block sizes, warps, stages) are
parameters of those host functions: every vendor plugin keeps its own tables and passes them in.
The kernels run on any device Triton drives, and on CPU tensors under ``TRITON_INTERPRET=1``.

``config`` (launch-configuration types, size arithmetic) imports no Triton: vendor plugins build
their tables from it at import time. The other modules import Triton; import them only when a kernel
is about to run:

- ``activation``  jit helpers: the activations of scale_shift_act / linear and their derivatives
- ``elementwise`` act(x * scale + shift) with broadcast scale/shift, and its backward
- ``norm``        layer_norm and rms_norm, forward and backward
- ``softmax``     softmax forward and backward along any dimension
- ``batchnorm``   batch statistics, normalise (+ ReLU), and the backward of both
- ``gemm``        tiled GEMM with a bias + activation epilogue; int8 GEMM with a dequantising one
- ``grouped_gemm`` ragged grouped GEMM (MoE) forward and weight gradient
- ``optim``       multi-tensor fused AdamW (master weights, unscale, skip on overflow), amp_unscale_
- ``quant``       quantize, dequantize, fake_quantize (+ backward), int32 -> float dequant epilogue
- ``fp8``         FP8 quantisation (amax fused, optionally transposed), dequantisation, scaled GEMM
- ``transformer`` rotary position embeddings and the SwiGLU gate, forward and backward
- ``loss``        cross-entropy rows (online log-sum-exp), and the LM head + loss over blocks of rows
- ``aot``         representative signatures of every kernel, for ahead-of-time compilation checks

Triton-free helpers for the plugins: ``tables`` (the launch-table protocol, and ``PerGeometry``,
which answers each table question once per tensor geometry), ``kernels`` (registers every kernel
into a plugin: one registration file per family, found there, which names the families,
``hal_triton.kernels.FAMILIES``), ``autotune``, ``checks``, ``layouts``.

Host time matters as much as the kernels (a model step is often host-bound): ``_launch.launch``
skips Triton's Python launch path for compiled specialisations, and a host function that launches
the same geometry over and over builds a ``_launch.LaunchPlan`` once per geometry, so that a call
keys only its live arguments (the tensors) before the launcher runs.

The GEMM tiles multiply with tensor cores, except in float64 (FMAs: Triton 3.6 cannot lower a
float64 ``tl.dot`` for sm_90) and, in the interpreter only, bfloat16 (upcast: the 3.9 interpreter
multiplies bfloat16 tiles wrongly).

Triton is an optional dependency of the core (``pip install hal[triton]``); ``import hal`` never
imports it.
"""

from __future__ import annotations

import importlib.util
from typing import Optional


def unavailable_reason() -> Optional[str]:
    """Why Triton kernels cannot run here (None when Triton is importable)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'hal[triton]')"
    return None
