"""The Triton fused_adamw_ kernel, run by the Triton interpreter, spreads NaN and infinities as
torch.optim.AdamW does (for-loop and foreach on CPU): tests/cuda/_adamw_specials.py says which cases
and why torch's fused CUDA kernel is not the reference there. Fresh random inputs each run, the
half-precision copies poisoned with NaN before the call.

Run by tests/cuda/test_interpreter.py (TRITON_INTERPRET=1 in a subprocess), as test_kernels.py is.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.cuda import _adamw_specials as sv
from tests.cuda._support import fresh_seed

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="run by tests/cuda/test_interpreter.py with TRITON_INTERPRET=1"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # NumPy's "invalid value" inside the interpreter
]

#: several programs per tensor at the CPU launch sizes, odd tails, one tensor too small for the cases
SHAPES = [(300,), (3, 50), (7,), (4, 33)]


def _kernel():
    from hal_backend_cuda import plugin

    return next(k.fn for k in plugin.kernels if k.op == "fused_adamw_" and k.name == "triton")


@pytest.mark.parametrize("betas", sv.BETAS, ids=["beta1=0.9", "beta1=0.3"])
@pytest.mark.parametrize("pdtype,masters", [(torch.bfloat16, True), (torch.float16, True), (torch.float32, False)],
                         ids=["bf16_copies", "fp16_copies", "fp32"])
@pytest.mark.parametrize("inv_scale", [None, 0.5], ids=["grads", "scaled_grads"])
def test_triton_adamw_spreads_nan_and_inf_as_torch_optim_adamw(betas, pdtype, masters, inv_scale):
    gen = torch.Generator().manual_seed(fresh_seed())
    got = sv.special_state(gen, SHAPES, pdtype, masters)
    assert sv.special_positions(got) >= 3 * len(sv.CASES)
    grads = [g.clone() for g in got["grads"]]
    want = sv.torch_adamw(got, betas, inv_scale, foreach=False)
    sv.assert_as_torch(sv.torch_adamw(got, betas, inv_scale, foreach=True), want, grads)  # torch's two agree
    sv.run(_kernel(), got, betas, None if inv_scale is None else torch.tensor([inv_scale]))
    sv.assert_as_torch(got, want, grads)
