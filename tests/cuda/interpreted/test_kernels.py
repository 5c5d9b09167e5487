"""The CUDA plugin's kernels on small CPU tensors, Triton kernels running in the interpreter,
against cpu_ref in float64.

This module only runs with TRITON_INTERPRET=1 set before Triton is imported, which
tests/cuda/test_interpreter.py arranges by running it in a subprocess (the same process also
compiles the kernels ahead of time, which the interpreter mode forbids). The kernels are called
directly, with canonical arguments, as the dispatcher would call them on a GPU; launch
configurations for CPU tensors are small, so multi-program paths run on tiny inputs.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.cuda._support import assert_close, fresh_seed, reference

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="run by tests/cuda/test_interpreter.py with TRITON_INTERPRET=1"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # NumPy's "invalid value" inside the interpreter
]

if os.environ.get("TRITON_INTERPRET") == "1":
    from hal_backend_cuda import conv, plugin


def kern(op: str, name: str):
    """The function of the CUDA backend's kernel ``name`` of ``op`` (the kit's or the plugin's own)."""
    return next(k.fn for k in plugin.kernels if k.op == op and k.name == name)

DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(fresh_seed())


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale + shift).to(dtype)


def check(op: str, kernel_fn, args: tuple, outputs=None, inplace: tuple[str, ...] = ()) -> None:
    """Run kernel_fn(*args) and compare its results (and in-place arguments) with cpu_ref."""
    from hal.registry import get_op

    decl = get_op(op)
    want, ref_args = reference(op, *args)
    got = kernel_fn(*args)
    if outputs is None:
        got_t, want_t = (got,), (want,)
    else:
        got_t, want_t = tuple(got), tuple(want)
    assert len(got_t) == len(want_t)
    for i, (g, w) in enumerate(zip(got_t, want_t)):
        if g is None and w is None:
            continue
        assert_close(op, g, torch.as_tensor(w), args, what=f"output {i}")
    for name in inplace:
        i = decl.index(name)
        got_v, want_v = args[i], ref_args[i]
        if isinstance(got_v, (list, tuple)):
            for j, (g, w) in enumerate(zip(got_v, want_v)):
                assert_close(op, g, w, args, what=f"{name}[{j}]")
        elif got_v is not None:
            assert_close(op, got_v, want_v, args, what=name)


# --- elementwise ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "x_shape,scale_shape,shift_shape,channels_last",
    [((2, 6, 5, 3), (6, 1, 1), None, False), ((2, 6, 5, 3), None, (3,), True), ((7, 33), (33,), (7, 1), False), ((37,), None, None, False)],
)
@pytest.mark.parametrize("act", ["relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh", "none"])
def test_scale_shift_act(gen, dtype, x_shape, scale_shape, shift_shape, channels_last, act):
    x = randn(gen, *x_shape, dtype=dtype)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    scale = randn(gen, *scale_shape, dtype=dtype) if scale_shape else 0.75
    shift = randn(gen, *shift_shape, dtype=dtype) if shift_shape else -0.25
    check("scale_shift_act", kern("scale_shift_act", "triton"), (x, scale, shift, act))
    g = randn(gen, *x_shape, dtype=dtype)
    backward = kern("scale_shift_act_backward", "triton")
    check("scale_shift_act_backward", backward, (g, x, scale, shift, act, (True, True, True)), outputs=3)
    if act in ("gelu", "relu"):  # gradients left out of the mask: neither reduced nor returned
        for mask in ((True, False, True), (True, False, False), (False, True, False)):
            check("scale_shift_act_backward", backward, (g, x, scale, shift, act, mask), outputs=3)


