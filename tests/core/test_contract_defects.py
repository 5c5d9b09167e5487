"""One regression test per contract defect of issue 30 that shows without torch.compile (those that
need it: tests/training/test_compile_contract.py). Each test is named after its defect and fails
on the code before its fix (noted per test); inputs come from the test's seed, never zeros.

The CPU backend's kernels run as the dispatcher chooses them by priority (HAL_TUNE is off in tests,
see the root conftest.py), so oneDNN's kernels are the ones tested where they rank first; where a
defect is a kernel's, every kernel of the op is forced in turn.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hal
from hal.dispatch import kernel_names, memory

ROOT = Path(__file__).resolve().parents[2]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- under autocast, an op's result dtype is its torch function's ------------------------------------


def test_autocast_result_dtypes_are_torchs(seed: int) -> None:
    """Before: hal.ops.linear and matmul returned float32 under bfloat16 autocast (their kernels are
    not autocast ops), torch's functions bfloat16. Now the ops cast as torch casts them, and the
    results match torch's in dtype and (to bfloat16 rounding) in value; norms and softmax on the
    CPU are on no autocast list there, as in torch."""
    g = _gen(seed)
    x, w, b = torch.randn(4, 8, generator=g), torch.randn(6, 8, generator=g), torch.randn(6, generator=g)
    q = torch.randn(2, 2, 5, 8, generator=g)
    img, k = torch.randn(2, 3, 6, 6, generator=g), torch.randn(4, 3, 3, 3, generator=g)
    calls = {
        "linear": (lambda: hal.ops.linear(x, w, b, "gelu"), lambda: F.gelu(F.linear(x, w, b))),
        "matmul": (lambda: hal.ops.matmul(x, w.t()), lambda: torch.matmul(x, w.t())),
        "scaled_dot_product_attention": (lambda: hal.ops.scaled_dot_product_attention(q, q, q), lambda: F.scaled_dot_product_attention(q, q, q)),
        "conv2d": (lambda: hal.ops.conv2d(img, k, None, 1, 1), lambda: F.conv2d(img, k, None, 1, 1)),
        "layer_norm": (lambda: hal.ops.layer_norm(x, (8,)), lambda: F.layer_norm(x, (8,))),
        "softmax": (lambda: hal.ops.softmax(x, -1), lambda: F.softmax(x, -1)),
    }
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for name, (ours, theirs) in calls.items():
            got, want = ours(), theirs()
            assert got.dtype == want.dtype, f"{name}: {got.dtype} under autocast, torch {want.dtype}"
            torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-6 * want.abs().max().item(), msg=name)
    assert hal.ops.linear(x, w, b).dtype == torch.float32  # outside autocast nothing is cast


def test_autocast_attention_backward_takes_its_own_gradient(hal_nodes: None, seed: int) -> None:
    """Before: under autocast, SDPA on float32 inputs returned bfloat16 (its kernel is torch's SDPA,
    which autocast casts inside), and the backward op of hal's node, given the float32 inputs it
    saved, refused the bfloat16 gradient. Now the inputs are cast before the node (hal's node:
    HAL_TORCH_AUTOGRAD=0), and the gradients reach the float32 leaves as torch's do."""
    g = _gen(seed)
    q, k, v = (torch.randn(2, 2, 5, 8, generator=g).requires_grad_(True) for _ in range(3))
    twins = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    grad = torch.randn(2, 2, 5, 8, generator=g).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = hal.ops.scaled_dot_product_attention(q, k, v, None, True)
        want = F.scaled_dot_product_attention(*twins, is_causal=True)
    assert got.dtype == want.dtype == torch.bfloat16
    got.backward(grad)
    want.backward(grad)
    for ours, theirs, name in zip((q, k, v), twins, "qkv"):
        assert ours.grad.dtype == theirs.grad.dtype == torch.float32, name
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=2**-5, atol=2**-5 * theirs.grad.abs().max().item(), msg=name)


# --- NaN propagates as in PyTorch --------------------------------------------------------------------


