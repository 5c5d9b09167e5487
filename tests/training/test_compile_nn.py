"""Every public module of hal.nn, and a GPT-style model built from them, under torch.compile's
default backend (Inductor): outputs, input and parameter gradients and running statistics match
eager hal, in float32 and under bfloat16 autocast, with and without bias, in train and eval mode.

Each compilation costs Inductor seconds on a CI machine, so the modules are compiled in two groups,
each one graph of modules side by side (each module its own input, output and gradient, checked
one by one): the sequence modules (``Linear`` with every activation, the norms) and the
convolution modules (conv-bn-relu, conv-bn-add-relu, conv-bn, in train and eval). Per group and
precision: ``fullgraph=True`` (compiles), then the default options after ``torch._dynamo.reset()``
(Dynamo traces again, without fullgraph, and Inductor's caches answer: no second compilation); and
``dynamic=True`` at two input sizes (one compilation, whose symbolic graph must serve both sizes).

Tolerances. float32: the compiled graph runs hal's opaque kernels as eager does, or Inductor's code
for the kernels made of torch's ops, which sums in another order; no reduction here is longer than
a few hundred terms, so a result stays within ``1e-5 * scale`` of eager's, ``scale`` being the
largest magnitude among the reference values compared (for gradients: among all gradients of the
module, since a gradient that is zero in exact arithmetic, such as a convolution bias ahead of a
training batch norm, is rounding noise of the others). bfloat16 autocast: compared against the
float32 eager result, the compiled result may err by twice what eager hal under the same autocast
errs (the same kernels on the same bfloat16 inputs; Inductor may round less between fused
pointwise ops), plus ``2**-6 * scale`` (torch.testing's relative tolerance for bfloat16: two
roundings of 8 significant bits; the maximum over a small tensor is a noisy statistic, and a
12-element convolution weight gradient behind a training batch norm was seen off by 0.8% of the
scale where eager, by chance, erred by 0.14%); a wrong graph errs by the scale itself. Where a module
ends in a ReLU, the output gradient is zero at the elements whose float64 pre-activation lies within
``1e-4 * scale`` (float32) or ``2**-5 * scale`` (bfloat16: inputs and weights are rounded before the
sums) of zero (:data:`KINK`): there a rounding difference can put an element on the other side of
the kink, a whole gradient element of difference that is no error of the graph (seen: a residual
gradient off by 0.47 in one element of 588 under bfloat16).

The convolution group is pairwise in (bias, train/eval), six modules instead of twelve
(:data:`CONV_CASES`); everything else is the full product, but for the dynamic-shape compilation
under bfloat16 autocast, which CI runs on a few modules of each group (:data:`TRIMMED`: a Linear with
bias and one without, both norms; conv-bn-add-relu and conv-bn in training) and
HAL_TEST_COMPILE_MATRIX=full on all of them.
"""

from __future__ import annotations

import copy
import os
import time
from typing import Any, Callable, Optional, Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import hal
import hal.nn
from hal.ops import ACTIVATIONS
from tests.training.models import randomize_batch_norms

_ACT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "none": lambda z: z,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
}
FLOAT32_SLACK = 1e-5
BFLOAT16_SLACK = 2.0**-6
#: where a ReLU's input lies within this much (relative to its largest) of zero, the output gradient is zero
KINK = {"float32": 1e-4, "bfloat16-autocast": 2.0**-5}