# --- norms and softmax ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,normalized", [((5, 3, 24), (24,)), ((3, 37), (37,)), ((2, 4, 5), (4, 5)), ((4, 40), (40,))])
def test_layer_norm(gen, dtype, shape, normalized):
    x = randn(gen, *shape, dtype=dtype, scale=2.0, shift=1.0)
    w, b = randn(gen, *normalized, dtype=dtype), randn(gen, *normalized, dtype=dtype)
    check("layer_norm", kern("layer_norm", "triton"), (x, normalized, w, b, 1e-5))
    g = randn(gen, *shape, dtype=dtype)
    check("layer_norm_backward", kern("layer_norm_backward", "triton"), (g, x, normalized, w, 1e-5), outputs=3)
    check("layer_norm_backward", kern("layer_norm_backward", "triton"), (g, x, normalized, None, 1e-5), outputs=3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,normalized", [((6, 20), (20,)), ((3, 70), (70,))])
def test_rms_norm(gen, dtype, shape, normalized):
    x = randn(gen, *shape, dtype=dtype, shift=0.5)
    w = randn(gen, *normalized, dtype=dtype)
    check("rms_norm", kern("rms_norm", "triton"), (x, normalized, w, 1e-6))
    g = randn(gen, *shape, dtype=dtype)
    check("rms_norm_backward", kern("rms_norm_backward", "triton"), (g, x, normalized, w, 1e-6), outputs=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,dim", [((5, 30), 1), ((3, 100), 1), ((4, 6, 5), 1), ((6, 3), 0)])
def test_softmax(gen, dtype, shape, dim):
    x = randn(gen, *shape, dtype=dtype, scale=3.0)
    check("softmax", kern("softmax", "triton"), (x, dim))
    out = torch.softmax(x.double(), dim).to(dtype)
    g = randn(gen, *shape, dtype=dtype)
    check("softmax_backward", kern("softmax_backward", "triton"), (g, out, dim))


def test_softmax_all_minus_inf_row_is_nan():
    x = torch.full((2, 40), -float("inf"))
    x[1] = torch.linspace(-1, 1, 40)
    y = kern("softmax", "triton")(x, 1)
    assert torch.isnan(y[0]).all() and torch.allclose(y[1].sum(), torch.tensor(1.0))


# --- batch norm and the fused convolution ---------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES + (torch.float64,))
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("channels_last", [False, True])
def test_batch_norm(gen, dtype, training, channels_last):
    x = randn(gen, 3, 5, 4, 6, dtype=dtype, scale=2.0, shift=3.0)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    pdt = torch.float64 if dtype == torch.float64 else torch.float32  # float32 stats beside half x
    w, b = randn(gen, 5, dtype=pdt), randn(gen, 5, dtype=pdt)
    rm, rv = randn(gen, 5, dtype=pdt), torch.rand(5, generator=gen, dtype=pdt) + 0.5
    check("batch_norm", kern("batch_norm", "triton"), (x, rm, rv, w, b, training, 0.1, 1e-5), inplace=("running_mean", "running_var"))
    g = randn(gen, 3, 5, 4, 6, dtype=dtype)
    check("batch_norm_backward", kern("batch_norm_backward", "triton"), (g, x, rm, rv, w, training, 1e-5), outputs=3)


def test_batch_norm_backward_leaves_running_statistics_alone(gen):
    """A backward reads the running statistics and never writes them, even where the recomputed
    batch statistics are not finite (a write of (1 - 0) * r + 0 * inf would leave NaN)."""
    x = randn(gen, 3, 5, 4, 6, scale=2.0)
    x[1, 2, 0, 0] = float("inf")
    rm, rv = randn(gen, 5), torch.rand(5, generator=gen) + 0.5
    before = rm.clone(), rv.clone()
    kern("batch_norm_backward", "triton")(randn(gen, 3, 5, 4, 6), x, rm, rv, randn(gen, 5), True, 1e-5)
    assert torch.equal(rm, before[0]) and torch.equal(rv, before[1])


@pytest.fixture
def in_hals_node():
    """Kernels called as the forward of hal's autograd node calls them: keeping for the backward op."""
    from hal.integration import kept

    previous = kept.arm(True)
    yield
    kept.arm(previous)


def test_batch_norm_backward_reuses_the_forwards_statistics_only_for_the_unchanged_input(gen, monkeypatch, in_hals_node):
    """The training forward keeps its statistics for the backward of the same x; after an in-place
    change of x (a new version) the backward recomputes them and follows the new data."""
    from hal_triton import batchnorm

    recomputed = []
    real = batchnorm.affine_params
    monkeypatch.setattr(batchnorm, "affine_params", lambda *a, **k: recomputed.append(a[-3]) or real(*a, **k))
    x = randn(gen, 4, 6, 3, 5).contiguous(memory_format=torch.channels_last)
    w, b, g = randn(gen, 6, shift=1.5), randn(gen, 6), randn(gen, 4, 6, 3, 5)
    fwd, bwd = kern("batch_norm", "triton"), kern("batch_norm_backward", "triton")
    fwd(x, None, None, w, b, True, 0.1, 1e-5)
    check("batch_norm_backward", bwd, (g, x, None, None, w, True, 1e-5), outputs=3)
    assert recomputed == [True], "the backward recomputed what the forward kept"  # the forward's own call only
    fwd(x, None, None, w, b, True, 0.1, 1e-5)
    x.mul_(3.0).add_(1.0)
    check("batch_norm_backward", bwd, (g, x, None, None, w, True, 1e-5), outputs=3)
    assert recomputed == [True, True, False], "the backward used statistics of x before its in-place change"
    check("batch_norm_backward", bwd, (g, x, None, None, w, True, 1e-5), outputs=3)  # nothing kept: recomputed


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape", [(4, 5, 3, 6), (7, 5)])
def test_native_batch_norm_pair(gen, training, affine, shape, monkeypatch, in_hals_node):
    """torch's own batch norm, the training forward keeping its statistics for the backward of the
    same x (float32 here: torch's CPU kernels accumulate half precision in it too coarsely; the
    H200 conformance run checks every dtype on the device)."""
    calls = []
    real = torch.native_batch_norm
    monkeypatch.setattr(torch, "native_batch_norm", lambda *a: calls.append(a[5]) or real(*a))
    x = randn(gen, *shape)
    x = x.contiguous(memory_format=torch.channels_last) if x.ndim == 4 else x
    rm, rv = randn(gen, 5), randn(gen, 5).abs() + 0.5
    w, b = (randn(gen, 5, shift=1.5), randn(gen, 5)) if affine else (None, None)
    g = randn(gen, *shape)
    check("batch_norm", kern("batch_norm", "native"), (x, rm, rv, w, b, training, 0.1, 1e-5), inplace=("running_mean", "running_var"))
    check("batch_norm_backward", kern("batch_norm_backward", "native"), (g, x, None if training else rm, None if training else rv, w, training, 1e-5), outputs=3)
    assert calls == ([True] if training else []), "the training backward recomputed the statistics its forward kept"


def test_batch_norm_2d_input_without_affine(gen):
    x = randn(gen, 9, 4, shift=-2.0)
    check("batch_norm", kern("batch_norm", "triton"), (x, None, None, None, None, True, 0.1, 1e-5))


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("padding", [(1, 1, 1, 1), (0, 1, 0, 1)])
def test_fused_conv_bn_relu(gen, training, padding):
    x = randn(gen, 2, 3, 7, 6)
    cw, cb = randn(gen, 4, 3, 3, 3, scale=0.3), randn(gen, 4)
    bw, bb = randn(gen, 4), randn(gen, 4)
    rm, rv = randn(gen, 4), torch.rand(4, generator=gen) + 0.5
    args = (x, cw, cb, bw, bb, rm, rv, (1, 1), padding, (1, 1), 1, 1e-5, 0.1, training)
    check("fused_conv_bn_relu", kern("fused_conv_bn_relu", "cudnn_triton"), args, inplace=("running_mean", "running_var"))
    y = kern("fused_conv_bn_relu", "cudnn_triton")(*args)
    g = randn(gen, *y.shape)
    bargs = (g, x, cw, cb, bw, bb, rm, rv, (1, 1), padding, (1, 1), 1, 1e-5, training)
    check("fused_conv_bn_relu_backward", kern("fused_conv_bn_relu_backward", "cudnn_triton"), bargs, outputs=5)


@pytest.mark.parametrize("op,name", [("fused_conv_bn_relu", "cudnn_triton"), ("batch_norm", "triton")])
def test_eval_at_eps_zero_and_zero_variance_is_the_ops_formula(gen, op, name):
    """eval, eps = 0, a zero running variance: the scale is +inf and the shift bias - mean * scale
    +inf, so the op's formula (torch's CPU composite) gives +inf where the convolution output (its
    bias included) is positive and NaN where it is negative; adding the conv bias after the scaling
    gave other values. NaN, +inf and -inf at cpu_ref's places, the rest close."""
    x = randn(gen, 2, 3, 7, 6)
    cw, cb = randn(gen, 4, 3, 3, 3, scale=0.3), randn(gen, 4)
    bw, bb = randn(gen, 4).abs(), randn(gen, 4)
    rm, rv = -randn(gen, 4).abs(), torch.rand(4, generator=gen) + 0.5
    rv[2] = 0.0
    if op == "batch_norm":
        args = (torch.nn.functional.conv2d(x, cw, cb), rm, rv, bw, bb, False, 0.1, 0.0)
    else:
        args = (x, cw, cb, bw, bb, rm, rv, (1, 1), (1, 1, 1, 1), (1, 1), 1, 0.0, 0.1, False)
    want = torch.as_tensor(reference(op, *args)[0])
    got = kern(op, name)(*args).double()
    assert want.isnan().any() and (want == float("inf")).any()
    for mask in (torch.isnan, lambda t: t == float("inf"), lambda t: t == -float("inf")):
        assert torch.equal(mask(got), mask(want))
    torch.testing.assert_close(got[want.isfinite()], want[want.isfinite()], atol=1e-4, rtol=1e-4)


def test_conv2d_asymmetric_padding_and_backward(gen):
    x, w, b = randn(gen, 2, 4, 6, 5), randn(gen, 6, 2, 2, 3), randn(gen, 6)
    args = ((2, 1), (0, 1, 1, 1), (1, 2), 2)
    check("conv2d", conv.conv2d, (x, w, b, *args))
    g = randn(gen, *conv.conv2d(x, w, b, *args).shape)
    check("conv2d_backward", conv.conv2d_backward, (g, x, w, *args, (True, True, True)), outputs=3)
    check("conv2d_backward", conv.conv2d_backward, (g, x, w, *args, (False, True, False)), outputs=3)


def test_fold_cache_tracks_parameter_updates(gen):
    x = randn(gen, 1, 3, 5, 5)
    cw, rm, rv = randn(gen, 2, 3, 1, 1), randn(gen, 2), torch.rand(2, generator=gen) + 0.5
    w1, _ = conv.FOLDED.get(x, cw, None, None, None, rm, rv, 1e-5)
    w2, _ = conv.FOLDED.get(x, cw, None, None, None, rm, rv, 1e-5)
    assert w1 is w2
    rv.mul_(2.0)  # an in-place update bumps the version: the fold is recomputed
    w3, _ = conv.FOLDED.get(x, cw, None, None, None, rm, rv, 1e-5)
    assert w3 is not w1 and torch.allclose(w3, w1 / 2**0.5, rtol=1e-5)


# --- GEMMs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES + (torch.float64,))
@pytest.mark.parametrize("act", ["gelu", "relu", "silu", "none"])
def test_linear(gen, dtype, act):
    """float64 runs the FMA tiles (Triton 3.6 has no float64 tl.dot for sm_90)."""
    x, w, b = randn(gen, 3, 5, 40, dtype=dtype), randn(gen, 24, 40, dtype=dtype, scale=0.2), randn(gen, 24, dtype=dtype)
    check("linear", kern("linear", "triton"), (x, w, b, act))
    check("linear", kern("linear", "cublas_triton"), (x, w, b, act))


@pytest.mark.parametrize("act", ["gelu", "relu", "silu", "none"])
def test_linear_backward(gen, act):
    """float32 only: in half precision the kernel rounds grad(pre-activation) to the input dtype
    before its two GEMMs, as torch autograd does; with 15 rows that rounding alone can exceed the
    declared tolerance where grad_weight cancels (the device conformance judges it)."""
    x, w, b = randn(gen, 3, 5, 40), randn(gen, 24, 40, scale=0.2), randn(gen, 24)
    g = randn(gen, 3, 5, 24)
    backward = kern("linear_backward", "cublas_triton")
    check("linear_backward", backward, (g, x, w, b, act, (True, True, True)), outputs=3)
    check("linear_backward", backward, (g, x, w, None, act, (True, True, False)), outputs=3)  # a bias-free layer
    check("linear_backward", backward, (g, x, w, b, act, (False, True, True)), outputs=3)


def test_linear_cublaslt_epilogues_on_cpu(gen):
    """relu and none only: on CPU torch._addmm_activation's GELU is the erf one (cuBLASLt's, on the
    GPU, is the tanh approximation the kernel is registered for; the device conformance checks it)."""
    x, w = randn(gen, 6, 16), randn(gen, 8, 16)
    for act in ("relu", "none"):
        check("linear", kern("linear", "cublaslt"), (x, w, None, act))


def test_matmul_backward_broadcast_and_vectors(gen):
    for sa, sb in [((2, 1, 3, 4), (5, 4, 6)), ((4,), (3, 4, 2)), ((3, 4), (4,)), ((4,), (4,))]:
        a, b = randn(gen, *sa), randn(gen, *sb)
        g = randn(gen, *torch.matmul(a, b).shape)
        check("matmul_backward", kern("matmul_backward", "cublas"), (g, a, b), outputs=2)


@pytest.mark.parametrize("dtype", DTYPES + (torch.float64,))
@pytest.mark.parametrize("sizes", [[3, 0, 20, 7], [16, 16], [0, 1, 0]])
def test_grouped_gemm(gen, dtype, sizes):
    m, k, n = sum(sizes), 24, 20
    x, w = randn(gen, m, k, dtype=dtype), randn(gen, len(sizes), k, n, dtype=dtype, scale=0.3)
    gs = torch.tensor(sizes, dtype=torch.int64)
    check("grouped_gemm", kern("grouped_gemm", "triton"), (x, w, gs))
    g = randn(gen, m, n, dtype=dtype)
    check("grouped_gemm_backward", kern("grouped_gemm_backward", "triton"), (g, x, w, gs), outputs=2)


def test_grouped_gemm_rows_past_the_groups_are_zero(gen):
    """sum(group_sizes) < rows: the GPU path does not read the sizes back; the tail comes out zero."""
    x, w = randn(gen, 10, 8), randn(gen, 2, 8, 4)
    y = kern("grouped_gemm", "triton")(x, w, torch.tensor([3, 4], dtype=torch.int32))
    assert torch.equal(y[7:], torch.zeros(3, 4))
    assert torch.allclose(y[3:7], x[3:7] @ w[1], atol=1e-5)


# --- optimizer steps ------------------------------------------------------------------------------


def _adam_state(gen, shapes, pdtype, masters, gdtype=None):
    params = [randn(gen, *s, dtype=pdtype) for s in shapes]
    grads = [randn(gen, *s, dtype=gdtype or pdtype) for s in shapes]
    m = [randn(gen, *s, scale=0.1) for s in shapes]
    v = [torch.rand(s, generator=gen) * 0.1 for s in shapes]
    w = [p.float() + 1e-3 * randn(gen, *p.shape) for p in params] if masters else None
    return params, grads, m, v, w


#: tensor shapes of the multi-tensor tests: sizes that are not multiples of 16 (scalar accesses), and
#: sizes that are (with torch's aligned allocations, the ALIGNED launches' vector accesses)
ODD_SHAPES, ALIGNED_SHAPES = [(7,), (3, 50), (130,)], [(16,), (4, 48), (160,)]


def _launch_aligned(*lists) -> bool:
    from hal.arrays import address_columns
    from hal_triton.optim import aligned

    return aligned(address_columns(lists))


@pytest.mark.parametrize("pdtype,masters", [(torch.float32, False), (torch.bfloat16, True), (torch.float16, False)])
@pytest.mark.parametrize("inv_scale", [None, 0.5, "tensor"])
@pytest.mark.parametrize("shapes", [ODD_SHAPES, ALIGNED_SHAPES], ids=["odd", "aligned"])
def test_fused_adamw(gen, pdtype, masters, inv_scale, shapes):
    params, grads, m, v, w = _adam_state(gen, shapes, pdtype, masters)
    assert _launch_aligned(params, grads, m, v, w) == (shapes is ALIGNED_SHAPES)
    inv = torch.tensor([0.25]) if inv_scale == "tensor" else inv_scale
    args = (params, grads, m, v, 1e-2, 0.9, 0.999, 1e-8, 0.01, 3.0, w, inv, torch.tensor(0.0))
    inplace = ("params", "exp_avgs", "exp_avg_sqs") + (("master_params",) if masters else ())
    check("fused_adamw_", kern("fused_adamw_", "triton"), args, inplace=inplace)


@pytest.mark.parametrize("fn", ["triton", "torch"])
@pytest.mark.parametrize("pdtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inv_scale", [None, "tensor"])
def test_fused_adamw_float32_grads_beside_masters(gen, fn, pdtype, inv_scale):
    """Half-precision copies of float32 weights (the masters) stepped on the weights' float32
    grads: masters and moments as the reference's, every copy (poisoned before) its master rounded."""
    params, grads, m, v, w = _adam_state(gen, [(7,), (3, 50), (130,)], pdtype, True, gdtype=torch.float32)
    for p in params:
        p.fill_(float("nan"))
    inv = torch.tensor([0.25]) if inv_scale == "tensor" else inv_scale
    args = (params, grads, m, v, 1e-2, 0.9, 0.999, 1e-8, 0.01, 3.0, w, inv, torch.tensor(0.0))
    check("fused_adamw_", kern("fused_adamw_", fn), args, inplace=("params", "exp_avgs", "exp_avg_sqs", "master_params"))
    assert all(_is_rounded(p, x) for p, x in zip(params, w))


def _is_rounded(p: torch.Tensor, master: torch.Tensor) -> bool:
    """Whether ``p`` is the float32 ``master`` rounded to p's dtype: to nearest even or, in bfloat16,
    truncated (the Triton interpreter's float32 -> bfloat16 conversion; compiled code rounds to
    nearest even, which tests/cuda/device/test_optim_copies.py checks)."""
    nearest = master.to(p.dtype)
    if p.dtype != torch.bfloat16:
        return torch.equal(p, nearest)
    truncated = (master.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
    return bool(((p == nearest) | (p == truncated)).all())


@pytest.mark.parametrize("fn,grads_layout", [("triton", "channels_last"), ("torch", "channels_last"), ("torch", "contiguous")])
def test_fused_adamw_channels_last(gen, fn, grads_layout):
    """Convolution weights in channels_last (dense, not contiguous) with moments alike: the Triton
    kernel walks them as runs of memory; gradients in another layout make the Triton kernel decline
    (tests/rocm/test_selection.py) and the torch kernel copy. Both match the reference in place."""
    params, grads, m, v, w = _adam_state(gen, [(6, 5, 3, 3), (4, 2, 1, 1), (7,)], torch.bfloat16, True)
    as_cl = lambda ts: [t.contiguous(memory_format=torch.channels_last) if t.ndim == 4 else t for t in ts]  # noqa: E731
    params, m, v, w = as_cl(params), as_cl(m), as_cl(v), as_cl(w)
    if grads_layout == "channels_last":
        grads = as_cl(grads)
    assert not params[0].is_contiguous()
    args = (params, grads, m, v, 1e-2, 0.9, 0.999, 1e-8, 0.01, 3.0, w, None, None)
    check("fused_adamw_", kern("fused_adamw_", fn), args, inplace=("params", "exp_avgs", "exp_avg_sqs", "master_params"))
    assert params[0].is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("fn", ["triton", "torch"])
@pytest.mark.parametrize("shapes", [[(40,), (9,)], [(48,), (16,)]], ids=["odd", "aligned"])
def test_fused_adamw_skips_on_found_inf(gen, fn, shapes):
    params, grads, m, v, _ = _adam_state(gen, shapes, torch.float32, False)
    before = [t.clone() for t in params + m + v]
    kernel = kern("fused_adamw_", "triton") if fn == "triton" else kern("fused_adamw_", "torch")
    kernel(params, grads, m, v, 1e-2, 0.9, 0.999, 1e-8, 0.01, 1.0, None, None, torch.tensor([1.0]))
    assert all(torch.equal(a, b) for a, b in zip(before, params + m + v))


def test_fused_adamw_torch_fallback_float64(gen):
    params, grads, m, v, _ = _adam_state(gen, [(11,), (2, 3)], torch.float64, False)
    args = (params, grads, m, v, 1e-3, 0.8, 0.99, 1e-8, 0.1, 2.0, None, 0.5, None)
    check("fused_adamw_", kern("fused_adamw_", "torch"), args, inplace=("params", "exp_avgs", "exp_avg_sqs"))


def test_multi_tensor_launches_are_aligned_only_where_every_tensor_is(gen):
    """ALIGNED (16-byte vector accesses) only where every address is 16-byte aligned and every size
    a multiple of 16 elements; one view at an odd offset or one odd size makes the launch scalar."""
    a, b = torch.empty(64), torch.empty(32, dtype=torch.bfloat16)
    assert _launch_aligned([a, b], [a.clone(), b.clone()], None)
    assert not _launch_aligned([a[1:17], b], [a[:16], b])  # 4 bytes past an aligned address
    assert not _launch_aligned([a[:24], b], [a[:24], b])  # 24 elements
    assert _launch_aligned([a[16:32], b[8:24]], [a[:16], b[:16]])  # views at 64 and 16 bytes


@pytest.mark.parametrize("fn", ["triton", "torch"])
@pytest.mark.parametrize("sizes", [(40, 5, 11), (48, 16, 32)], ids=["odd", "aligned"])
def test_amp_unscale(gen, fn, sizes):
    kernel = kern("amp_unscale_", "triton") if fn == "triton" else kern("amp_unscale_", "torch")
    tensors = [randn(gen, sizes[0]), randn(gen, sizes[1], dtype=torch.float16), randn(gen, 3, sizes[2], dtype=torch.bfloat16)]
    check("amp_unscale_", kernel, (tensors, 0.125), inplace=("tensors",))
    tensors[1][2] = float("inf")
    assert float(kernel(tensors, torch.tensor([1.0]))) == 1.0
    big = [torch.full((10,), 60000.0, dtype=torch.float16)]  # finite before, infinite after scaling
    assert float(kernel(big, 2.0)) == 1.0


# --- quantisation ---------------------------------------------------------------------------------


def _qparams(gen, x, axis, tensor_zp):
    if axis is None:
        return 0.05, (torch.tensor([3], dtype=torch.int32) if tensor_zp else -2)
    c = x.shape[axis]
    scale = torch.rand(c, generator=gen) * 0.1 + 0.01
    zp = torch.randint(-5, 5, (c,), generator=gen, dtype=torch.int32) if tensor_zp else 0
    return scale, zp


@pytest.mark.parametrize("axis,tensor_zp", [(None, False), (None, True), (1, True), (2, False), (0, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_family(gen, axis, tensor_zp, dtype):
    x = randn(gen, 4, 6, 5, dtype=dtype, scale=3.0)
    scale, zp = _qparams(gen, x, axis, tensor_zp)
    check("quantize", kern("quantize", "triton"), (x, scale, zp, axis, "int8"))
    check("fake_quantize", kern("fake_quantize", "triton"), (x, scale, zp, -128, 127, axis))
    g = randn(gen, *x.shape, dtype=dtype)
    check("fake_quantize_backward", kern("fake_quantize_backward", "triton"), (g, x, scale, zp, -20, 20, axis))
    q = kern("quantize", "triton")(x, scale, zp, axis, "int8")
    check("dequantize", kern("dequantize", "triton"), (q, scale, zp, axis))


def test_quantize_rounds_half_to_even_and_saturates():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 1000.0, -1000.0, 254.5])
    assert kern("quantize", "triton")(x, 1.0, 0, None, "int8").tolist() == [0, 2, 2, 0, -2, 127, -128, 127]
    assert kern("quantize", "triton")(x, 1.0, 0, None, "uint8").tolist() == [0, 2, 2, 0, 0, 255, 0, 254]


@pytest.mark.parametrize("axis", [None, 1])
@pytest.mark.parametrize("qtype,lo,hi", [("int8", -128, 127), ("uint8", 0, 255)])
def test_quantize_of_nan_is_the_top_code_as_torch(gen, axis, qtype, lo, hi):
    """As torch.quantize_per_tensor: NaN gives the top of the range, infinities saturate."""
    x = randn(gen, 3, 8)
    x[1, 2:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), float("nan")])
    scale, zp = (0.1, 7) if axis is None else (torch.full((8,), 0.1), torch.full((8,), 7, dtype=torch.int32))
    check("quantize", kern("quantize", "triton"), (x, scale, zp, axis, qtype))
    assert kern("quantize", "triton")(x, scale, zp, axis, qtype)[1, 2:6].tolist() == [hi, hi, lo, hi]


@pytest.mark.parametrize("axis", [None, 1])
def test_fake_quantize_of_nan_is_quant_min_as_torch(gen, axis):
    """torch's CPU kernels clamp with fmax/fmin: NaN becomes quant_min; infinities saturate."""
    x = randn(gen, 3, 8)
    x[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), float("nan")])
    scale, zp = (0.1, 3) if axis is None else (torch.full((8,), 0.1), torch.full((8,), 3, dtype=torch.int32))
    check("fake_quantize", kern("fake_quantize", "triton"), (x, scale, zp, -20, 20, axis))
    got = kern("fake_quantize", "triton")(x, scale, zp, -20, 20, axis)
    assert got[0, 0].item() == got[0, 3].item() == pytest.approx((-20 - 3) * 0.1)
    if axis is None:
        torch.testing.assert_close(got, torch.fake_quantize_per_tensor_affine(x, 0.1, 3, -20, 20))