def _with_nan(t: torch.Tensor, gen: torch.Generator, inf: bool = True) -> torch.Tensor:
    """``t`` with NaN at two random places (and +inf at one: not given to convolutions, whose
    half-precision kernels in torch and hal sum an infinite tap differently, inf in one and NaN in
    the other, which no contract settles)."""
    t = t.clone()
    flat = t.view(-1)
    flat[torch.randint(0, flat.numel(), (2,), generator=gen)] = float("nan")
    if inf:
        flat[torch.randint(0, flat.numel(), (1,), generator=gen)] = float("inf")
    return t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_nan_survives_relu_in_linear_and_fused_conv_bn_relu(dtype: torch.dtype, seed: int) -> None:
    """Before: the CPU backend's oneDNN kernels applied ReLU as a oneDNN post-op, which turns NaN
    into 0, where torch, cpu_ref and a compiled graph keep NaN. Every kernel of the three ops, forced
    in turn, now keeps NaN wherever the float64 result has it (and infinities where it has them),
    and makes NaN nowhere else than there or where torch's own ops in the same dtype make it (torch's
    half-precision convolution spreads a NaN beyond the window it reaches in float64); the finite
    values are the float64 result's to the dtype's rounding."""
    g = _gen(seed)
    x = _with_nan(torch.randn(5, 8, generator=g).to(dtype), g)
    w, b = torch.randn(6, 8, generator=g).to(dtype), torch.randn(6, generator=g).to(dtype)
    img = _with_nan(torch.randn(2, 3, 6, 6, generator=g).to(dtype), g, inf=False)
    k = torch.randn(4, 3, 3, 3, generator=g).to(dtype)
    gamma, beta = torch.rand(4, generator=g) + 0.5, torch.randn(4, generator=g)
    mean, var = torch.randn(4, generator=g) * 0.1, torch.rand(4, generator=g) + 0.5
    res = torch.randn(2, 4, 6, 6, generator=g).to(dtype)

    def conv_bn(t: torch.Tensor, wide: bool) -> torch.Tensor:
        c = (lambda a: a.double()) if wide else (lambda a: a)
        return F.batch_norm(F.conv2d(c(t), c(k), None, 1, 1), c(mean), c(var), c(gamma), c(beta), False)

    calls = {
        "linear": ((x, w, b, "relu"), {}, lambda wide: F.relu(F.linear(x.double(), w.double(), b.double()) if wide else F.linear(x, w, b))),
        "fused_conv_bn_relu": ((img, k, None, gamma, beta, mean, var), dict(padding=1), lambda wide: F.relu(conv_bn(img, wide))),
        "fused_conv_bn_add_relu": ((img, k, None, gamma, beta, mean, var, res), dict(padding=1),
                                   lambda wide: F.relu(conv_bn(img, wide) + (res.double() if wide else res))),
    }
    tol = 2**-6 if dtype == torch.bfloat16 else 1e-5
    for op, (args, kwargs, reference) in calls.items():
        exact, torchs = reference(True), reference(False)
        assert exact.isnan().any(), "the case must carry NaN to the output"
        tried = 0
        for kernel in sorted(kernel_names(op) - {"composite"}):
            with hal.use(backend="cpu", kernel={op: kernel}):
                try:
                    got = getattr(hal.ops, op)(*args, **kwargs)
                except hal.UnsupportedError:
                    continue  # a kernel that declines these inputs (its dtype, eval-only) is not at fault
            tried += 1
            where = f"{op} via cpu/{kernel} in {dtype}"
            lost = exact.isnan() & ~got.isnan()
            assert not lost.any(), f"{where}: NaN lost at {lost.sum()} places ({got[lost].tolist()[:4]})"
            made = got.isnan() & ~exact.isnan() & ~torchs.isnan()
            assert not made.any(), f"{where}: NaN made at {made.sum()} places"
            assert torch.equal(got.isinf(), exact.isinf()), where
            finite = exact.isfinite() & got.isfinite()
            torch.testing.assert_close(got[finite].double(), exact[finite], rtol=tol, atol=tol * exact[finite].abs().max().item(), msg=where)
        assert tried, f"{op}: no kernel of the cpu backend ran these inputs"


