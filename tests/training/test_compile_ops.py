"""Every hal op with a backward, compiled by torch.compile's default backend (Inductor) with
``fullgraph=True`` on one small float32 call: output, gradients and the running statistics it
updates match eager hal's.

tests/training/test_torch_library.py already runs every op through AOTAutograd (opcheck's
``test_aot_dispatch_dynamic``, no Inductor) and checks gradients against PyTorch in eager; this adds
Inductor's lowering and code generation around each op (its decomposition or kernel made of
torch's ops becomes Inductor's code, an opaque kernel a fallback call). One compilation per op; the
call is each op's first quick conformance case in float32, in training where the op has a
``training`` flag and such a case (the mutating, differentiated path). The ops that
tests/training/test_compile_nn.py already compiles inside hal.nn's modules
(:data:`COMPILED_BY_MODULES`) are left to it.

Tolerance: the compiled call runs the same opaque kernel as eager, or Inductor's code for a kernel
made of torch's ops, which sums in another order; the longest reduction here has 1000 terms, so a
result stays within ``1e-5 * scale`` of eager's (``scale`` the largest magnitude of the values
compared; for gradients, of all the call's gradients). (fake_quantize rounds: an element within a
rounding error of a rounding boundary could move by a whole step, with odds of about one in 10**5
per run for its 132 elements.)
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from hal.conformance.cases import all_cases, draw_call
from torch._dynamo.testing import CompileCounterWithBackend

import hal
from hal.registry import OPS, OpDecl

SLACK = 1e-5

#: trainable ops that tests/training/test_compile_nn.py compiles with Inductor (fullgraph=True, float32
#: and bfloat16 autocast, static and dynamic shapes) inside hal.nn's modules and the GPT-style model:
#: not compiled again here, for CI time
COMPILED_BY_MODULES = {
    "linear": "hal.nn.Linear (every activation), GPT",
    "layer_norm": "hal.nn.LayerNorm, GPT",
    "rms_norm": "hal.nn.RMSNorm",
    "conv2d": "hal.nn.FusedConvBN2d (conv2d then batch_norm under torch.compile)",
    "batch_norm": "hal.nn.FusedConvBN2d",
    "fused_conv_bn_relu": "hal.nn.FusedConvBNReLU2d",
    "fused_conv_bn_add_relu": "hal.nn.FusedConvBNAddReLU2d",
    "scaled_dot_product_attention": "the GPT-style model",
}
TRAINABLE = [name for name, decl in OPS.items() if decl.trainable and name not in COMPILED_BY_MODULES]


def _case(decl: OpDecl) -> Any:
    """The op's first quick float32 conformance case, preferring one in training."""
    quick = [s for s in all_cases()[decl.name] if s.quick and s.applies_to("float32")]
    if any(p.name == "training" for p in decl.params):
        for spec in quick:
            if draw_call(decl.name, "float32", spec, 0, "cpu").args.get("training"):
                return spec
    return quick[0]


def _scale(tensors: list[Optional[torch.Tensor]]) -> float:
    return max((t.abs().max().item() for t in tensors if t is not None and t.numel()), default=0.0)


def _close(got: torch.Tensor, want: torch.Tensor, scale: float, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.shape} {got.dtype}, want {want.shape} {want.dtype}"
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    assert err <= SLACK * scale, f"{what}: compiled differs from eager by {err:.3g}, allowed {SLACK * scale:.3g}"


def test_every_trainable_op_is_compiled_here_or_by_the_module_tests() -> None:
    assert set(COMPILED_BY_MODULES) <= {name for name, decl in OPS.items() if decl.trainable}, "a stale name"
    assert TRAINABLE, "nothing left to compile here"


#: hal_backend_cpu's cross_entropy kernel (made of torch's ops, so traced into compiled graphs) checks
#: its targets with ``bool(bad.any())``: on Dynamo's fake tensors a data-dependent guard, a UserError
#: under fullgraph=True (a graph break without)
@pytest.mark.parametrize("op_name", TRAINABLE)
def test_op_compiles_with_inductor_and_matches_eager(op_name: str, seed: int) -> None:
    decl = OPS[op_name]
    spec = _case(decl)
    call = draw_call(op_name, "float32", spec, seed, "cpu").args
    args = [call[p.name] if p.name in call else p.default for p in decl.params]
    tensor_at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    differentiable = [i for i in tensor_at if decl.params[i].name in decl.gradients and args[i].is_floating_point()]
    assert differentiable, f"{op_name}: no differentiable tensor in case {spec.name}"
    op = getattr(hal.ops, op_name)

    def run(*tensors: torch.Tensor) -> torch.Tensor:
        full = list(args)
        for i, t in zip(tensor_at, tensors):
            full[i] = t
        out = op(*full)
        if decl.nondifferentiable_results:  # (y, amax): y, with the amax added as 0 (compiled as part of the graph)
            return out[0] + 0 * out[1].to(out[0].dtype)
        return out

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(run, fullgraph=True, backend=counter)
    results = []
    grad_out: Optional[torch.Tensor] = None
    for fn in (run, compiled):
        tensors = [args[i].detach().clone().requires_grad_(i in differentiable) for i in tensor_at]
        out = fn(*tensors)
        assert isinstance(out, torch.Tensor) and out.grad_fn is not None, f"{op_name}: {type(out)}"
        if grad_out is None:
            grad_out = torch.randn(out.shape)
        leaves = [t for i, t in zip(tensor_at, tensors) if i in differentiable]
        grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
        mutated = [t.detach() for i, t in zip(tensor_at, tensors) if decl.params[i].name in decl.mutates]
        results.append((out.detach(), grads, mutated))
    (want, want_grads, want_mutated), (got, got_grads, got_mutated) = results
    assert counter.frame_count == 1, f"{op_name}: {counter.frame_count} graphs"
    _close(got, want, _scale([want]), f"{op_name} ({spec.name}) output")
    grad_scale = _scale(list(want_grads))
    names = [decl.params[i].name for i in differentiable]
    for name, g, w in zip(names, got_grads, want_grads):
        _close(g, w, grad_scale, f"{op_name} ({spec.name}) gradient of {name}")
    for g, w in zip(got_mutated, want_mutated):
        _close(g, w, _scale([w]), f"{op_name} ({spec.name}) running statistics")