@pytest.mark.parametrize("bad", ["scale_zero", "scale_negative", "scale_nan", "scale_inf", "zp_out_of_range", "zp_fraction"])
def test_invalid_tensor_qparams_give_nan_not_numbers(gen, bad):
    """Device kernels cannot raise on values without a host synchronisation: every element whose
    parameter is invalid comes out NaN (the others are computed), in the forward and the backward."""
    x = randn(gen, 4, 6)
    scale = torch.rand(6, generator=gen) * 0.1 + 0.01
    zp = torch.randint(-5, 5, (6,), generator=gen).float()
    value = {"scale_zero": 0.0, "scale_negative": -0.1, "scale_nan": float("nan"), "scale_inf": float("inf"),
             "zp_out_of_range": 300.0, "zp_fraction": 2.5}[bad]
    (scale if bad.startswith("scale") else zp)[2] = value
    g = randn(gen, 4, 6)
    for out in (kern("fake_quantize", "triton")(x, scale, zp, -128, 127, 1), kern("fake_quantize_backward", "triton")(g, x, scale, zp, -128, 127, 1)):
        assert out[:, 2].isnan().all() and not out[:, [0, 1, 3, 4, 5]].isnan().any()
    q = torch.randint(-128, 128, (4, 6), generator=gen, dtype=torch.int8)
    out = kern("dequantize", "triton")(q, scale, zp.int() if bad != "zp_fraction" else zp, 1)
    assert out[:, 2].isnan().all() and not out[:, [0, 1, 3, 4, 5]].isnan().any()