# --- in-place writes into overlapping memory -----------------------------------------------------------


def test_fused_adamw_refuses_an_overlapping_parameter(seed: int) -> None:
    """Before: a parameter viewed with as_strided so that its elements share memory (which
    torch._debug_has_internal_overlap calls too hard to tell) was written without an error, its
    result depending on the order of the writes. Now it is refused before anything is written; a
    strided view without overlap still steps, as torch's AdamW steps it."""
    g = _gen(seed)
    storage = torch.randn(10, generator=g)
    param = storage.as_strided((4, 4), (2, 1))
    assert torch._debug_has_internal_overlap(param) == 2  # what torch cannot decide
    before = storage.clone()
    grads, m, v = [torch.randn(4, 4, generator=g)], [torch.rand(4, 4, generator=g)], [torch.rand(4, 4, generator=g)]
    moments = (m[0].clone(), v[0].clone())
    options = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=3)
    with pytest.raises(hal.InvalidArgumentError, match="share memory"):
        hal.ops.fused_adamw_([param], grads, m, v, **options)
    assert torch.equal(storage, before) and torch.equal(m[0], moments[0]) and torch.equal(v[0], moments[1])  # nothing written
    with pytest.raises(hal.InvalidArgumentError, match="share memory"):  # NumPy's as_strided, too
        hal.ops.fused_adamw_([np.lib.stride_tricks.as_strided(storage.numpy().copy(), (4, 4), (8, 4))],
                             [a.numpy() for a in grads], [a.numpy().copy() for a in m], [a.numpy().copy() for a in v], **options)

    spaced = torch.randn(40, generator=g).as_strided((4, 4), (8, 2))  # strided, no element shared
    ref = nn.Parameter(spaced.detach().clone())
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    ref.grad = grads[0].clone()
    opt.step()
    hal.ops.fused_adamw_([spaced], grads, [torch.zeros(4, 4)], [torch.zeros(4, 4)], **{**options, "step": 1})
    torch.testing.assert_close(spaced, ref.detach(), rtol=1e-5, atol=1e-6)


# --- hal.nn keeps state_dict keys, and takes what torch's modules take --------------------------------


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.down = nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4))
        self.fc, self.norm = nn.Linear(4, 5), nn.LayerNorm(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.conv(x)))
        y = torch.relu(self.down(y) + y).mean((2, 3))
        return self.norm(F.gelu(self.fc(y)))


def test_fuse_keeps_every_state_dict_key(seed: int) -> None:
    """Before: hal.nn.fuse moved a fused conv's parameters to ``conv.0.weight`` and its batch
    norm's to ``conv.1.*`` (bn's keys gone), so a checkpoint of the original model no longer loaded.
    Now the keys are the model's: its checkpoint loads strictly into the fused model, which then
    computes what the original does (train and eval), and the fused model's loads back."""
    torch.manual_seed(seed)
    model = _Net()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.3), m.running_var.uniform_(0.5, 1.5), m.weight.uniform_(0.5, 1.5), m.bias.normal_(0, 0.3)
    fused = hal.nn.fuse(_Net())
    assert any(isinstance(m, hal.nn.FusedConvBNReLU2d) for m in fused.modules()), "nothing was fused: the test would prove nothing"
    assert set(fused.state_dict()) == set(model.state_dict())
    fused.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 6, 6, generator=_gen(seed))
    for train in (False, True):
        torch.testing.assert_close(fused.train(train)(x), model.train(train)(x), rtol=1e-4, atol=1e-5)
    back = _Net()
    back.load_state_dict(fused.state_dict())
    for (name, a), b in zip(back.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_patched_norm_takes_half_input_beside_float32_weights(kind: str, seed: int) -> None:
    """Before: a patched LayerNorm given a bfloat16 input with its float32 weights (a model in
    bfloat16 whose norms were kept in float32) raised InvalidArgumentError, which nn.LayerNorm
    accepts. Now it returns nn.LayerNorm's dtype and values (RMSNorm likewise)."""
    torch.manual_seed(seed)
    torch_norm = (nn.LayerNorm(16) if kind == "LayerNorm" else nn.RMSNorm(16, eps=1e-6))
    with torch.no_grad():
        torch_norm.weight.uniform_(0.5, 1.5)
        if kind == "LayerNorm":
            torch_norm.bias.normal_(0, 0.5)
    patched = hal.nn.patch(nn.Sequential(copy.deepcopy(torch_norm)))[0]
    assert type(patched).__name__ == kind and type(patched).__module__ == "hal.nn.modules"
    x = (torch.randn(3, 16, generator=_gen(seed)) * 2).bfloat16()
    got, want = patched(x), torch_norm(x)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-6)


