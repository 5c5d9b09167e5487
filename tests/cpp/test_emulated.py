"""The kits/cpp kernels, run on CPU threads by hal_cpp.host (warps of 32 lanes and wavefronts of 64),
against cpu_ref in float64 (torch's float64 autograd for the fused ReLU variants).

The kernels are registered by hal_cpp.register onto a plugin of the test, exactly as the CUDA
plugin registers them, and called as the dispatcher calls kernels: positionally, with canonical
arguments. Outputs are poisoned before every call. The inputs are small, but the launch sizes still
split every reduction over several blocks, so the cross-block merges run; the sources are the ones
NVRTC and hipcc compile (tests/cpp/test_compile.py).
"""

from __future__ import annotations

import concurrent.futures
import math

import pytest
import torch
import torch.nn.functional as F

import hal_cpp
from hal.arrays import address_columns
from hal.conformance.poison import Poisoner
from hal.plugin import Plugin
from hal_cpp import batchnorm as bn
from hal_cpp import optim
from hal_cpp.host import HostRuntime
from tests.cuda import _adamw_specials as sv
from tests.cuda._support import assert_close, fresh_seed, reference

pytestmark = pytest.mark.skipif(HostRuntime().unavailable_reason() is not None, reason=str(HostRuntime().unavailable_reason()))

CPU = torch.device("cpu")
#: (dtype, vector width) modules the cases below use, per warp size: built up front, two at a time
MODULES = {
    32: [("batchnorm", {"HAL_T": hal_cpp.C_TYPES[d], "HAL_VEC": str(v)}) for d, v in
         (("float32", 4), ("bfloat16", 8), ("bfloat16", 1), ("float16", 8), ("float64", 2), ("float64", 1))]
    + [("norm", {"HAL_T": hal_cpp.C_TYPES[d], "HAL_VEC": str(v)}) for d, v in (("bfloat16", 8), ("float32", 1), ("float64", 2))]
    + [("adamw", {"HAL_P": hal_cpp.C_TYPES[p], "HAL_G": hal_cpp.C_TYPES[g], "HAL_S": hal_cpp.C_TYPES[s]}) for p, g, s in
       (("bfloat16", "bfloat16", "float32"), ("bfloat16", "float32", "float32"), ("float16", "float32", "float32"),
        ("float32", "float32", "float32"), ("float16", "float16", "float16"), ("float64", "float64", "float64"))],
    64: [("batchnorm", {"HAL_T": "hal::bf16", "HAL_VEC": "8"}), ("batchnorm", {"HAL_T": "float", "HAL_VEC": "1"}),
         ("norm", {"HAL_T": "hal::bf16", "HAL_VEC": "8"})],
}


@pytest.fixture(scope="module")
def plugins(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[dict, hal_cpp.Kit]]:
    """Per warp size: the registered "cpp" kernels by op, and their kit (modules compiled)."""
    import os

    os.environ["HAL_CPP_CACHE_DIR"] = str(tmp_path_factory.mktemp("cpp-cache"))
    out = {}
    jobs = []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for warp in (32, 64):
            plugin = Plugin(name=f"cpp_host_w{warp}", version="0", summary="kits/cpp on CPU threads (tests)")
            plugin.define_backend(priority=1, device_types=("cpu",))
            kit = hal_cpp.register(plugin, HostRuntime(warp_size=warp, multiprocessors=8))
            out[warp] = ({k.op: k.fn for k in plugin.kernels}, kit)
            jobs += [pool.submit(kit.module, source, CPU, **defines) for source, defines in MODULES[warp]]
        for job in jobs:
            job.result()
    return out


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(fresh_seed())


def randn(gen: torch.Generator, *shape: int, dtype=torch.float32, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale + shift).to(dtype)


POISON = Poisoner(CPU)


def call(op: str, fn, args: tuple):
    """fn(*args) with the CPU allocator poisoned (every output element must be written)."""
    with POISON.around([(4096, "float32")]):
        return fn(*args)


