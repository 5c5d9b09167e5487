"""torch.ops.hal.*: every op registered with a correct schema, fake kernel and autograd formula;
autograd through hal.ops gives PyTorch's gradients; eager calls without autograd stay direct."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hal.conformance.cases import all_cases, draw_call
from torch.utils._python_dispatch import TorchDispatchMode

import hal
from hal.integration import library as torch_library
from hal.gradients import MASK
from hal.registry import OPS, OpDecl
from hal_torch.table import eager

OP_NAMES = list(OPS)


def _dtype(decl: OpDecl, prefer: str) -> str:
    return prefer if prefer in decl.dtypes else decl.dtypes[0]


def _quick_calls(prefer: str) -> list[Any]:
    """(op, case) of every quick conformance case of every op, as pytest params."""
    out = []
    for name in OP_NAMES:
        dtype = _dtype(OPS[name], prefer)
        out += [pytest.param(name, spec, id=f"{name}-{spec.name}") for spec in all_cases()[name] if spec.quick and spec.applies_to(dtype)]
    return out


def _args(decl: OpDecl, spec: Any, dtype: str, seed: int) -> list[Any]:
    """The full positional arguments of a conformance case (defaults filled in)."""
    call = draw_call(decl.name, dtype, spec, seed, "cpu")
    return [call.args[p.name] if p.name in call.args else p.default for p in decl.params]


def test_every_op_is_a_torch_op_with_its_mutations_declared() -> None:
    for name, decl in OPS.items():
        top = torch_library.TORCH_OPS[name]
        op = getattr(torch.ops.hal, name).default
        assert op is (top.mutating or top.overload)
        mutated = {a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        assert mutated == set(decl.mutates), (name, mutated, decl.mutates)
        slot_names = [a.name for a in op._schema.arguments]
        assert slot_names == top.slot_names
        for p in decl.params:  # every hal parameter keeps its name (but a backward op's output
            # mask, which the operator has no slot for: it computes every gradient)
            assert p.name in slot_names or p.name == MASK, (name, p.name)
        decide = getattr(torch.ops.hal, f"{name}_decide").default  # the node Dynamo records
        assert decide is top.decide and str(decide._schema).split("(", 1)[1] == str(op._schema).split("(", 1)[1]
        assert torch._C._dispatch_has_kernel_for_dispatch_key(decide.name(), "CompositeImplicitAutograd")


@pytest.mark.parametrize("op_name,spec", _quick_calls("float32"))
def test_schema_fake_kernel_and_autograd_registration(op_name: str, spec: Any, seed: int) -> None:
    """torch.library.opcheck on every quick conformance case (float32): the schema's mutation
    annotations match what the kernel writes, the fake kernel's results have the real results'
    shapes, dtypes and strides, and autograd is registered where it should be."""
    decl = OPS[op_name]
    top = torch_library.TORCH_OPS[op_name]
    slots = top.encode(_args(decl, spec, _dtype(decl, "float32"), seed))
    torch.library.opcheck(top.mutating or top.overload, tuple(slots), test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("op_name", OP_NAMES)
def test_aot_dispatch_dynamic_shapes(op_name: str, seed: int) -> None:
    """opcheck's AOTAutograd test with dynamic shapes on the op's first quick case: the op (and its
    backward) trace, functionalise and run under torch.compile's machinery."""
    decl = OPS[op_name]
    dtype = _dtype(decl, "float32")
    spec = next(s for s in all_cases()[op_name] if s.quick and s.applies_to(dtype))
    top = torch_library.TORCH_OPS[op_name]
    slots = top.encode(_args(decl, spec, dtype, seed))
    torch.library.opcheck(top.mutating or top.overload, tuple(slots), test_utils=("test_aot_dispatch_dynamic",))


def _trainable_calls() -> list[Any]:
    out = []
    for name, decl in OPS.items():
        if not decl.trainable:
            continue
        for spec in all_cases()[name]:
            if spec.quick and spec.applies_to("float64"):
                modes = (True, False) if any(d.training for d in decl.decompositions) else (True,)
                out += [pytest.param(name, spec, d, id=f"{name}-{spec.name}{'' if d else '-fused_backward'}") for d in modes]
    return out


def _canonical(decl: OpDecl, args: list[Any]) -> list[Any]:
    canon = list(args)
    for key, value in (decl.check(*args) or {}).items():
        canon[decl.index(key)] = value
    return canon