# --- tensors hal cannot take ---------------------------------------------------------------------------


def test_sparse_nested_and_wrapper_subclass_tensors_raise_invalid_argument(seed: int) -> None:
    """Before: a sparse CSR or nested tensor raised torch's RuntimeError from the dispatcher's cache
    key (it has no strides), before any check; a wrapper subclass reached a NumPy kernel's
    ``.numpy()``. Now each raises InvalidArgumentError naming the argument and what to do, on the
    CPU backend and on cpu_ref (whose kernels are NumPy's)."""
    from torch.testing._internal.two_tensor import TwoTensor

    dense = torch.randn(3, 4, generator=_gen(seed))
    unusable = {
        "sparse CSR": (dense.to_sparse_csr(), "layout torch.sparse_csr"),
        "sparse COO": (dense.to_sparse(), "layout torch.sparse_coo"),
        "nested (strided)": (torch.nested.nested_tensor([dense, dense[:2]]), "nested tensor"),
        "nested (jagged)": (torch.nested.nested_tensor([dense, dense[:2]], layout=torch.jagged), "nested tensor"),
        "wrapper subclass": (TwoTensor(dense, dense.clone()), "TwoTensor"),
    }
    for backend in ("cpu", "cpu_ref"):
        for what, (t, says) in unusable.items():
            with hal.use(backend=backend), pytest.raises(hal.InvalidArgumentError, match=says) as info:
                hal.ops.softmax(t, -1)
            assert "argument 'x'" in str(info.value), (backend, what, str(info.value))
    plain = torch.randn(3, 4, generator=_gen(seed)).as_subclass(type("Mine", (torch.Tensor,), {}))  # a subclass holding its own memory
    torch.testing.assert_close(hal.ops.softmax(plain, -1).as_subclass(torch.Tensor), F.softmax(plain.as_subclass(torch.Tensor), -1))


# --- results beyond memory ---------------------------------------------------------------------------


def test_results_beyond_free_memory_raise_unsupported_before_allocating(seed: int) -> None:
    """Before: a valid call whose result cannot fit (a matmul of expanded views; int8_linear on an
    expanded input, whose result an expanded x makes huge) reached torch's allocator, which raised
    its RuntimeError (137 GB asked for in the issue). Now it raises UnsupportedError at once, saying
    how much was needed and how much is free, and nothing large is allocated."""
    free = memory.free_bytes(_cpu_inputs())
    assert free is not None and free > 0
    n = int(free**0.5) + 1  # an (n, n) float32 result: four times the free memory
    g = _gen(seed)
    a = torch.randn(1, 1, generator=g).expand(n, 1)
    b = torch.randn(1, 1, generator=g).expand(1, n)
    rows = 4 * free // (2 * 8) + 1  # int8_linear: (rows, 8) float16 results, four times the free memory
    x_q = torch.randint(-5, 5, (1, 16), generator=g, dtype=torch.int8).expand(rows, 16)
    w_q = torch.randint(-5, 5, (8, 16), generator=g, dtype=torch.int8)
    started = time.perf_counter()
    with pytest.raises(hal.UnsupportedError, match="results need .* free; nothing was allocated"):
        hal.ops.matmul(a, b)
    with pytest.raises(hal.UnsupportedError, match="results need .* free; nothing was allocated"):
        hal.ops.int8_linear(x_q, w_q, 0.05, torch.rand(8, generator=g) + 0.01)
    assert time.perf_counter() - started < 30, "refused only after trying to compute"
    small = hal.ops.matmul(a[:7], b[:, :5])  # the same views, small enough: computed
    torch.testing.assert_close(small, a[:7] @ b[:, :5])