def check(op: str, fn, args: tuple, outputs: int = 1, inplace: tuple[str, ...] = ()) -> None:
    from hal.registry import get_op

    decl = get_op(op)
    want, ref_args = reference(op, *args)
    got = call(op, fn, args)
    got_t, want_t = ((got,), (want,)) if outputs == 1 else (tuple(got), tuple(want))
    for i, (g, w) in enumerate(zip(got_t, want_t)):
        if w is None:  # an in-place op's result
            assert g is None
            continue
        assert_close(op, g, torch.as_tensor(w), args, what=f"output {i}")
    for name in inplace:
        got_v, want_v = args[decl.index(name)], ref_args[decl.index(name)]
        for j, (g, w) in enumerate(zip(got_v, want_v) if isinstance(got_v, (list, tuple)) else [(got_v, want_v)]):
            if g is not None:
                assert_close(op, g, w, args, what=f"{name}[{j}]")


# --- batch norm ------------------------------------------------------------------------------------

#: (shape, memory format, dtype, warp): rows (channels_last, 2-D) and planes (NCHW) layouts, vector
#: and scalar paths (5 channels or 15 positions are no multiple of a 16-byte vector)
BN_CASES = [
    ((3, 16, 4, 6), "channels_last", torch.float32, 32),
    ((6, 3, 4, 6), "nchw", torch.float32, 32),
    ((3, 16, 4, 6), "channels_last", torch.bfloat16, 32),
    ((2, 5, 3, 7), "channels_last", torch.bfloat16, 32),
    ((6, 3, 5, 3), "nchw", torch.bfloat16, 32),
    ((6, 3, 4, 4), "nchw", torch.float16, 32),
    ((37, 24), "2d", torch.float64, 32),
    ((4, 3, 5, 3), "nchw", torch.float64, 32),
    ((3, 16, 4, 6), "channels_last", torch.bfloat16, 64),
    ((6, 3, 4, 8), "nchw", torch.bfloat16, 64),
    ((2, 5, 3, 7), "channels_last", torch.float32, 64),
]


def _bn_input(gen, shape, fmt, dtype):
    x = randn(gen, *shape, dtype=dtype, scale=2.0, shift=3.0)
    return x.contiguous(memory_format=torch.channels_last) if fmt == "channels_last" else x


@pytest.mark.parametrize("shape,fmt,dtype,warp", BN_CASES, ids=[f"{s}-{f}-{str(d)[6:]}-w{w}" for s, f, d, w in BN_CASES])
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm(plugins, gen, shape, fmt, dtype, warp, training):
    kernels, _ = plugins[warp]
    x = _bn_input(gen, shape, fmt, dtype)
    c = shape[1]
    pdt = torch.float64 if dtype == torch.float64 else torch.float32  # float32 statistics beside half x
    w, b = randn(gen, c, dtype=pdt), randn(gen, c, dtype=pdt)
    rm, rv = randn(gen, c, dtype=pdt), torch.rand(c, generator=gen, dtype=pdt) + 0.5
    check("batch_norm", kernels["batch_norm"], (x, rm, rv, w, b, training, 0.1, 1e-5), inplace=("running_mean", "running_var"))
    g = randn(gen, *shape, dtype=dtype).contiguous(memory_format=torch.channels_last if fmt == "channels_last" else torch.contiguous_format)
    check("batch_norm_backward", kernels["batch_norm_backward"], (g, x, rm, rv, w, training, 1e-5), outputs=3)


def test_batch_norm_parameters_in_the_data_dtype_and_absent(plugins, gen):
    """Half-precision weight and running statistics (read and written in their dtype), no bias; a
    grad_out in another layout than x; then no affine parameters and no running statistics."""
    kernels, _ = plugins[32]
    x = _bn_input(gen, (3, 16, 4, 6), "channels_last", torch.bfloat16)
    w = randn(gen, 16, dtype=torch.bfloat16)
    rm, rv = randn(gen, 16, dtype=torch.bfloat16), (torch.rand(16, generator=gen) + 0.5).to(torch.bfloat16)
    check("batch_norm", kernels["batch_norm"], (x, rm, rv, w, None, True, 0.3, 1e-3), inplace=("running_mean", "running_var"))
    g = randn(gen, 3, 16, 4, 6, dtype=torch.bfloat16)  # NCHW beside channels_last x
    check("batch_norm_backward", kernels["batch_norm_backward"], (g, x, rm, rv, w, True, 1e-3), outputs=3)
    check("batch_norm", kernels["batch_norm"], (x, None, None, None, None, True, 0.1, 1e-5))
    check("batch_norm_backward", kernels["batch_norm_backward"], (g, x, None, None, None, True, 1e-5), outputs=3)