def _own_kernel(decl: OpDecl, args: list[Any]) -> str:
    """The kernel a call of ``decl`` runs without autograd (forcing it skips a training decomposition)."""
    with torch.no_grad():
        d = hal.explain(decl.name, *args)
    # zero-size inputs: the empty rule answers in place of the kernel chosen for them (force that one)
    return d.kernel if d.kernel != "empty" else next(c.kernel for c in d.candidates if c.supported and c.kernel != "empty")


def _fresh(args: list[Any], decl: OpDecl) -> list[Any]:
    """Copies of the arrays an op writes (running statistics), so two runs start alike."""
    return [a.clone() if (p.name in decl.mutates and isinstance(a, torch.Tensor)) else a for p, a in zip(decl.params, args)]


@pytest.mark.parametrize("op_name,spec,decompose", _trainable_calls())
def test_gradients_match_pytorch(op_name: str, spec: Any, decompose: bool, seed: int) -> None:
    """Every trainable op through hal.ops with grad-requiring float64 inputs: the autograd graph
    (one node calling <op>_backward, or the training decomposition; forcing the op's own kernel
    trains through its backward op) gives the gradients of the op's eager PyTorch twin, and the same
    running-statistic updates."""
    decl = OPS[op_name]
    args = _args(decl, spec, "float64", seed)
    force = {} if decompose else {op_name: _own_kernel(decl, _fresh(args, decl))}
    names = list(decl.gradients)
    leaves = {n: args[decl.index(n)].detach().clone().requires_grad_(True) for n in names if isinstance(args[decl.index(n)], torch.Tensor)}
    ours = _fresh(args, decl)
    theirs = _fresh(args, decl)
    for n, leaf in leaves.items():
        ours[decl.index(n)] = theirs[decl.index(n)] = leaf
    with hal.use(kernel=force):
        out = decl.entry(*ours)
    want_out = eager(op_name)(*_canonical(decl, theirs))
    if decl.nondifferentiable_results:  # (y, amax): the results after the first carry no gradient
        for extra, want_extra in zip(out[1:], want_out[1:]):
            assert extra.grad_fn is None and not extra.requires_grad
            torch.testing.assert_close(extra, want_extra, rtol=1e-9, atol=1e-9, equal_nan=True)
        out, want_out = out[0], want_out[0]
    assert out.grad_fn is not None
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, list(leaves.values()), grad_out)
    want = torch.autograd.grad(want_out, list(leaves.values()), grad_out)
    torch.testing.assert_close(out.detach(), want_out.detach(), rtol=1e-9, atol=1e-9, equal_nan=True)
    for n, g, w in zip(leaves, got, want):
        torch.testing.assert_close(g, w, rtol=1e-8, atol=1e-9, equal_nan=True, msg=lambda m, n=n: f"gradient of {n}: {m}")
    for name in decl.mutates:
        i = decl.index(name)
        if isinstance(ours[i], torch.Tensor):
            torch.testing.assert_close(ours[i], theirs[i], rtol=1e-12, atol=1e-12)