def test_int8_linear_invalid_scale_tensor_gives_nan(gen):
    xq = torch.randint(-128, 128, (32, 64), generator=gen, dtype=torch.int8)
    wq = torch.randint(-128, 128, (24, 64), generator=gen, dtype=torch.int8)
    ws = torch.rand(24, generator=gen) * 1e-3
    ws[5] = -1e-3
    out = kern("int8_linear", "cublaslt")(xq, wq, torch.tensor(0.02), ws, None, "float32")
    assert out[:, 5].isnan().all() and not out[:, :5].isnan().any()


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("out_dtype", ["float16", "float32"])
def test_int8_linear(gen, per_channel, out_dtype):
    xq = torch.randint(-128, 128, (2, 12, 64), generator=gen, dtype=torch.int8)
    wq = torch.randint(-128, 128, (24, 64), generator=gen, dtype=torch.int8)
    ws = torch.rand(24, generator=gen) * 1e-3 if per_channel else torch.tensor([1e-3])
    b = randn(gen, 24)
    args = (xq, wq, torch.tensor(0.02), ws, b, out_dtype)
    check("int8_linear", kern("int8_linear", "triton"), args)
    check("int8_linear", kern("int8_linear", "cublaslt"), args)
    check("int8_linear", kern("int8_linear", "tuned"), args)