def test_batch_norm_backward_leaves_running_statistics_alone(plugins, gen):
    kernels, _ = plugins[32]
    x = randn(gen, 3, 5, 4, 6, scale=2.0)
    x[1, 2, 0, 0] = float("inf")
    rm, rv = randn(gen, 5), torch.rand(5, generator=gen) + 0.5
    before = rm.clone(), rv.clone()
    kernels["batch_norm_backward"](randn(gen, 3, 5, 4, 6), x, rm, rv, randn(gen, 5), True, 1e-5)
    assert torch.equal(rm, before[0]) and torch.equal(rv, before[1])


@pytest.mark.parametrize("fmt,dtype,warp", [("channels_last", torch.bfloat16, 32), ("nchw", torch.float32, 32),
                                            ("channels_last", torch.bfloat16, 64), ("nchw", torch.float64, 32)])
@pytest.mark.parametrize("training", [True, False])
def test_fused_bn_relu_with_conv_bias(plugins, gen, fmt, dtype, warp, training):
    """The batch norm of fused_conv_bn_relu: relu(batch_norm(x + conv_bias)) with x the convolution
    output without its bias, the running mean updated with the bias; its backward with the ReLU mask,
    against torch's float64 autograd."""
    _, kit = plugins[warp]
    shape = (6, 3, 4, 8) if fmt == "nchw" else (3, 16, 4, 6)
    c = shape[1]
    x = _bn_input(gen, shape, fmt, dtype)
    pdt = torch.float64 if dtype == torch.float64 else torch.float32
    w, b, cb = randn(gen, c, dtype=pdt), randn(gen, c, dtype=pdt), randn(gen, c, dtype=pdt)
    rm, rv = randn(gen, c, dtype=pdt), torch.rand(c, generator=gen, dtype=pdt) + 0.5
    rm64, rv64 = rm.double(), rv.double()
    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = F.relu(F.batch_norm(xd + cb.double().view(1, -1, 1, 1), rm64, rv64, wd, bd, training, 0.2, 1e-4))
    y = call("fused_conv_bn_relu", lambda: bn.batch_norm_forward(kit, x, w, b, rm, rv, training, 0.2, 1e-4, True, conv_bias=cb), ())
    assert_close("batch_norm", y, ref.detach(), (x, rm, rv, w, b, training, 0.2, 1e-4))
    for got, want in ((rm, rm64), (rv, rv64)):
        assert_close("batch_norm", got, want, (x, rm, rv, w, b, training, 0.2, 1e-4), what="running statistics")
    g = randn(gen, *shape, dtype=dtype)
    ref.backward(g.double())
    rm, rv = rm64.to(pdt), rv64.to(pdt)  # the backward of this forward sees the updated statistics
    dx, gw, gb = call("fused_conv_bn_relu_backward", lambda: bn.batch_norm_backward(
        kit, g, x, w, b, rm, rv, training, 1e-4, True, (pdt, pdt), conv_bias=cb), ())
    args = (g, x, rm, rv, w, training, 1e-4)
    for what, got, want in (("grad_x", dx, xd.grad), ("grad_weight", gw, wd.grad), ("grad_bias", gb, bd.grad)):
        assert_close("batch_norm_backward", got, want, args, what=what)


# --- layer_norm / rms_norm backward ---------------------------------------------------------------

#: (shape, normalized_shape, dtype, warp): vector and scalar paths, rows longer than one pass of the
#: block's threads (2 vectors a thread), a 2-D normalized shape
NORM_CASES = [
    ((5, 3, 24), (24,), torch.bfloat16, 32),
    ((3, 2600), (2600,), torch.bfloat16, 32),
    ((4, 37), (37,), torch.float32, 32),
    ((6, 4, 5), (4, 5), torch.float64, 32),
    ((7, 4096), (4096,), torch.bfloat16, 64),
]


@pytest.mark.parametrize("shape,normalized,dtype,warp", NORM_CASES, ids=[f"{s}-{str(d)[6:]}-w{w}" for s, _, d, w in NORM_CASES])
@pytest.mark.parametrize("with_weight", [True, False])
def test_norm_backward(plugins, gen, shape, normalized, dtype, warp, with_weight):
    kernels, _ = plugins[warp]
    x = randn(gen, *shape, dtype=dtype, scale=2.0, shift=1.5)
    w = randn(gen, *normalized, dtype=dtype) if with_weight else None
    g = randn(gen, *shape, dtype=dtype)
    check("layer_norm_backward", kernels["layer_norm_backward"], (g, x, normalized, w, 1e-5), outputs=3)
    check("rms_norm_backward", kernels["rms_norm_backward"], (g, x, normalized, w, 1e-6), outputs=2)