class Side(nn.Module):
    """Modules side by side in one graph: part i gets inputs[i] (a tuple), gives outputs[i]."""

    def __init__(self, parts: dict[str, nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleDict(parts)

    def forward(self, inputs: Sequence[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
        return [part(*x) for part, x in zip(self.parts.values(), inputs)]


def _sequence_modules() -> Side:
    """hal.nn.Linear with each activation, with and without bias; LayerNorm with weight and bias,
    weight only, neither; RMSNorm with and without weight. Parameters random (no ones, no zeros)."""
    parts: dict[str, nn.Module] = {}
    for act in ACTIVATIONS:
        for bias in (True, False):
            parts[f"linear-{act}-{'bias' if bias else 'nobias'}"] = hal.nn.Linear(8, 6, bias=bias, act=act)
    parts["layer_norm"] = hal.nn.LayerNorm(8)
    parts["layer_norm-nobias"] = hal.nn.LayerNorm(8, bias=False)
    parts["layer_norm-noaffine"] = hal.nn.LayerNorm(8, elementwise_affine=False)
    parts["rms_norm"] = hal.nn.RMSNorm(8, eps=1e-6)
    parts["rms_norm-noaffine"] = hal.nn.RMSNorm(8, elementwise_affine=False)
    model = Side(parts)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".layer_norm" in name or ".rms_norm" in name:
                p.uniform_(0.5, 1.5) if name.endswith("weight") else p.normal_(0.0, 0.5)
    return model


#: (module, with a convolution bias, in training) of the convolution group: every module with and
#: without bias and in train and in eval, and bias x mode in all four combinations (pairwise, not
#: the twelve of the full product: the bias is passed through to the op whatever the mode, so a
#: product adds compilation time, not paths)
CONV_CASES = [
    ("conv_bn_relu", True, True), ("conv_bn_relu", False, False),
    ("conv_bn_add_relu", True, False), ("conv_bn_add_relu", False, True),
    ("conv_bn", True, True), ("conv_bn", False, False),
]


def _conv_modules() -> Side:
    """FusedConvBNReLU2d, FusedConvBNAddReLU2d (3x3, padding 1) and FusedConvBN2d (a 1x1 stride-2
    shortcut) as :data:`CONV_CASES` lists them; batch norms with a random state."""
    kinds = {
        "conv_bn_relu": lambda bias: hal.nn.FusedConvBNReLU2d(3, 4, 3, padding=1, bias=bias),
        "conv_bn_add_relu": lambda bias: hal.nn.FusedConvBNAddReLU2d(3, 4, 3, padding=1, bias=bias),
        "conv_bn": lambda bias: hal.nn.FusedConvBN2d(3, 4, 1, stride=2, bias=bias),
    }
    parts: dict[str, nn.Module] = {}
    for kind, bias, train in CONV_CASES:
        parts[f"{kind}-{'bias' if bias else 'nobias'}-{'train' if train else 'eval'}"] = randomize_batch_norms(kinds[kind](bias)).train(train)
    return Side(parts)


def _sequence_inputs(model: Side, size: tuple[int, ...]) -> list[tuple[torch.Tensor, ...]]:
    batch, seq = size
    return [(torch.randn(batch, seq, 8),) for _ in model.parts]


def _conv_inputs(model: Side, size: tuple[int, ...]) -> list[tuple[torch.Tensor, ...]]:
    batch, hw = size
    out = []
    for name in model.parts:
        x = torch.randn(batch, 3, hw, hw)
        out.append((x, torch.randn(batch, 4, hw, hw)) if name.startswith("conv_bn_add_relu") else (x,))
    return out


GROUPS: dict[str, tuple[Callable[[], Side], Callable[[Side, tuple[int, ...]], list], tuple[tuple[int, ...], tuple[int, ...]]]] = {
    # (model, inputs, two sizes for the dynamic run: batch and sequence length / image side)
    "sequence": (_sequence_modules, _sequence_inputs, ((2, 5), (3, 7))),
    "conv": (_conv_modules, _conv_inputs, ((2, 6), (3, 7))),
}


class Then(nn.Module):
    """``tail(inner(x))``: PyTorch's Linear followed by an activation."""

    def __init__(self, inner: nn.Module, tail: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.inner, self.tail = inner, tail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(self.inner(x))


class TorchConvBN(nn.Sequential):
    """PyTorch's conv -> batch norm, then ReLU, a residual add and ReLU, or nothing."""

    def __init__(self, conv: nn.Conv2d, bn: nn.BatchNorm2d, tail: str) -> None:
        super().__init__(conv, bn)
        self.tail = tail

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        y = self[1](self[0](x))
        return {"relu": lambda: F.relu(y), "add_relu": lambda: F.relu(y + residual), "none": lambda: y}[self.tail]()


def _torch_twin(module: nn.Module) -> nn.Module:
    """PyTorch's modules computing what the hal.nn module computes, with copies of its state."""
    if isinstance(module, hal.nn.Linear):
        twin: nn.Module = Then(nn.Linear(module.in_features, module.out_features, module.bias is not None), _ACT[module.act])
        twin.inner.load_state_dict(module.state_dict())
    elif isinstance(module, hal.nn.LayerNorm):
        twin = nn.LayerNorm(module.normalized_shape, module.eps, module.elementwise_affine, bias=module.bias is not None)
        twin.load_state_dict(module.state_dict())
    elif isinstance(module, hal.nn.RMSNorm):
        twin = nn.RMSNorm(module.normalized_shape, module.eps, module.elementwise_affine)
        twin.load_state_dict(module.state_dict())
    else:
        tail = {hal.nn.FusedConvBNReLU2d: "relu", hal.nn.FusedConvBNAddReLU2d: "add_relu", hal.nn.FusedConvBN2d: "none"}[type(module)]
        twin = TorchConvBN(copy.deepcopy(module.conv), copy.deepcopy(module.bn), tail)
    return twin.train(module.training)


class Result:
    """One forward and backward of a Side: per part its output, the gradients of its inputs and
    parameters (in order) and its buffers."""

    def __init__(self, model: Side, outputs: list[torch.Tensor], leaves: list[tuple[torch.Tensor, ...]]) -> None:
        self.outputs = [o.detach() for o in outputs]
        self.grads = [
            [x.grad for x in xs] + [p.grad for p in part.parameters()] for part, xs in zip(model.parts.values(), leaves)
        ]
        self.buffers = [[b.detach().clone() for b in part.buffers()] for part in model.parts.values()]


def _forward(model: nn.Module, inputs: list, bf16: bool, run: Optional[Callable] = None) -> tuple[list[torch.Tensor], list]:
    model.zero_grad(set_to_none=True)
    leaves = [tuple(t.detach().clone().requires_grad_(True) for t in x) for x in inputs]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        outputs = (model if run is None else run)(leaves)
    return outputs, leaves


def _pre_relu(part: nn.Module, x: tuple[torch.Tensor, ...]) -> Optional[torch.Tensor]:
    """What the ReLU ending ``part`` sees (float64, PyTorch's ops; batch statistics in training, the
    running ones in eval); None for a part without a ReLU."""
    if isinstance(part, hal.nn.Linear):
        return F.linear(x[0].double(), part.weight.double(), None if part.bias is None else part.bias.double()) if part.act == "relu" else None
    if not isinstance(part, (hal.nn.FusedConvBNReLU2d, hal.nn.FusedConvBNAddReLU2d)):
        return None
    conv, bn = part.conv, part.bn
    y = F.conv2d(x[0].double(), conv.weight.double(), None if conv.bias is None else conv.bias.double(), conv.stride, conv.padding, conv.dilation, conv.groups)
    y = F.batch_norm(y, bn.running_mean.double(), bn.running_var.double(), bn.weight.double(), bn.bias.double(), part.training, 0.0, bn.eps)
    return y + x[1].double() if len(x) > 1 else y


def _draw_grads(model: Side, leaves: list, outputs: list[torch.Tensor], kink: float) -> list[torch.Tensor]:
    """Random output gradients, exactly representable in bfloat16 (every run backpropagates the
    same values), zero where a ReLU's input lies within ``kink`` (relative to its largest) of zero:
    a rounding difference there puts an element on the other side of the kink, which changes its
    gradient by a whole gradient element and is no error of the graph. Drawn after the forward:
    in training the batch statistics do not depend on the running ones it updated."""
    grads = []
    for part, x, o in zip(model.parts.values(), leaves, outputs):
        g = torch.randn(o.shape).bfloat16().float()
        with torch.no_grad():
            pre = _pre_relu(part, tuple(t.detach() for t in x))
        grads.append(g if pre is None else torch.where(pre.abs() <= kink * pre.abs().max(), 0.0, g))
    return grads


def _step(model: Side, inputs: list, grads: Optional[list], bf16: bool, run: Optional[Callable] = None, kink: float = 0.0) -> tuple[Result, list]:
    """A forward and backward of ``run`` (default: the model) on copies of ``inputs``; ``grads``
    None: drawn here (:func:`_draw_grads`). Returns the result and the gradients used."""
    outputs, leaves = _forward(model, inputs, bf16, run)
    if grads is None:
        grads = _draw_grads(model, leaves, outputs, kink)
    torch.autograd.backward(outputs, [g.to(o.dtype) for g, o in zip(grads, outputs)])
    return Result(model, outputs, leaves), grads


def _within(got: torch.Tensor, eager: torch.Tensor, reference: torch.Tensor, scale: float, slack: float, what: str) -> None:
    """``got`` errs against ``reference`` by at most twice what ``eager`` errs, plus ``slack * scale``."""
    assert got.shape == reference.shape, f"{what}: shape {tuple(got.shape)}, want {tuple(reference.shape)}"
    err = (got.double() - reference.double()).abs().max().item() if got.numel() else 0.0
    eager_err = (eager.double() - reference.double()).abs().max().item() if got.numel() else 0.0
    allowed = 2 * eager_err + slack * scale
    assert err <= allowed, f"{what}: error {err:.3g} against the float32 reference, allowed {allowed:.3g} (eager's {eager_err:.3g})"


def _scale(tensors: Sequence[Optional[torch.Tensor]]) -> float:
    return max((t.abs().max().item() for t in tensors if t is not None and t.numel()), default=0.0)


def _compare(model: Side, got: Result, eager: Result, reference: Result, slack: float, label: str, dtypes: bool = True) -> None:
    """Each part's output, gradients and buffers of ``got`` against ``reference``, eager allowing
    what :func:`_within` says."""
    for i, name in enumerate(model.parts):
        what = f"{label} {name}"
        if dtypes:
            assert got.outputs[i].dtype == eager.outputs[i].dtype, f"{what}: dtype {got.outputs[i].dtype}, eager {eager.outputs[i].dtype}"
        _within(got.outputs[i], eager.outputs[i], reference.outputs[i], _scale([reference.outputs[i]]), slack, f"{what} output")
        grad_scale = _scale(reference.grads[i])
        for j, (g, e, r) in enumerate(zip(got.grads[i], eager.grads[i], reference.grads[i])):
            assert (g is None) == (r is None), f"{what} gradient {j}: {g is None=}, reference {r is None=}"
            if r is not None:
                _within(g, e, r, grad_scale, slack, f"{what} gradient {j}")
        for j, (b, e, r) in enumerate(zip(got.buffers[i], eager.buffers[i], reference.buffers[i])):
            if not r.is_floating_point():  # num_batches_tracked
                assert torch.equal(b, r), f"{what} buffer {j}: {b} against {r}"
            else:
                _within(b, e, r, _scale([r]), slack, f"{what} buffer {j}")


#: the dynamic-shape compilation under bfloat16 autocast is the heaviest part of the matrix (8 to 10 s
#: of Inductor per group on a 2-core machine): by default (CI) it runs on :data:`TRIMMED` parts of
#: each group only, on all of them with HAL_TEST_COMPILE_MATRIX=full
FULL_MATRIX = os.environ.get("HAL_TEST_COMPILE_MATRIX", "") == "full"
TRIMMED = {
    "sequence": {"linear-relu-bias", "linear-gelu_tanh-nobias", "layer_norm", "rms_norm"},
    "conv": {"conv_bn_add_relu-nobias-train", "conv_bn-bias-train"},
}

MODES = {
    # mode: the runs, which share one compilation: (label, torch.compile options, input sizes by index
    # into the group's two sizes)
    "static": [("fullgraph", dict(fullgraph=True), [0]), ("default", {}, [0])],
    "dynamic": [("dynamic", dict(dynamic=True), [0, 1])],
}


@pytest.mark.parametrize(
    "mode,precision",
    [
        ("static", "float32"),
        ("dynamic", "float32"),
        ("static", "bfloat16-autocast"),
        ("dynamic", "bfloat16-autocast"),  # trimmed unless FULL_MATRIX
    ],
)
@pytest.mark.parametrize("group", list(GROUPS))
def test_modules_compile_and_match_eager(group: str, mode: str, precision: str, seed: int) -> None:
    """static: fullgraph=True (one graph), then the defaults after torch._dynamo.reset() (one graph:
    no break; Inductor's caches serve the same graph); dynamic: dynamic=True at two sizes, compiled
    once (under bfloat16 autocast on :data:`TRIMMED` parts unless :data:`FULL_MATRIX`). Each part's output, gradients and running statistics match eager hal's; in float32 also
    PyTorch's modules', in bfloat16 the float32 eager result within bfloat16's tolerance (see the
    module docstring)."""
    make, draw, sizes = GROUPS[group]
    bf16 = precision != "float32"
    slack = BFLOAT16_SLACK if bf16 else FLOAT32_SLACK
    torch.manual_seed(seed)
    original = make()
    if mode == "dynamic" and bf16 and not FULL_MATRIX:
        original = Side({name: part for name, part in original.parts.items() if name in TRIMMED[group]})
        assert len(original.parts) == len(TRIMMED[group]), "a stale name in TRIMMED"
    compiled_model, eager, reference = (copy.deepcopy(original) for _ in range(3))  # eager under autocast; reference in float32
    twin = Side({name: _torch_twin(part) for name, part in original.parts.items()})
    for label, options, which in MODES[mode]:
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("inductor")
        compiled = torch.compile(compiled_model, backend=counter, **options)
        frames, start = [], time.perf_counter()
        for s in (sizes[i] for i in which):
            inputs = draw(original, s)
            want, grads = _step(reference, inputs, None, bf16=False, kink=KINK[precision])
            got, _ = _step(compiled_model, inputs, grads, bf16, compiled)
            at = f"{label} {precision} size {s}:"
            if bf16:
                eager_bf16, _ = _step(eager, inputs, grads, bf16=True)
                _compare(original, got, eager_bf16, want, slack, at)
            else:
                _compare(original, got, want, want, slack, at)
                theirs, _ = _step(twin, inputs, grads, bf16=False)
                _compare(original, got, theirs, theirs, slack, f"{at} against PyTorch's modules:", dtypes=False)
            frames.append(counter.frame_count)
        print(f"{label}: {time.perf_counter() - start:.1f} s (compilation, then eager and compiled runs)")
        # one graph (no break) for static shapes; with dynamic=True the second size compiles nothing
        # (the first may count two frames: Dynamo restarts its analysis once to specialise the
        # modules' float eps, as it does for PyTorch's nn.LayerNorm)
        assert frames[0] == 1 or (label == "dynamic" and frames[0] == 2), f"{label}: {frames[0]} frames compiled (a graph break?)"
        assert frames[-1] == frames[0], f"{label}: recompiled for another size ({frames} frames)"


class Block(nn.Module):
    """A GPT-2 style decoder layer: pre-norm causal self-attention (one qkv projection split into
    heads as views, hal's SDPA) and a gelu_tanh MLP, each with a residual."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = hal.nn.LayerNorm(dim)
        self.c_attn = hal.nn.Linear(dim, 3 * dim)
        self.c_proj = hal.nn.Linear(dim, dim)
        self.ln_2 = hal.nn.LayerNorm(dim)
        self.c_fc = hal.nn.Linear(dim, 4 * dim, act="gelu_tanh")
        self.mlp_proj = hal.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = hal.ops.scaled_dot_product_attention(q, k, v, None, True, None)
        x = x + self.c_proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(self.c_fc(self.ln_2(x)))


class GPT(nn.Module):
    """Blocks, a final LayerNorm and a bias-free head (the GPT-2 layout; token embeddings in)."""

    def __init__(self, layers: int = 2, dim: int = 16, heads: int = 2, vocab: int = 11) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = hal.nn.LayerNorm(dim)
        self.head = hal.nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def test_gpt_block_compiles_fullgraph_and_matches_eager(seed: int) -> None:
    """The GPT-style model compiles with fullgraph=True under Inductor (it once failed: a decision
    read a fake tensor's data pointer) and matches eager hal, forward and backward, in float32."""
    torch.manual_seed(seed)
    model = GPT()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name:
                p.uniform_(0.5, 1.5) if name.endswith("weight") else p.normal_(0.0, 0.5)
    compiled_model = copy.deepcopy(model)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(compiled_model, fullgraph=True, backend=counter)
    for _ in range(2):  # the second call runs the cached graph
        x = torch.randn(2, 7, 16)
        grad = torch.randn(2, 7, 11)
        results = []
        for m, run in ((model, model), (compiled_model, compiled)):
            m.zero_grad(set_to_none=True)
            leaf = x.clone().requires_grad_(True)
            y = run(leaf)
            y.backward(grad)
            results.append((y.detach(), [leaf.grad] + [p.grad for p in m.parameters()]))
        (want_y, want_g), (got_y, got_g) = results
        _within(got_y, want_y, want_y, _scale([want_y]), FLOAT32_SLACK, "output")
        grad_scale = _scale(want_g)
        names = ["x"] + [n for n, _ in model.named_parameters()]
        for n, g, w in zip(names, got_g, want_g):
            _within(g, w, w, grad_scale, FLOAT32_SLACK, f"gradient of {n}")
    assert counter.frame_count == 1
