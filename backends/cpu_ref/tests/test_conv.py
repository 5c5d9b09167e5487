"""cpu_ref's conv2d, batch_norm, fused_conv_bn_relu and fused_conv_bn_add_relu, and their backwards,
against PyTorch in float64 (and hal_torch's versions)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from refcheck import (
    LOW_PRECISION,
    as_numpy,
    assert_all_close64,
    assert_within_tolerance,
    canonical,
    cast_floats,
    check_in_dtype,
    randn,
    vjp,
)

import hal
from hal_torch.table import eager

# torch warns that it copies the input to pad it asymmetrically: expected for these cases.
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths:UserWarning")

# --- PyTorch references, called with hal's (user-facing) arguments -------------------------------


def torch_conv(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """F.conv2d, plus hal's (top, bottom, left, right) padding, which F.conv2d does not take."""
    if isinstance(padding, tuple) and len(padding) == 4:
        top, bottom, left, right = padding
        x, padding = F.pad(x, (left, right, top, bottom)), 0
    return F.conv2d(x, weight, bias, stride, padding, dilation, groups)


def torch_conv_grads(grad_out, x, weight, stride=1, padding=0, dilation=1, groups=1):
    bias = torch.zeros(weight.shape[0], dtype=x.dtype)
    return vjp(lambda x_, w_, b_: torch_conv(x_, w_, b_, stride, padding, dilation, groups), (x, weight, bias), grad_out)


def _ones_if_none(t: Optional[torch.Tensor], n: int, like: torch.Tensor) -> torch.Tensor:
    return torch.ones(n, dtype=like.dtype) if t is None else t