def test_norm_backward_rejects_long_rows(gen):
    from hal.plugin import Inputs
    from hal.registry import get_op

    plugin = Plugin(name="long_rows", version="0")
    hal_cpp.register(plugin, HostRuntime())
    x = randn(gen, 2, 5000)
    for op, args in (("layer_norm_backward", (x, x, (5000,), None, 1e-5)), ("rms_norm_backward", (x, x, (5000,), None, 1e-6))):
        k = next(k for k in plugin.kernels if k.op == op)
        reasons = k.not_supported_reasons(Inputs(get_op(op), args, "cpu", CPU, "float32", "torch"))
        assert reasons == ["rows of 5000 values (the C++ kernel holds rows of up to 4096 in registers)"], op


# --- AdamW ---------------------------------------------------------------------------------------------


def _adam_state(gen, shapes, pdtype, sdtype, masters, gdtype=None):
    params = [randn(gen, *s, dtype=pdtype) for s in shapes]
    grads = [randn(gen, *s, dtype=gdtype or pdtype) for s in shapes]
    m = [randn(gen, *s, dtype=sdtype, scale=0.1) for s in shapes]
    v = [(torch.rand(s, generator=gen) * 0.1).to(sdtype) for s in shapes]
    w = [p.float() + 1e-3 * randn(gen, *p.shape) for p in params] if masters else None
    return params, grads, m, v, w


#: a tensor over several chunks, odd sizes (scalar tails), an empty one
SHAPES = [(7,), (3, 50), (optim.CHUNK + 130,), (0,), (17, 3)]


@pytest.mark.parametrize("pdtype,sdtype,masters", [(torch.bfloat16, torch.float32, True), (torch.float32, torch.float32, False),
                                                   (torch.float16, torch.float16, False), (torch.float64, torch.float64, False)])
@pytest.mark.parametrize("inv_scale", [None, 0.5, "tensor"])
def test_fused_adamw(plugins, gen, pdtype, sdtype, masters, inv_scale):
    kernels, _ = plugins[32]
    params, grads, m, v, w = _adam_state(gen, SHAPES, pdtype, sdtype, masters)
    inv = torch.tensor([0.25]) if inv_scale == "tensor" else inv_scale
    args = (params, grads, m, v, 1e-2, 0.9, 0.999, 1e-8, 0.01, 3.0, w, inv, torch.tensor(0.0))
    inplace = ("params", "exp_avgs", "exp_avg_sqs") + (("master_params",) if masters else ())
    check("fused_adamw_", kernels["fused_adamw_"], args, inplace=inplace)


@pytest.mark.parametrize("pdtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inv_scale", [None, "tensor"])
def test_fused_adamw_float32_grads_beside_masters(plugins, gen, pdtype, inv_scale):
    """Half-precision copies of float32 weights (the masters) stepped on the weights' float32
    grads: the masters and moments as the reference's, and every copy, poisoned before, written as
    its master rounded (vector and scalar paths: SHAPES has odd sizes and tails)."""
    kernels, _ = plugins[32]
    params, grads, m, v, w = _adam_state(gen, SHAPES, pdtype, torch.float32, True, gdtype=torch.float32)
    for p in params:
        p.fill_(float("nan"))
    inv = torch.tensor([0.25]) if inv_scale == "tensor" else inv_scale
    args = (params, grads, m, v, 1e-2, 0.9, 0.999, 1e-8, 0.01, 3.0, w, inv, torch.tensor(0.0))
    check("fused_adamw_", kernels["fused_adamw_"], args, inplace=("params", "exp_avgs", "exp_avg_sqs", "master_params"))
    assert all(torch.equal(p, x.to(pdtype)) for p, x in zip(params, w))