def _cpu_inputs() -> object:
    from hal.plugin import Inputs

    return Inputs(hal.registry.get_op("softmax"), (torch.zeros(1), -1), "cpu", torch.device("cpu"), "float32", "torch")


# --- hal.explain lists every candidate ------------------------------------------------------------------


def test_explain_lists_every_candidate_kernel_with_its_reasons(seed: int) -> None:
    """Before: hal.explain listed the chosen backend's kernels only (softmax on the CPU: cpu/torch
    alone), though the contract promises every candidate kernel with its reasons. Now the kernels of
    every other backend of the device are listed, each saying why it was not tried, with their own
    capability reasons where they have some; so does a forced backend's decision."""
    from hal.dispatch import DISPATCHER

    x = torch.randn(3, 5, generator=_gen(seed))
    rt = DISPATCHER.runtime()
    every = {(s.name, k.name) for s in rt.backends_for("cpu") if s.available for k in rt.kernels("softmax", s.name)}
    decision = hal.explain("softmax", x, -1)
    listed = {(c.backend, c.kernel) for c in decision.candidates}
    assert every <= listed, every - listed
    assert {b for b, _ in every} >= {"cpu", "cpu_ref"}, "the test needs two CPU backends"
    others = [c for c in decision.candidates if c.backend != decision.backend]
    assert others and all(c.reasons and c.reasons[0].startswith("not tried") and not c.chosen for c in others), others
    assert "cpu_ref/numpy" in str(decision)
    with hal.use(backend="cpu_ref"):
        forced = hal.explain("softmax", x, -1)
    assert forced.backend == "cpu_ref" and any(c.backend == "cpu" and "forced" in c.reasons[0] for c in forced.candidates), forced