class _Recorder(TorchDispatchMode):
    """Records the torch operators that reach the dispatcher below autograd."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_eager_calls_never_cross_torch_ops_hal(seed: int) -> None:
    """No torch.ops.hal operator runs for an eager call: without grad-requiring tensors (or under
    no_grad) the kernel runs directly; a call that needs autograd is one autograd node around it."""
    x = torch.randn(4, 6)
    w = torch.randn(5, 6, requires_grad=True)
    with _Recorder() as rec:
        hal.ops.softmax(x)
        with torch.no_grad():
            assert hal.ops.linear(x, w, None, "none").grad_fn is None
        y = hal.ops.linear(x, w, None, "none")
        y.sum().backward()
    assert not [op for op in rec.ops if op.startswith("hal.")], rec.ops
    assert type(y.grad_fn).__name__ == "HalLinearBackward" and w.grad is not None


def test_training_decomposition_of_linear_with_activation(seed: int, hal_nodes: None) -> None:
    """With autograd, linear+gelu runs as linear(act="none") + scale_shift_act (no GEMM recomputed
    in the backward); without autograd the fused kernel runs; forcing linear's own kernel trains
    through linear_backward. All three agree. (hal's nodes throughout: the CPU backend's torch
    kernels would otherwise be recorded by torch's autograd, with no backward op to see.)"""
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 5, dtype=torch.float64)
    decomposed = torch.autograd.grad(hal.ops.linear(x, w, b, "gelu"), (x, w, b), g)
    ran = {op for (op, _, _), c in hal.stats().items() if c["calls"]}
    assert {"scale_shift_act", "scale_shift_act_backward", "linear_backward"} <= ran and "linear" in ran
    hal.reset_stats()
    with hal.use(backend="cpu_ref", kernel={"linear": "numpy"}):
        fused = torch.autograd.grad(hal.ops.linear(x, w, b, "gelu"), (x, w, b), g)
    ran = {op for (op, _, _), c in hal.stats().items() if c["calls"]}
    assert ran == {"linear", "linear_backward"}, ran
    for a, c in zip(decomposed, fused):
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("padding", [3, (1, 2), (0, 1, 2, 3), "same", "valid"])
def test_padding_encoding_is_the_same_for_the_checker(padding: Any) -> None:
    """conv2d's padding (an int, a pair, four pads or a mode) survives the schema's int[] + str?
    slots: the checker canonicalises the decoded value as it does the original."""
    decl = OPS["conv2d"]
    codec = torch_library.TORCH_OPS["conv2d"].codecs[decl.index("padding")]
    slots: list = []
    codec.encode(padding, slots)
    assert len(slots) == 2 and isinstance(slots[0], list) and (slots[1] is None or isinstance(slots[1], str))
    x, w = torch.randn(1, 2, 6, 6), torch.randn(3, 2, 3, 3)
    assert decl.check(x, w, None, 1, codec.decode(slots), 1, 1) == decl.check(x, w, None, 1, padding, 1, 1)


@pytest.mark.parametrize("value", [2, 0.5, "tensor"], ids=["int", "float", "tensor"])
def test_number_or_array_keeps_its_type(value: Any) -> None:
    """A ScalarOrTensor travels as (Tensor?, Scalar?): an int comes back an int, a tensor the same
    tensor."""
    codec = torch_library.TORCH_OPS["fake_quantize"].codecs[OPS["fake_quantize"].index("zero_point")]
    v = torch.tensor([1, 2], dtype=torch.int32) if value == "tensor" else value
    slots: list = []
    codec.encode(v, slots)
    back = codec.decode(slots)
    assert type(back) is type(v) and (back is v if isinstance(v, torch.Tensor) else back == v)


def test_operators_keep_channels_last_and_fakes_agree(seed: int) -> None:
    """A channels_last network stays channels_last through the torch.ops.hal operators (no copy
    to contiguous per operator, no mix of layouts for Inductor's kernels around them: torch 2.13's
    vectorised CPU reductions over a contiguous and a channels_last bfloat16 input give NaN), and
    each fake kernel reports the strides its operator returns; a contiguous input keeps contiguous
    results."""
    cl = torch.channels_last
    x = torch.randn(2, 8, 6, 6).contiguous(memory_format=cl)
    w = torch.randn(8, 8, 3, 3).contiguous(memory_format=cl)
    g = torch.randn(2, 8, 6, 6).contiguous(memory_format=cl)
    calls = {
        "conv2d": (x, w, None, 1, 1, 1, 1),
        "conv2d_backward": (g, x, w, 1, 1, 1, 1),
        "scale_shift_act": (x, 1.5, 0.25, "gelu"),
        "scale_shift_act_backward": (g, x, 1.5, 0.25, "gelu"),
        "batch_norm": (x, None, None, torch.rand(8) + 0.5, torch.randn(8), True, 0.1, 1e-5),
    }
    for name, args in calls.items():
        for layout in (cl, torch.contiguous_format):
            args_l = tuple(a.contiguous(memory_format=layout) if isinstance(a, torch.Tensor) and a.dim() == 4 else a for a in args)
            top = torch_library.TORCH_OPS[name]
            slots = top.encode(args_l)
            real = top.overload(*slots)
            real = real if isinstance(real, tuple) else (real,)
            four_d = [r for r in real if isinstance(r, torch.Tensor) and r.dim() == 4]
            assert four_d and all(r.is_contiguous(memory_format=layout) for r in four_d), (name, layout, [r.stride() for r in four_d])
            with torch._subclasses.FakeTensorMode() as mode:
                fake = top.overload(*[mode.from_tensor(s) if isinstance(s, torch.Tensor) else s for s in slots])
            fake = fake if isinstance(fake, tuple) else (fake,)
            assert [f.stride() for f in fake if isinstance(f, torch.Tensor)] == [r.stride() for r in real if isinstance(r, torch.Tensor)], name