def _zeros_if_none(t: Optional[torch.Tensor], n: int, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros(n, dtype=like.dtype) if t is None else t


def torch_bn_grads(grad_out, x, running_mean, running_var, weight, training, eps):
    """(grad_x, grad_weight, grad_bias) of F.batch_norm; a missing weight counts as ones."""
    stats = (None, None) if training else (running_mean.clone(), running_var.clone())
    w = _ones_if_none(weight, x.shape[1], x)
    fn = lambda x_, w_, b_: F.batch_norm(x_, *stats, w_, b_, training, 0.1, eps)  # noqa: E731
    return vjp(fn, (x, w, torch.zeros_like(w)), grad_out)


def torch_fused(x, cw, cb, bw, bb, running_mean, running_var, stride=1, padding=0, dilation=1, groups=1, eps=1e-5, momentum=0.1, training=False):
    y = torch_conv(x, cw, cb, stride, padding, dilation, groups)
    return F.relu(F.batch_norm(y, running_mean, running_var, bw, bb, training, momentum, eps))


def torch_fused_grads(grad_out, x, cw, cb, bw, bb, running_mean, running_var, stride=1, padding=0, dilation=1, groups=1, eps=1e-5, training=False):
    """The five gradients of torch_fused; missing conv bias / bn bias are zeros, bn weight ones."""
    stats = (None, None) if training else (running_mean.clone(), running_var.clone())
    n = cw.shape[0]
    leaves = (x, cw, _zeros_if_none(cb, n, x), _ones_if_none(bw, n, x), _zeros_if_none(bb, n, x))
    fn = lambda *a: torch_fused(*a, *stats, stride, padding, dilation, groups, eps, 0.1, training)  # noqa: E731
    return vjp(fn, leaves, grad_out)


def torch_fused_add(x, cw, cb, bw, bb, running_mean, running_var, residual, stride=1, padding=0, dilation=1, groups=1, eps=1e-5, momentum=0.1,
                    training=False):
    y = torch_conv(x, cw, cb, stride, padding, dilation, groups)
    return F.relu(F.batch_norm(y, running_mean, running_var, bw, bb, training, momentum, eps) + residual)


def torch_fused_add_grads(grad_out, out, x, cw, cb, bw, bb, running_mean, running_var, stride=1, padding=0, dilation=1, groups=1, eps=1e-5,
                          training=False):
    """The six gradients of torch_fused_add at a call whose result is ``out``: the ReLU passes
    grad_out where out > 0 (the residual's gradient), autograd through conv -> batch norm the rest."""
    g = grad_out * (out > 0)
    stats = (None, None) if training else (running_mean.clone(), running_var.clone())
    n = cw.shape[0]
    leaves = (x, cw, _zeros_if_none(cb, n, x), _ones_if_none(bw, n, x), _zeros_if_none(bb, n, x))
    fn = lambda x_, w_, b_, g_, be_: F.batch_norm(torch_conv(x_, w_, b_, stride, padding, dilation, groups), *stats, g_, be_, training, 0.1, eps)  # noqa: E731
    return (*vjp(fn, leaves, g), g)


def _clone(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.clone()


# --- conv2d -----------------------------------------------------------------------------------------

#: (id, x shape, weight shape, with bias, geometry)
CONV_CASES = [
    ("batch1_3x3_pad1", (1, 3, 8, 8), (4, 3, 3, 3), True, dict(padding=1)),
    ("prime_sizes", (2, 3, 7, 5), (5, 3, 3, 2), False, dict(stride=(2, 1), padding=(1, 2))),
    ("groups2", (2, 4, 9, 7), (6, 2, 3, 3), True, dict(groups=2, padding=1)),
    ("depthwise_x2", (2, 3, 6, 7), (6, 1, 3, 3), False, dict(groups=3, stride=2)),
    ("dilation", (1, 2, 11, 9), (3, 2, 3, 2), True, dict(dilation=(2, 3), padding=2)),
    ("stride_gt_kernel", (2, 3, 10, 11), (4, 3, 2, 2), False, dict(stride=3)),
    ("same_even_kernel", (2, 3, 8, 7), (4, 3, 4, 2), True, dict(padding="same")),
    ("same_even_dilated", (1, 2, 9, 8), (3, 2, 2, 4), False, dict(padding="same", dilation=(3, 1))),
    ("valid_1x1", (3, 5, 4, 3), (2, 5, 1, 1), True, dict(padding="valid")),
    ("asymmetric_tuple", (2, 2, 6, 6), (3, 2, 3, 3), False, dict(padding=(0, 2, 1, 0))),
]
CONV_IDS = [c[0] for c in CONV_CASES]
LAYOUTS = ["contiguous", "channels_last", "strided"]


def _layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values in another memory layout (a 4-D tensor)."""
    if layout == "channels_last":
        return t.contiguous(memory_format=torch.channels_last)
    if layout == "strided":  # every other element of a wider tensor
        wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        wide[..., ::2] = t
        wide[..., 1::2] = float("nan")  # a kernel reading between the strides would show it
        return wide[..., ::2]
    return t


def _conv_args(rng, x_shape, w_shape, with_bias, layout="contiguous"):
    x, w = _layout(randn(rng, *x_shape), layout), _layout(randn(rng, *w_shape), layout)
    return x, w, randn(rng, w_shape[0]) if with_bias else None


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CONV_CASES, ids=CONV_IDS)
def test_conv2d(case, layout, rng):
    x, w, b = _conv_args(rng, *case[1:4], layout)
    geo = case[4]
    want = torch_conv(x, w, b, **geo)
    assert_all_close64(hal.ops.conv2d(x, w, b, **geo), want)
    assert_all_close64(eager("conv2d")(*canonical(hal.ops.conv2d, x, w, b, **geo)), want)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CONV_CASES, ids=CONV_IDS)
def test_conv2d_backward(case, layout, rng):
    x, w, _ = _conv_args(rng, *case[1:4], layout)
    geo = case[4]
    g = _layout(randn(rng, *torch_conv(x, w, None, **geo).shape), layout)
    want = torch_conv_grads(g, x, w, **geo)
    assert_all_close64(hal.ops.conv2d_backward(g, x, w, **geo), want)
    assert_all_close64(eager("conv2d_backward")(*canonical(hal.ops.conv2d_backward, g, x, w, **geo)), want)


@pytest.mark.parametrize("array", ["torch", "numpy"])
@pytest.mark.parametrize("case", [CONV_CASES[2], CONV_CASES[6]], ids=[CONV_IDS[2], CONV_IDS[6]])
def test_conv2d_unbatched(case, array, rng):
    """A (C, H, W) input gives a (C_out, Ho, Wo) output, as F.conv2d."""
    x, w, b = _conv_args(rng, case[1][1:], *case[2:4])
    want = torch_conv(x, w, b, **case[4])
    got = hal.ops.conv2d(*(as_numpy([x, w, b]) if array == "numpy" else (x, w, b)), **case[4])
    assert isinstance(got, np.ndarray if array == "numpy" else torch.Tensor)
    assert_all_close64(torch.as_tensor(got), want)


# --- batch_norm ---------------------------------------------------------------------------------

#: (id, x shape): normalised over dimension 1.
BN_SHAPES = [("2d", (5, 3)), ("3d_batch1", (1, 3, 5)), ("4d", (2, 3, 4, 5)), ("5d", (2, 2, 2, 3, 2))]
BN_MODES = ["eval", "train", "train_no_stats"]


def _bn_args(rng, x_shape, mode, affine, layout="contiguous"):
    """x, running_mean, running_var, weight, bias, training (running_var positive)."""
    c = x_shape[1]
    x = 2.0 * randn(rng, *x_shape) + 0.5
    x = _layout(x, layout) if x.ndim == 4 else x
    stats = (None, None) if mode == "train_no_stats" else (randn(rng, c), torch.from_numpy(rng.uniform(0.5, 2.0, c)))
    params = (randn(rng, c), randn(rng, c)) if affine else (None, None)
    return x, *stats, *params, mode != "eval"


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no_affine"])
@pytest.mark.parametrize("mode", BN_MODES)
@pytest.mark.parametrize("shape", BN_SHAPES, ids=[s[0] for s in BN_SHAPES])
def test_batch_norm(shape, mode, affine, rng):
    """Output and running statistics (updated in place in training) as F.batch_norm's."""
    x, rm, rv, w, b, training = _bn_args(rng, shape[1], mode, affine)
    ref_stats = (_clone(rm), _clone(rv))
    want = F.batch_norm(x, *ref_stats, w, b, training, 0.3, 1e-3)
    for impl in ("hal", "eager"):
        stats = (_clone(rm), _clone(rv))
        if impl == "hal":
            got = hal.ops.batch_norm(x, *stats, w, b, training, 0.3, 1e-3)
        else:
            got = eager("batch_norm")(*canonical(hal.ops.batch_norm, x, *stats, w, b, training, 0.3, 1e-3))
        if rm is None:
            assert_all_close64(got, want)
        else:
            assert_all_close64((got, *stats), (want, *ref_stats))


@pytest.mark.parametrize("affine", [True, False], ids=["weight", "no_weight"])
@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("shape", BN_SHAPES, ids=[s[0] for s in BN_SHAPES])
def test_batch_norm_backward(shape, mode, affine, rng):
    x, rm, rv, w, _, training = _bn_args(rng, shape[1], mode, affine)
    g = randn(rng, *x.shape)
    stats_before = (rm.clone(), rv.clone())
    want = torch_bn_grads(g, x, rm, rv, w, training, 1e-5)
    assert_all_close64(hal.ops.batch_norm_backward(g, x, rm, rv, w, training, 1e-5), want)
    assert_all_close64(eager("batch_norm_backward")(*canonical(hal.ops.batch_norm_backward, g, x, rm, rv, w, training)), want)
    assert_all_close64((rm, rv), stats_before, rtol=0, atol=0)  # a backward never touches them


@pytest.mark.parametrize("layout", ["channels_last", "strided"])
def test_batch_norm_layouts(layout, rng):
    x, rm, rv, w, b, _ = _bn_args(rng, (2, 3, 4, 5), "train", True, layout)
    ref_stats = (rm.clone(), rv.clone())
    want = F.batch_norm(x, *ref_stats, w, b, True, 0.1, 1e-5)
    assert_all_close64((hal.ops.batch_norm(x, rm, rv, w, b, True), rm, rv), (want, *ref_stats))
    g = _layout(randn(rng, *x.shape), layout)
    assert_all_close64(hal.ops.batch_norm_backward(g, x, rm, rv, w, True), torch_bn_grads(g, x, rm, rv, w, True, 1e-5))


@pytest.mark.parametrize("array", ["torch", "numpy"])
def test_batch_norm_updates_running_stats_in_place(array, rng):
    """The very arrays passed in are written (same memory), with the unbiased batch variance."""
    x, rm, rv, w, b, _ = _bn_args(rng, (4, 3, 2, 3), "train", True)
    mean, var = x.mean(dim=(0, 2, 3)), x.var(dim=(0, 2, 3), unbiased=True)
    want = [0.9 * rm + 0.1 * mean, 0.9 * rv + 0.1 * var]
    args = as_numpy([x, rm, rv, w, b]) if array == "numpy" else [x, rm, rv, w, b]
    address = [rm.data_ptr(), rv.data_ptr()]
    hal.ops.batch_norm(*args, True, 0.1, 1e-5)
    if array == "numpy":  # the arrays given are views of rm, rv
        assert all(np.shares_memory(a, t.numpy()) for a, t in zip(args[1:3], (rm, rv)))
    assert [rm.data_ptr(), rv.data_ptr()] == address
    assert_all_close64([rm, rv], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("array", ["torch", "numpy"])
@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_batch_norm_float32_stats_beside_half_x(half, array, rng):
    """Mixed dtypes as F.batch_norm allows: half x beside float32 statistics and parameters. The
    output is half, the float32 stats are updated in place, parameter gradients are float32."""
    x, rm, rv, w, b, _ = _bn_args(rng, (3, 4, 5), "train", True)
    x, g = cast_floats([x, randn(rng, 3, 4, 5)], half)
    rm32, rv32, w32, b32 = cast_floats([rm, rv, w, b], "float32")
    want_stats = [rm32.double(), rv32.double()]
    want = F.batch_norm(x.double(), *want_stats, w32.double(), b32.double(), True, 0.1, 1e-5)
    want_grads = torch_bn_grads(g.double(), x.double(), None, None, w32.double(), True, 1e-5)
    args = [g, x, rm32, rv32, w32, b32]
    g_, x_, rm_, rv_, w_, b_ = as_numpy(args) if array == "numpy" else args
    y = hal.ops.batch_norm(x_, rm_, rv_, w_, b_, True, 0.1, 1e-5)
    grads = hal.ops.batch_norm_backward(g_, x_, rm_, rv_, w_, True, 1e-5)
    assert_within_tolerance(hal.ops.batch_norm, args[1:], y, want, array, half)
    assert_within_tolerance(hal.ops.batch_norm_backward, args[:5], grads, want_grads, array, (half, "float32", "float32"))
    assert rm32.dtype == rv32.dtype == torch.float32
    assert_all_close64([rm32.double(), rv32.double()], want_stats, rtol=1e-6, atol=1e-7)


# --- fused_conv_bn_relu ----------------------------------------------------------------------------

#: (id, x shape, conv weight shape, geometry)
FUSED_CASES = [
    ("3x3_pad1", (2, 3, 6, 5), (4, 3, 3, 3), dict(padding=1)),
    ("groups_stride2", (2, 4, 7, 7), (6, 2, 3, 3), dict(groups=2, stride=2)),
    ("batch1_same_even_dilated", (1, 2, 6, 7), (3, 2, 2, 2), dict(padding="same", dilation=2)),
]
FUSED_IDS = [c[0] for c in FUSED_CASES]


def _fused_args(rng, x_shape, w_shape, mode, params):
    """x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var. The first channel's
    bn_bias is 0, so that in training (batch statistics: normalised values of both signs) the ReLU
    both passes and clips its outputs whatever the draw (seed 3453053643 drew shifts that kept every
    output of the one-image case positive)."""
    n = w_shape[0]
    x, w = randn(rng, *x_shape), randn(rng, *w_shape)
    optional = [randn(rng, n), 1.0 + 0.5 * randn(rng, n), randn(rng, n)] if params == "all" else [None] * 3
    if params == "all":
        optional[2][0] = 0.0
    stats = [None, None] if mode == "train_no_stats" else [randn(rng, n), torch.from_numpy(rng.uniform(4.0, 9.0, n))]
    return [x, w, *optional, *stats]


@pytest.mark.parametrize("params", ["all", "none"], ids=["with_params", "params_none"])
@pytest.mark.parametrize("mode", BN_MODES)
@pytest.mark.parametrize("case", FUSED_CASES, ids=FUSED_IDS)
def test_fused_conv_bn_relu(case, mode, params, rng):
    args = _fused_args(rng, case[1], case[2], mode, params)
    kw = dict(case[3], eps=1e-4, momentum=0.2, training=mode != "eval")
    ref_args = [_clone(a) for a in args]
    want = torch_fused(*ref_args, **kw)
    assert (want > 0).any() and (want == 0).any()  # the ReLU both passes and clips
    for impl in ("hal", "eager"):
        call = [_clone(a) for a in args]
        if impl == "hal":
            got = hal.ops.fused_conv_bn_relu(*call, **kw)
        else:
            got = eager("fused_conv_bn_relu")(*canonical(hal.ops.fused_conv_bn_relu, *call, **kw))
        if mode == "train_no_stats":
            assert_all_close64(got, want)
        else:
            assert_all_close64((got, *call[5:]), (want, *ref_args[5:]))


@pytest.mark.parametrize("params", ["all", "none"], ids=["with_params", "params_none"])
@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("case", FUSED_CASES, ids=FUSED_IDS)
def test_fused_conv_bn_relu_backward(case, mode, params, rng):
    args = _fused_args(rng, case[1], case[2], mode, params)
    kw = dict(case[3], eps=1e-4, training=mode == "train")
    g = randn(rng, *torch_conv(args[0], args[1], None, **case[3]).shape)
    stats_before = [a.clone() for a in args[5:]]
    want = torch_fused_grads(g, *args, **kw)
    assert_all_close64(hal.ops.fused_conv_bn_relu_backward(g, *args, **kw), want)
    assert_all_close64(eager("fused_conv_bn_relu_backward")(*canonical(hal.ops.fused_conv_bn_relu_backward, g, *args, **kw)), want)
    assert_all_close64(args[5:], stats_before, rtol=0, atol=0)


def test_fused_conv_bn_relu_channels_last(rng):
    x, w, *rest = _fused_args(rng, (2, 3, 6, 5), (4, 3, 3, 3), "train", "all")
    x, w = _layout(x, "channels_last"), _layout(w, "channels_last")
    ref_stats = [t.clone() for t in rest[3:]]
    want = torch_fused(x, w, *rest[:3], *ref_stats, padding=1, training=True)
    assert_all_close64((hal.ops.fused_conv_bn_relu(x, w, *rest, padding=1, training=True), *rest[3:]), (want, *ref_stats))


# --- fused_conv_bn_add_relu ------------------------------------------------------------------------


def _residual(rng, args, geometry) -> torch.Tensor:
    return randn(rng, *torch_conv(args[0], args[1], None, **geometry).shape)


@pytest.mark.parametrize("params", ["all", "none"], ids=["with_params", "params_none"])
@pytest.mark.parametrize("mode", BN_MODES)
@pytest.mark.parametrize("case", FUSED_CASES, ids=FUSED_IDS)
def test_fused_conv_bn_add_relu(case, mode, params, rng):
    args = _fused_args(rng, case[1], case[2], mode, params)
    args.append(_residual(rng, args, case[3]))
    kw = dict(case[3], eps=1e-4, momentum=0.2, training=mode != "eval")
    ref_args = [_clone(a) for a in args]
    want = torch_fused_add(*ref_args, **kw)
    assert (want > 0).any() and (want == 0).any()  # the ReLU both passes and clips
    for impl in ("hal", "eager"):
        call = [_clone(a) for a in args]
        if impl == "hal":
            got = hal.ops.fused_conv_bn_add_relu(*call, **kw)
        else:
            got = eager("fused_conv_bn_add_relu")(*canonical(hal.ops.fused_conv_bn_add_relu, *call, **kw))
        if mode == "train_no_stats":
            assert_all_close64(got, want)
        else:
            assert_all_close64((got, *call[5:7]), (want, *ref_args[5:7]))


@pytest.mark.parametrize("params", ["all", "none"], ids=["with_params", "params_none"])
@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("case", FUSED_CASES, ids=FUSED_IDS)
def test_fused_conv_bn_add_relu_backward(case, mode, params, rng):
    """The backward op from the forward's result, against autograd through the whole forward (the
    residual included) and against the reference formula."""
    args = _fused_args(rng, case[1], case[2], mode, params)
    residual = _residual(rng, args, case[3])
    kw = dict(case[3], eps=1e-4, training=mode == "train")
    stats = [a.clone() for a in args[5:]]
    out = torch_fused_add(*args[:5], *[t.clone() for t in stats], residual, **kw)
    g = randn(rng, *out.shape)
    n = args[1].shape[0]
    leaves = (args[0], args[1], _zeros_if_none(args[2], n, args[0]), _ones_if_none(args[3], n, args[0]), _zeros_if_none(args[4], n, args[0]), residual)
    fwd = lambda *a: torch_fused_add(*a[:5], *[t.clone() for t in stats], a[5], **kw)  # noqa: E731
    want = vjp(fwd, leaves, g)
    assert_all_close64(torch_fused_add_grads(g, out, *args, **kw), want)
    assert_all_close64(hal.ops.fused_conv_bn_add_relu_backward(g, out, *args, **kw), want)
    assert_all_close64(eager("fused_conv_bn_add_relu_backward")(*canonical(hal.ops.fused_conv_bn_add_relu_backward, g, out, *args, **kw)), want)
    assert_all_close64(args[5:], stats, rtol=0, atol=0)


# --- every op of the family in every dtype, with torch and NumPy arrays ---------------------------


def _sample_conv(rng):
    return hal.ops.conv2d, (*_conv_args(rng, (2, 4, 7, 6), (6, 2, 3, 2), True), 1, "same", (2, 1), 2), torch_conv


def _sample_conv_backward(rng):
    x, w, _ = _conv_args(rng, (2, 3, 7, 6), (4, 3, 3, 3), False)
    return hal.ops.conv2d_backward, (randn(rng, 2, 4, 4, 3), x, w, 2, 1, 1, 1), torch_conv_grads


def _sample_bn(rng):
    return hal.ops.batch_norm, (*_bn_args(rng, (3, 4, 5), "train", True), 0.1, 1e-5), F.batch_norm


def _sample_bn_backward(rng):
    x, rm, rv, w, _, _ = _bn_args(rng, (3, 4, 5), "eval", True)
    return hal.ops.batch_norm_backward, (randn(rng, 3, 4, 5), x, rm, rv, w, False, 1e-5), torch_bn_grads


def _sample_fused(rng):
    args = _fused_args(rng, (2, 3, 6, 5), (4, 3, 3, 3), "train", "all")
    return hal.ops.fused_conv_bn_relu, (*args, 1, 1, 1, 1, 1e-5, 0.1, True), torch_fused


def _sample_fused_backward(rng):
    args = _fused_args(rng, (2, 3, 6, 5), (4, 3, 3, 3), "eval", "all")
    g = randn(rng, 2, 4, 6, 5)
    return hal.ops.fused_conv_bn_relu_backward, (g, *args, 1, 1, 1, 1, 1e-5, False), torch_fused_grads


def _sample_fused_add(rng):
    args = _fused_args(rng, (2, 3, 6, 5), (4, 3, 3, 3), "train", "all")
    return hal.ops.fused_conv_bn_add_relu, (*args, randn(rng, 2, 4, 6, 5), 1, 1, 1, 1, 1e-5, 0.1, True), torch_fused_add


def _sample_fused_add_backward(rng):
    args = _fused_args(rng, (2, 3, 6, 5), (4, 3, 3, 3), "eval", "all")
    out = torch_fused_add(*args, randn(rng, 2, 4, 6, 5), padding=1)
    return hal.ops.fused_conv_bn_add_relu_backward, (randn(rng, 2, 4, 6, 5), out, *args, 1, 1, 1, 1, 1e-5, False), torch_fused_add_grads


SAMPLES = {
    "conv2d": _sample_conv,
    "conv2d_backward": _sample_conv_backward,
    "batch_norm": _sample_bn,
    "batch_norm_backward": _sample_bn_backward,
    "fused_conv_bn_relu": _sample_fused,
    "fused_conv_bn_relu_backward": _sample_fused_backward,
    "fused_conv_bn_add_relu": _sample_fused_add,
    "fused_conv_bn_add_relu_backward": _sample_fused_add_backward,
}


@pytest.mark.parametrize("array", ["torch", "numpy"])
@pytest.mark.parametrize("dtype", ["float64", *LOW_PRECISION])
@pytest.mark.parametrize("op", list(SAMPLES))
def test_dtypes_and_array_types(op, dtype, array, rng):
    check_in_dtype(SAMPLES[op], dtype, array, rng)
