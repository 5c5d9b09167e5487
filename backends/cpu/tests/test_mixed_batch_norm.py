"""Batch norm of half-precision x beside float32 parameters (autocast's batch norm) runs torch's
mixed-precision kernels directly on the CPU backend: no float32 copy of x, of the output or of the
gradient (three copies of an activation per layer and step in a ResNet under autocast), while half
parameters still take the float32 detour that keeps large-mean statistics accurate. Accuracy of both
is the conformance suite's (cases mixed_fp32_params_*, large_offset_train)."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hal


class _Copies(TorchDispatchMode):
    """Counts dtype conversions (aten._to_copy) by (source dtype, target dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") is not None:
            self.seen[(args[0].dtype, kwargs["dtype"], tuple(args[0].shape))] += 1
        return func(*args, **kwargs)


def _inputs(rng: np.random.Generator, dtype: torch.dtype, param_dtype: torch.dtype):
    x = torch.from_numpy(rng.standard_normal((4, 16, 7, 7), dtype=np.float32) + 3.0).to(dtype)
    x = x.contiguous(memory_format=torch.channels_last)
    g = torch.from_numpy(rng.standard_normal((4, 16, 7, 7), dtype=np.float32)).to(dtype)
    w = torch.from_numpy(rng.uniform(0.5, 1.5, 16).astype(np.float32)).to(param_dtype)
    b = torch.from_numpy(rng.standard_normal(16, dtype=np.float32)).to(param_dtype)
    rm, rv = torch.zeros(16, dtype=param_dtype), torch.ones(16, dtype=param_dtype)
    return x, g, w, b, rm, rv


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float32_parameters_make_no_float32_copy_of_x(dtype, rng) -> None:
    x, g, w, b, rm, rv = _inputs(rng, dtype, torch.float32)
    with _Copies() as copies, hal.use(backend="cpu", kernel={"batch_norm": "torch", "batch_norm_backward": "torch"}):
        out = hal.ops.batch_norm(x, rm, rv, w, b, True)
        gx, gw, gb = hal.ops.batch_norm_backward(g, x, rm, rv, w, True)
    big = [k for k in copies.seen if k[2] == tuple(x.shape)]
    assert big == [], copies.seen
    assert out.dtype == gx.dtype == dtype and gw.dtype == gb.dtype == torch.float32
    assert out.is_contiguous(memory_format=torch.channels_last)
    x64 = x.double()
    ref = torch.nn.functional.batch_norm(x64, None, None, w.double(), b.double(), True)
    assert float((out.double() - ref).abs().max()) <= 2.0 ** -7 * float(ref.abs().max())  # a rounding, not the large-mean loss


def test_half_parameters_still_normalise_in_float32(rng) -> None:
    x, g, w, b, rm, rv = _inputs(rng, torch.bfloat16, torch.bfloat16)
    with _Copies() as copies, hal.use(backend="cpu", kernel={"batch_norm": "torch"}):
        hal.ops.batch_norm(x, rm, rv, w, b, True)
    assert copies.seen[(torch.bfloat16, torch.float32, tuple(x.shape))] == 1, copies.seen