def test_fused_adamw_unaligned_views_take_the_scalar_path(plugins, gen):
    """Tensors that are views one element into a buffer (addresses not 16-byte aligned)."""
    kernels, _ = plugins[32]
    bufs = _adam_state(gen, [(300,), (41,)], torch.bfloat16, torch.float32, True)
    params, grads, m, v, w = ([t[1:] for t in group] for group in bufs)
    assert optim.TABLES.get(address_columns((params, grads, m, v, w)), CPU)[3] is False
    args = (params, grads, m, v, 3e-3, 0.8, 0.99, 1e-6, 0.1, 7.0, w, 2.0, None)
    check("fused_adamw_", kernels["fused_adamw_"], args, inplace=("params", "exp_avgs", "exp_avg_sqs", "master_params"))


@pytest.mark.parametrize("found", [torch.tensor([1.0]), float("inf")], ids=["tensor", "number"])
def test_fused_adamw_skips_on_found_inf(plugins, gen, found):
    kernels, _ = plugins[32]
    params, grads, m, v, _ = _adam_state(gen, [(40,), (9,)], torch.float32, torch.float32, False)
    before = [t.clone() for t in params + m + v]
    kernels["fused_adamw_"](params, grads, m, v, 1e-2, 0.9, 0.999, 1e-8, 0.01, 1.0, None, None, found)
    assert all(torch.equal(a, b) for a, b in zip(before, params + m + v))


def test_adamw_step_matches_the_formula_in_float64(plugins, gen):
    """One element traced by hand: the documented update, not only agreement with cpu_ref."""
    kernels, _ = plugins[32]
    p, g, m, v = (torch.tensor([x], dtype=torch.float64) for x in (0.7, -0.3, 0.05, 0.02))
    lr, b1, b2, eps, wd, step, inv = 1e-2, 0.9, 0.99, 1e-8, 0.1, 4.0, 0.5
    kernels["fused_adamw_"]([p], [g], [m], [v], lr, b1, b2, eps, wd, step, None, inv, None)
    gs = -0.3 * inv
    m_ref, v_ref = b1 * 0.05 + (1 - b1) * gs, b2 * 0.02 + (1 - b2) * gs * gs
    p_ref = 0.7 * (1 - lr * wd) - lr / (1 - b1**step) * m_ref / (math.sqrt(v_ref) / math.sqrt(1 - b2**step) + eps)
    assert (m.item(), v.item()) == pytest.approx((m_ref, v_ref), rel=1e-14) and p.item() == pytest.approx(p_ref, rel=1e-14)


@pytest.mark.parametrize("betas", sv.BETAS, ids=["beta1=0.9", "beta1=0.3"])
@pytest.mark.parametrize("pdtype,masters", [(torch.bfloat16, True), (torch.float16, True), (torch.float32, False)],
                         ids=["bf16_copies", "fp16_copies", "fp32"])
def test_fused_adamw_spreads_nan_and_inf_as_torch_optim_adamw(plugins, betas, pdtype, masters):
    """NaN and infinities (in grads, moments and weights) as torch.optim.AdamW spreads them, on the
    vector and scalar paths; tests/cuda/_adamw_specials.py has the cases and why torch's fused CUDA
    kernel is not the reference there. The copies are poisoned with NaN before the call."""
    kernels, _ = plugins[32]
    gen = torch.Generator().manual_seed(fresh_seed())
    got = sv.special_state(gen, [(7,), (3, 50), (optim.CHUNK + 130,), (17, 3)], pdtype, masters)
    grads = [g.clone() for g in got["grads"]]
    want = sv.torch_adamw(got, betas, 0.5, foreach=False)
    sv.run(kernels["fused_adamw_"], got, betas, torch.tensor([0.5]))
    sv.assert_as_torch(got, want, grads)


def test_fused_adamw_takes_the_step_count_as_a_device_value(plugins, gen):
    """hal.optim.AdamW keeps its step count in a 0-d float32 tensor (capturable): the kernel derives
    the bias corrections from it and updates exactly as with the same count given as a number."""
    kernels, _ = plugins[32]
    state = _adam_state(gen, SHAPES, torch.bfloat16, torch.float32, True)
    twin = [[t.clone() for t in group] for group in state]
    before = [t.clone() for t in state[4]]
    for step, (params, grads, m, v, w) in ((torch.tensor(5.0), state), (5.0, twin)):
        kernels["fused_adamw_"](params, grads, m, v, 3e-3, 0.9, 0.999, 1e-8, 0.01, step, w, None, None)
    for a, b in zip((t for group in state for t in group), (t for group in twin for t in group)):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(state[4], before) if a.numel())  # the masters moved