def test_conformance_help_names_the_backend_it_picks() -> None:
    """Before: ``hal conformance --help`` said the default backend is cpu_ref without a GPU; the code
    picks the highest-priority usable CPU backend, cpu when it is installed."""
    from hal.conformance.runner import default_backend

    env = {**os.environ, "COLUMNS": "400"}  # argparse wraps help at the terminal's width
    out = subprocess.run([sys.executable, "-m", "hal", "conformance", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert default_backend() == "cpu"  # CI: no GPU, cpu installed
    assert "else the highest-priority CPU backend: cpu, or cpu_ref where cpu is not installed" in text, text


# --- ops and kernels from user code, in-process -------------------------------------------------------

IN_PROCESS = textwrap.dedent(
    """
    import numpy as np, torch, hal
    from hal.conformance.cases import Call, case, register_cases
    from hal.types import Tensor

    @hal.library.declare(dtypes=("float32", "float64"), tolerances=hal.library.ELEMENTWISE, backward="tri_backward", gradients="x")
    def tri(x: Tensor, factor: float = 2.0) -> Tensor:
        '''factor * x**3, declared by a user script.'''

    @tri.checker
    def _check(x, factor):
        if not isinstance(factor, float) or factor <= 0:
            raise hal.InvalidArgumentError("tri", "factor", "a positive float", repr(factor))

    @tri.fake
    def _(a):
        return a["x"].new_empty(a["x"].shape)

    @hal.library.declare(dtypes=("float32", "float64"), tolerances=hal.library.ELEMENTWISE, forward="tri")
    def tri_backward(grad_out: Tensor, x: Tensor, factor: float = 2.0) -> Tensor:
        '''grad_out * 3 * factor * x**2'''

    @tri_backward.fake
    def _(a):
        return a["x"].new_empty(a["x"].shape)

    # the reference first, on the installed cpu_ref backend: the op runs there alone
    @hal.library.register_kernel("tri", backend="cpu_ref", name="numpy")
    def tri_ref(x, factor):
        return (factor * np.asarray(x, np.float64) ** 3).astype(x.dtype)

    @hal.library.register_kernel("tri_backward", backend="cpu_ref", name="numpy")
    def tri_backward_ref(grad_out, x, factor):
        return (np.asarray(grad_out, np.float64) * 3 * factor * np.asarray(x, np.float64) ** 2).astype(x.dtype)

    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(SEED), dtype=torch.float64)
    assert torch.allclose(hal.ops.tri(x, 1.5), 1.5 * x**3) and hal.explain("tri", x, 1.5).kernel == "numpy"

    # a backend of this process, ranked first, and a kernel added to the installed cpu backend
    hal.library.define_backend("mine", priority=1000, device_types=("cpu",))
    ran = []

    @hal.library.register_kernel("tri", backend="mine", name="torch")
    def tri_mine(x, factor):
        ran.append("mine")
        return factor * x * x * x

    @hal.library.register_kernel("tri_backward", backend="mine", name="torch")
    def tri_backward_mine(grad_out, x, factor):
        return grad_out * (3.0 * factor) * x * x

    @hal.library.register_kernel("tri", backend="cpu", name="extra", priority=5)
    def tri_cpu(x, factor):
        return factor * x.pow(3)

    d = hal.explain("tri", x, 1.5)                        # decided again: the new kernels are candidates
    assert (d.backend, d.kernel) == ("mine", "torch"), d
    assert {("cpu", "extra"), ("cpu_ref", "numpy")} <= {(c.backend, c.kernel) for c in d.candidates}, d
    assert "mine" in [b.name for b in hal.backends()]
    y = hal.ops.tri(x, 1.5)
    assert ran == ["mine"] and torch.allclose(y, 1.5 * x**3)
    with hal.use(backend="cpu"):
        assert torch.allclose(hal.ops.tri(x, 1.5), 1.5 * x**3) and hal.explain("tri", x, 1.5).kernel == "extra"

    xg = x.clone().requires_grad_(True)                   # autograd through the declared backward op
    hal.ops.tri(xg, 1.5).sum().backward()
    assert torch.allclose(xg.grad, 4.5 * x**2)
    op = torch.ops.hal.tri.default                        # torch.ops.hal.<name> with its fake kernel
    torch.library.opcheck(op, (x, 2.0), test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    xc = x.clone().requires_grad_(True)
    torch.compile(lambda t: hal.ops.tri(t, 2.0).sum(), fullgraph=True, backend="aot_eager")(xc).backward()
    assert torch.allclose(xc.grad, 6.0 * x**2)

    for bad, message in ((lambda: hal.ops.tri(x, -1.0), "argument 'factor'"),):
        try:
            bad()
        except hal.InvalidArgumentError as exc:
            assert message in str(exc), exc
        else:
            raise AssertionError("a bad factor was accepted")
    refused = [
        lambda: hal.library.register_kernel("tri", backend="mine", name="torch")(tri_mine),           # the name is taken
        lambda: hal.library.register_kernel("tri", backend="nowhere", name="k")(tri_mine),            # no such backend
        lambda: hal.library.register_kernel("tri", backend="mine", name="k2")(lambda x: x),           # wrong parameters
        lambda: hal.library.define_backend("cpu", priority=1, device_types=("cpu",)),                 # the backend exists
    ]
    for register in refused:
        try:
            register()
        except hal.InvalidArgumentError:
            pass
        else:
            raise AssertionError("a registration that should be refused was accepted")

    def draw(d, shape):
        return Call({"x": d.normal(*shape), "factor": d.scalar(0.5, 3.0)})

    def draw_backward(d, shape):
        return Call({"grad_out": d.normal(*shape), **draw(d, shape).args})

    register_cases("tri", [case("small", draw, quick=True, shape=(3, 5)), case("odd", draw, shape=(7, 13))])
    register_cases("tri_backward", [case("small", draw_backward, quick=True, shape=(4, 6))])
    from hal.conformance.runner import Suite                 # the backend's kernels against the reference
    suite = Suite(backend="mine", ops=["tri*"])
    statuses = {r.id: r.status for r in suite.run(suite.plan())}
    assert len(statuses) == 6 and set(statuses.values()) == {"pass"}, statuses
    print("in-process ok")
    """
)


def test_ops_and_kernels_can_be_declared_and_registered_in_process(seed: int) -> None:
    """Before: there was no documented way to declare an op and register a kernel in-process (as
    torch.library.custom_op allows): only entry-point plugins were loaded, and a runtime built by
    hand replaced them all. hal.library (docs/library.md) declares, registers on installed
    backends or on a backend of the process, and takes effect at once: hal.ops, torch.ops.hal
    (opcheck), autograd through the declared backward, torch.compile, explain, the conformance
    suite against a reference registered the same way; bad registrations are refused. In a fresh
    interpreter: registrations last for the process."""
    out = subprocess.run([sys.executable, "-c", IN_PROCESS.replace("SEED", str(seed))], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    assert "in-process ok" in out.stdout


# --- hal bench: spread, noisy rows, % copy BW -------------------------------------------------------------


def test_bench_shows_spread_warns_of_noisy_rows_and_measures_bandwidth_against_the_footprint(capsys: pytest.CaptureFixture[str]) -> None:
    """Before: hal bench printed medians without their spread, said nothing of rows whose samples
    scattered, and on the CPU its "% copy BW" reached 1266%: the CPU cases move about 1 MiB, which
    stays in cache, and were divided by a DRAM copy (the bytes counted were right). Now each time
    carries its spread, a row whose hal or peer spread passes 10% is marked noisy (⚠, a section,
    a warning as it runs), and each row's bandwidth is taken against a copy of its own footprint."""
    from hal.cli import main
    from hal_bench import report, timing

    assert timing.spread([10.0, 10.0, 10.0, 10.0]) == 0.0
    assert timing.spread([9.0, 10.0, 10.0, 11.0, 30.0]) == pytest.approx((11.0 - 10.0) / 10.0)  # quartiles, not the outlier
    assert timing.spread([10.0, 12.0]) == pytest.approx(2.0 / 11.0)  # two samples: their range over their median

    assert main(["bench", "--backend", "cpu", "--ops", "softmax", "--json"]) == 0
    captured = capsys.readouterr()
    doc = __import__("json").loads(captured.out)
    assert doc["ceilings"]["copy_bytes"] >= 4 * (doc["ceilings"]["cache_bytes"] or 0)  # the device's copy: beyond its cache
    for r in doc["results"]:
        assert r["hal_spread"] >= 0 and all("spread" in p for p in r["peers"].values() if "us" in p), r
        assert r["copy_bytes_per_s"] > 0
        assert r["bw_fraction"] == pytest.approx(r["bytes"] / (r["hal_us"] * 1e-6) / r["copy_bytes_per_s"])
        assert r["noisy"] == [s for s in r["noisy"] if s.split(" ±")[0] in {"hal", *(k.removeprefix("peer:") for k in r["peers"])}]
        if r["noisy"]:
            assert f"warning: noisy timings ({', '.join(r['noisy'])})" in captured.err

    quiet = {"op": "softmax", "case": "a", "dtype": "float32", "hal_us": 10.0, "hal_spread": 0.02, "peers": {"eager": {"us": 20.0, "ratio": 2.0, "spread": 0.01}}}
    loud = dict(quiet, case="b", hal_spread=0.3, noisy=["hal ±30%"])
    md = report.to_markdown({"results": [dict(quiet, noisy=[]), loud]})
    assert "| a | float32 | - | 10.0 µs ±2% |" in md and "| b ⚠ | float32 | - | 10.0 µs ±30% |" in md
    assert "## Noisy rows (1)" in md and "- softmax, b: hal ±30%" in md