# --- attention --------------------------------------------------------------------------------------


def test_sdpa_math_kernel_masks_and_causal(gen):
    q, k, v = randn(gen, 2, 5, 8), randn(gen, 2, 7, 8), randn(gen, 2, 7, 6)
    mask = torch.rand(2, 5, 7, generator=gen) > 0.3
    mask[0, 1] = False  # a query with nothing to attend to: zero output (torch 2.13, cpu_ref)
    for attn_mask, causal in [(mask, False), (None, True), (randn(gen, 5, 7), False)]:
        args = (q, k, v, attn_mask, causal, 0.4)
        check("scaled_dot_product_attention", kern("scaled_dot_product_attention", "math"), args)
        g = randn(gen, 2, 5, 6)
        check("scaled_dot_product_attention_backward", kern("scaled_dot_product_attention_backward", "math"), (g, *args), outputs=3)


# --- transformer pieces and losses -----------------------------------------------------------------


def _angles(gen, shape, half, dtype):
    pos = torch.randint(0, 4096, shape + (1,), generator=gen).double()
    theta = pos * 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
    return theta.cos().to(dtype), theta.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_embedding_layouts(gen, dtype, interleaved):
    """Llama's (B, H, T, D) with one (T, D/2) table, the Hugging Face view of (B, T, H, D) with
    per-batch (B, 1, T, D/2) tables (float32 beside bf16 x), a 2-D x, and five leading dimensions."""
    table_dt = torch.float32
    x = randn(gen, 2, 3, 5, 16, dtype=dtype)
    cos, sin = _angles(gen, (5,), 8, table_dt if dtype != torch.float32 else dtype)
    check("rotary_embedding", kern("rotary_embedding", "triton"), (x, cos, sin, interleaved))
    hf = randn(gen, 2, 5, 3, 16, dtype=dtype).transpose(1, 2)
    cos_b, sin_b = _angles(gen, (2, 1, 5), 8, table_dt if dtype != torch.float32 else dtype)
    y = kern("rotary_embedding", "triton")(hf, cos_b, sin_b, interleaved)
    assert y.stride() == hf.stride()  # the result keeps x's layout
    check("rotary_embedding", kern("rotary_embedding", "triton"), (hf, cos_b, sin_b, interleaved))
    g = randn(gen, 2, 3, 5, 16, dtype=dtype)
    check("rotary_embedding_backward", kern("rotary_embedding_backward", "triton"), (g, cos, sin, interleaved))
    x2 = randn(gen, 7, 6, dtype=dtype)
    c2, s2 = _angles(gen, (7,), 3, x2.dtype)
    check("rotary_embedding", kern("rotary_embedding", "triton"), (x2, c2, s2, interleaved))
    x5 = randn(gen, 2, 2, 2, 3, 4, dtype=dtype)  # contiguous: the leading dimensions merge
    c5, s5 = _angles(gen, (3,), 2, x5.dtype)
    check("rotary_embedding", kern("rotary_embedding", "triton"), (x5, c5, s5, interleaved))


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_flat_and_channels_last(gen, dtype):
    for shape, cl in (((3, 70), False), ((2, 6, 5, 3), True)):
        gate, up = randn(gen, *shape, dtype=dtype, scale=4.0), randn(gen, *shape, dtype=dtype)
        if cl:
            gate, up = gate.contiguous(memory_format=torch.channels_last), up.contiguous(memory_format=torch.channels_last)
        check("swiglu", kern("swiglu", "triton"), (gate, up))
        g = randn(gen, *shape, dtype=dtype)
        if cl:
            g = g.contiguous(memory_format=torch.channels_last)
            assert kern("swiglu", "triton")(gate, up).is_contiguous(memory_format=torch.channels_last)
        check("swiglu_backward", kern("swiglu_backward", "triton"), (g, gate, up), outputs=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_rows_of_a_packed_projection(gen, dtype):
    """gate and up as the two halves of one (B, T, 2F) tensor (strided rows, read in place) and as
    rows of different strides; the backward of the halves writes one buffer of the packed shape."""
    from hal.arrays import halves_of

    for batch, rows, half in ((2, 5, 48), (1, 3, 40)):
        h = randn(gen, batch, rows, 2 * half, dtype=dtype, scale=3.0)
        gate, up = h.chunk(2, dim=-1)
        check("swiglu", kern("swiglu", "triton"), (gate, up))
        g = randn(gen, batch, rows, half, dtype=dtype)
        check("swiglu_backward", kern("swiglu_backward", "triton"), (g, gate, up), outputs=2)
        dg, du = kern("swiglu_backward", "triton")(g, gate, up)
        whole = halves_of(dg, du)
        assert whole is not None and whole.shape == h.shape and whole.is_contiguous()
    wide = randn(gen, 6, 80, dtype=dtype)
    gate, up = wide[:, 8:40], randn(gen, 6, 32, dtype=dtype)  # rows of stride 80 beside contiguous rows
    check("swiglu", kern("swiglu", "triton"), (gate, up))
    check("swiglu_backward", kern("swiglu_backward", "triton"), (randn(gen, 6, 32, dtype=dtype), gate, up), outputs=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_rows(gen, dtype, reduction):
    """Rows longer than a block (online log-sum-exp over several chunks), ignored rows (the default
    and a class id), label smoothing, int32 targets; the backward scaled by each reduction."""
    z = randn(gen, 9, 77, dtype=dtype, scale=3.0)
    for ignore_index, eps, tdt in ((-100, 0.0, torch.int64), (3, 0.1, torch.int32)):
        t = torch.randint(0, 77, (9,), generator=gen).to(tdt)
        t[[1, 5]] = ignore_index
        args = (z, t, ignore_index, eps, reduction)
        check("cross_entropy", kern("cross_entropy", "triton"), args)
        g = randn(gen, 9) if reduction == "none" else randn(gen)
        check("cross_entropy_backward", kern("cross_entropy_backward", "triton"), (g, *args))


def test_cross_entropy_out_of_range_target_is_nan(gen):
    z = randn(gen, 3, 10)
    rows = kern("cross_entropy", "triton")(z, torch.tensor([1, 12, -100]), -100, 0.0, "none")
    assert torch.isfinite(rows[0]) and torch.isnan(rows[1]) and rows[2] == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_cross_entropy_in_blocks(gen, dtype, reduction):
    """Under the interpreter a block holds 64 logits, so 11 rows of 40 classes run as 11 blocks."""
    x, w, b = randn(gen, 11, 24, dtype=dtype), randn(gen, 40, 24, dtype=dtype, scale=0.2), randn(gen, 40, dtype=dtype)
    t = torch.randint(0, 40, (11,), generator=gen)
    t[4] = -100
    for bias in (b, None):
        args = (x, w, t, bias, -100, 0.05, reduction)
        check("linear_cross_entropy", kern("linear_cross_entropy", "cublas_triton"), args)
        g = randn(gen, 11) if reduction == "none" else randn(gen)
        check("linear_cross_entropy_backward", kern("linear_cross_entropy_backward", "cublas_triton"), (g, *args), outputs=3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy_training_forward_keeps_its_gradients(gen, dtype, reduction):
    """Armed as hal's autograd node arms it, the forward also computes the gradients (for a grad_out
    of one) from the logits it has and keeps them; the backward only scales them by grad_out. Both
    match the backward that computes the logits again, which a second backward (nothing kept any
    more) runs."""
    from hal.integration import kept
    from hal_triton import loss

    x, w, b = randn(gen, 11, 24, dtype=dtype), randn(gen, 40, 24, dtype=dtype, scale=0.2), randn(gen, 40, dtype=dtype)
    x.requires_grad_(True)  # as in hal's node: the inputs take gradients, grad mode is off
    t = torch.randint(0, 40, (11,), generator=gen)
    t[4] = -100
    args = (x, w, t, b, -100, 0.05, reduction)
    forward, backward = kern("linear_cross_entropy", "cublas_triton"), kern("linear_cross_entropy_backward", "cublas_triton")
    g = randn(gen, scale=3.0)
    with torch.no_grad():
        previous = kept.arm(True)
        try:
            got_loss = forward(*args)
        finally:
            kept.arm(previous)
        assert x in loss._KEPT
        torch.testing.assert_close(got_loss, forward(*args))
        got = backward(g, *args)
        assert x not in loss._KEPT
        want = backward(g, *args)  # nothing kept: the logits again
    for got_t, want_t in zip(got, want):  # in bfloat16 each gradient to its own scale (grad_W's is larger than grad_x's)
        tol = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2 * float(want_t.abs().max())}
        torch.testing.assert_close(got_t, want_t, **tol)


@pytest.mark.parametrize("in_place", [False, True], ids=["own-buffer", "over-logits"])
def test_logit_gradients_kernel_writes_the_losses_too(gen, in_place):
    """Given a losses buffer, the gradients' kernel writes each row's loss from the same pass over the
    logits: bit for bit what the loss kernel writes (0 at an ignored row, NaN at a target outside the
    vocabulary, as torch's cross-entropy gives), and the same gradients as without it, also where
    the gradients overwrite the logits."""
    from hal_triton import loss

    z = randn(gen, 11, 40, scale=3.0)
    t = torch.randint(0, 40, (11,), generator=gen)
    t[4], t[7] = -100, 45
    one, cfg = torch.ones(()), {"block_c": 16, "num_warps": 1}
    want_rows = loss.row_losses(z, t, -100, 0.05, **cfg)
    want_dz = loss.logit_grads(z, t, one, None, -100, 0.05, "sum", torch.full((11, 40), float("nan"), dtype=torch.bfloat16), **cfg)
    zz = z.clone()
    out = loss.over_logits(zz, torch.bfloat16) if in_place else torch.full((11, 40), float("nan"), dtype=torch.bfloat16)
    rows = torch.full((11,), 123.0)  # poisoned
    got_dz = loss.logit_grads(zz, t, one, None, -100, 0.05, "sum", out, rows, **cfg)
    assert torch.isnan(rows[7]) and rows[4] == 0
    torch.testing.assert_close(rows, want_rows, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got_dz, want_dz, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_cross_entropy_training_forward_makes_its_losses_with_the_gradients(gen, dtype, monkeypatch):
    """Armed, the forward runs no separate loss kernel (its losses come from the gradients' kernel)
    and its loss equals the unarmed forward's bit for bit."""
    from hal.integration import kept
    from hal_triton import loss

    x, w = randn(gen, 11, 24, dtype=dtype), randn(gen, 40, 24, dtype=dtype, scale=0.2)
    x.requires_grad_(True)
    t = torch.randint(0, 40, (11,), generator=gen)
    t[4] = -100
    forward = kern("linear_cross_entropy", "cublas_triton")
    with torch.no_grad():
        want = forward(x, w, t, None, -100, 0.05, "mean")
        calls: list = []
        original = loss.row_losses
        monkeypatch.setattr(loss, "row_losses", lambda *a, **k: calls.append(1) or original(*a, **k))
        previous = kept.arm(True)
        try:
            got = forward(x, w, t, None, -100, 0.05, "mean")
        finally:
            kept.arm(previous)
        assert x in loss._KEPT
        loss._KEPT.take(x, loss.kept_gradients_state(w, t, None, -100, 0.05, "mean"))
    assert calls == []
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("q_shape,k_shape,v_shape", [((2, 3, 5, 8), (1, 3, 7, 8), (2, 1, 7, 6)), ((2, 3, 5, 8), (3, 7, 8), (7, 8))])
def test_sdpa_math_kernel_broadcasts_batch_dimensions(gen, q_shape, k_shape, v_shape):
    """q, k and v whose batch dimensions broadcast (shared key/value heads): the result has the
    broadcast batch, each gradient its input's shape (summed over what it was broadcast along)."""
    q, k, v = randn(gen, *q_shape), randn(gen, *k_shape), randn(gen, *v_shape)
    args = (q, k, v, None, False, 0.35)
    check("scaled_dot_product_attention", kern("scaled_dot_product_attention", "math"), args)
    g = randn(gen, *q_shape[:-1], v_shape[-1])
    check("scaled_dot_product_attention_backward", kern("scaled_dot_product_attention_backward", "math"), (g, *args), outputs=3)


def test_softmax_of_0d_runs_on_the_torch_kernel():
    from hal.plugin import Inputs
    from hal.registry import get_op

    x = torch.tensor(0.7)
    spec = next(k for k in plugin.kernels if k.op == "softmax" and k.name == "triton")
    inputs = Inputs(get_op("softmax"), (x, 0), "cuda", torch.device("cpu"), "float32", "torch", "sm_90")
    assert any("0-d" in r for r in spec.not_supported_reasons(inputs))
    check("softmax", kern("softmax", "torch"), (x, 0))



@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("armed", [False, True], ids=["backward", "training-forward"])
def test_linear_cross_entropy_holds_one_block_of_logits(gen, armed, dtype, monkeypatch):
    """At most one block of float32 logits is alive at a time (the kit's docstring promises it; an
    H100's memory anatomy at 66d0b65 found two, 1 GiB each at Llama-3's vocabulary), for bfloat16
    inputs too: every product the GEMM returns is tracked, and as each block of logits is made the
    blocks alive are counted."""
    import weakref

    from hal_triton import loss

    x, w = randn(gen, 11, 24, dtype=dtype), randn(gen, 40, 24, dtype=dtype, scale=0.2)
    x.requires_grad_(True)
    t = torch.randint(0, 40, (11,), generator=gen)
    alive: list = []
    most = [0]

    def tracked(a, b, acc=None):
        out = a.float() @ b.float() if acc is None else acc.add_(a.float() @ b.float())
        if acc is None and out.shape[1] == w.shape[0]:  # a block of logits (rows, vocabulary)
            alive.append(weakref.ref(out))
            most[0] = max(most[0], sum(r() is not None for r in alive))  # the earlier blocks' and this one
        return out

    rows = loss._rows_per_block(11, 40, 64)
    assert rows < 11  # several blocks
    with torch.no_grad():
        if armed:
            from hal.integration import kept

            previous = kept.arm(True)
            try:
                loss.linear_cross_entropy(x, w, t, None, -100, 0.0, "mean", tracked, 64, block_c=16, num_warps=1)
            finally:
                kept.arm(previous)
            loss._KEPT.take(x, loss.kept_gradients_state(w, t, None, -100, 0.0, "mean"))
        else:
            loss.linear_cross_entropy_backward(randn(gen), x, w, t, None, -100, 0.0, "mean", tracked, 64, block_c=16, num_warps=1)
    assert len(alive) == -(-11 // rows) and most[0] <= 1, (len(alive), most[0])


def test_product_added_in_slices_equals_one_product(gen, monkeypatch):
    """The GEMM's fallback adds a product into its accumulator through slices of rows (no
    temporary of the accumulator's size): the sum equals the single product's, also where the rows
    do not divide evenly; the slices' products are never larger than the limit."""
    from hal.plugin_sdk import linear

    monkeypatch.setattr(linear, "SLICE_ELEMENTS", 3 * 24)
    a, b = randn(gen, 40, 7).t().contiguous().t(), randn(gen, 7, 24)  # a transposed view, as d.t() is
    acc = randn(gen, 40, 24)
    want = acc + a @ b
    sizes = []

    def product(x, y):
        sizes.append(x.shape[0] * y.shape[1])
        return x @ y

    got = linear.add_product_in_slices(acc, a, b, product)
    assert got is acc and max(sizes) <= 3 * 24 and len(sizes) == 14
    torch.testing.assert_close(got, want)
