"""The dispatcher with fake backends built in the test: priorities, reasons, fallbacks, strict mode,
overrides, the decision cache and threads."""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import pytest
import torch

import hal
from hal.errors import (
    BackendUnavailableError,
    InvalidArgumentError,
    PluginError,
    UnsupportedError,
)
from hal.plugin import Archs, Plugin


def softmax_plugin(name: str, priority: int, kernels: dict, **backend) -> Plugin:
    """A CPU backend whose softmax kernels tag their result with the kernel's name.

    ``kernels`` maps kernel name -> dict of KernelSpec options (priority, dtypes, check ...).
    """
    p = Plugin(name, "1.0")
    p.define_backend(priority=priority, device_types=backend.pop("device_types", ("cpu",)), **backend)
    for kname, opts in kernels.items():

        def make(tag: str):
            def softmax(x, dim):
                out = torch.softmax(torch.as_tensor(x), dim)
                RAN.append(tag)
                return out

            return softmax

        p.kernel("softmax", name=kname, **opts)(make(f"{name}/{kname}"))
    return p


RAN: list[str] = []


@pytest.fixture(autouse=True)
def _clear_ran(clean_env):
    RAN.clear()
    yield


def test_highest_priority_backend_and_kernel_win(install_plugins):
    install_plugins(
        [
            softmax_plugin("low", 1, {"a": {"priority": 9}}),
            softmax_plugin("high", 10, {"slow": {"priority": 1}, "fast": {"priority": 5}}),
        ]
    )
    x = torch.randn(3, 5)
    torch.testing.assert_close(hal.ops.softmax(x), torch.softmax(x, -1))
    assert RAN == ["high/fast"]
    d = hal.explain("softmax", x)
    assert (d.backend, d.kernel, d.fallback) == ("high", "fast", None)
    assert "chosen: high/fast" in str(d)


def test_rejection_reasons_are_sentences_and_next_kernel_runs(install_plugins):
    install_plugins(
        [
            softmax_plugin(
                "b",
                10,
                {
                    "f32": {"priority": 5, "dtypes": ["float32"]},
                    "lastdim": {"priority": 3, "check": lambda i: None if i["dim"] == i["x"].ndim - 1 else "dim must be the last dimension"},
                    "any": {"priority": 1},
                },
            )
        ]
    )
    x = torch.randn(4, 6, dtype=torch.float64)
    hal.ops.softmax(x, dim=0)
    assert RAN == ["b/any"]
    text = str(hal.explain("softmax", x, dim=0))
    assert "dtype float64 not supported (supports float32)" in text
    assert "dim must be the last dimension" in text
    assert hal.explain("softmax", x).kernel == "lastdim"
    assert hal.explain("softmax", x.float(), dim=0).kernel == "f32"


def test_architecture_predicate_reason(install_plugins):
    newer = Archs(lambda a: a >= "v9", "v9 or newer")
    install_plugins([softmax_plugin("gpu_like", 10, {"hopper": {"priority": 5, "archs": newer}, "any": {}}, arch=lambda d: "v8")])
    d = hal.explain("softmax", torch.randn(2, 3))
    assert d.kernel == "any"
    assert "device architecture v8 not supported (this kernel needs v9 or newer)" in str(d)


def test_unavailable_backend_is_skipped_with_its_reason(install_plugins):
    install_plugins([softmax_plugin("widget", 50, {"w": {}}, probe=lambda: "no widget attached"), softmax_plugin("plain", 1, {"p": {}})])
    x = torch.randn(2, 3)
    hal.ops.softmax(x)
    assert RAN == ["plain/p"]
    text = str(hal.explain("softmax", x))
    assert "backend unavailable: no widget attached" in text
    records = {r.name: r for r in hal.backends()}
    assert records["widget"].available is False and records["widget"].reason == "no widget attached"
    assert records["plain"].available is True


def test_probe_that_raises_makes_backend_unavailable_not_hal(install_plugins):
    def probe():
        raise RuntimeError("driver exploded")

    install_plugins([softmax_plugin("bad", 50, {"w": {}}, probe=probe), softmax_plugin("plain", 1, {"p": {}})])
    hal.ops.softmax(torch.randn(2, 3))
    assert RAN == ["plain/p"]
    rec = {r.name: r for r in hal.backends()}["bad"]
    assert not rec.available and "driver exploded" in rec.reason


def test_no_kernel_anywhere_lists_inputs_and_candidates(install_plugins):
    install_plugins([softmax_plugin("only", 1, {"f16": {"dtypes": ["float16"]}})])
    x = torch.randn(2, 3)
    with pytest.raises(UnsupportedError) as info:
        hal.ops.softmax(x)
    msg = str(info.value)
    assert "no kernel can run softmax" in msg
    assert "x: a float32 tensor of shape (2, 3) on cpu" in msg
    assert "only/f16: dtype float32 not supported (supports float16)" in msg


def test_no_backend_for_device_says_how_to_fix(install_plugins):
    install_plugins([softmax_plugin("only", 1, {"k": {}})])
    with pytest.raises(BackendUnavailableError, match="no usable backend for meta inputs"):
        hal.ops.softmax(torch.randn(2, 3, device="meta"))


# --- composite fallback, counting, logging, strict mode ---------------------------------------


def composite_plugin() -> Plugin:
    """A backend with the pieces of fused_conv_bn_relu but not the fused kernel."""
    p = Plugin("pieces", "1.0")
    p.define_backend(priority=10, device_types=("cpu",))

    @p.kernel("conv2d", name="torch")
    def conv2d(x, weight, bias, stride, padding, dilation, groups):
        t, b, l, r = padding
        return torch.nn.functional.conv2d(torch.nn.functional.pad(x, (l, r, t, b)), weight, bias, stride, 0, dilation, groups)

    @p.kernel("batch_norm", name="torch")
    def batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps):
        return torch.nn.functional.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)

    @p.kernel("scale_shift_act", name="torch")
    def scale_shift_act(x, scale, shift, act):
        assert act == "relu"
        return torch.relu(x * scale + shift)

    return p


def _fused_args():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 8, 8, generator=g)
    w = torch.randn(4, 3, 3, 3, generator=g)
    mean, var = torch.randn(4, generator=g), torch.rand(4, generator=g) + 0.5
    return x, w, mean, var


def test_composite_fallback_is_counted_logged_once_and_correct(install_plugins, caplog):
    install_plugins([composite_plugin()])
    x, w, mean, var = _fused_args()
    with caplog.at_level(logging.WARNING, logger="hal"):
        for _ in range(3):
            out = hal.ops.fused_conv_bn_relu(x, w, None, None, None, mean, var, padding=1)
    want = torch.relu(torch.nn.functional.batch_norm(torch.nn.functional.conv2d(x, w, padding=1), mean, var))
    torch.testing.assert_close(out, want)
    s = hal.stats()[("fused_conv_bn_relu", "pieces", "composite")]
    assert s == {"calls": 3, "fallbacks": 3}
    assert hal.stats()[("conv2d", "pieces", "torch")]["fallbacks"] == 0
    warnings = [r for r in caplog.records if "fell back" in r.getMessage()]
    assert len(warnings) == 1
    assert "fused_conv_bn_relu" in warnings[0].getMessage() and "composite" in warnings[0].getMessage()


@pytest.mark.parametrize("how", ["env", "use"])
def test_strict_mode_turns_fallback_into_error(install_plugins, clean_env, how):
    install_plugins([composite_plugin()])
    x, w, mean, var = _fused_args()
    if how == "env":
        clean_env.setenv("HAL_STRICT", "1")
        ctx = hal.use()
    else:
        ctx = hal.use(strict=True)
    with ctx, pytest.raises(UnsupportedError, match="strict mode: fused_conv_bn_relu on cpu would fall back"):
        hal.ops.fused_conv_bn_relu(x, w, None, None, None, mean, var)
    assert ("fused_conv_bn_relu", "pieces", "composite") not in hal.stats()


def test_use_strict_false_overrides_env(install_plugins, clean_env):
    install_plugins([composite_plugin()])
    clean_env.setenv("HAL_STRICT", "1")
    x, w, mean, var = _fused_args()
    with hal.use(strict=False):
        hal.ops.fused_conv_bn_relu(x, w, None, None, None, mean, var)


def test_forcing_composite_is_not_a_fallback(install_plugins):
    install_plugins([composite_plugin()])
    x, w, mean, var = _fused_args()
    with hal.use(kernel={"fused_conv_bn_relu": "composite"}, strict=True):
        hal.ops.fused_conv_bn_relu(x, w, None, None, None, mean, var)
    assert hal.stats()[("fused_conv_bn_relu", "pieces", "composite")] == {"calls": 1, "fallbacks": 0}


def test_lower_priority_backend_fallback_is_counted(install_plugins):
    install_plugins([softmax_plugin("hi", 10, {"f16": {"dtypes": ["float16"]}}), softmax_plugin("lo", 1, {"any": {}})])
    hal.ops.softmax(torch.randn(2, 2))
    assert RAN == ["lo/any"]
    assert hal.stats()[("softmax", "lo", "any")] == {"calls": 1, "fallbacks": 1}
    assert hal.explain("softmax", torch.randn(2, 2)).fallback == "backend"


# --- overrides ------------------------------------------------------------------------------


def test_hal_backend_env_and_use_force_a_backend(install_plugins, clean_env):
    install_plugins([softmax_plugin("hi", 10, {"k": {}}), softmax_plugin("lo", 1, {"k": {}})])
    x = torch.randn(2, 2)
    clean_env.setenv("HAL_BACKEND", "lo")
    hal.dispatch.reset()
    hal.ops.softmax(x)
    with hal.use(backend="hi"):
        hal.ops.softmax(x)
    assert RAN == ["lo/k", "hi/k"]
    assert "backend lo (HAL_BACKEND)" in str(hal.explain("softmax", x))


def test_forced_backend_missing_or_unusable(install_plugins):
    install_plugins([softmax_plugin("hi", 10, {"k": {}}), softmax_plugin("off", 5, {"k": {}}, probe=lambda: "no device")])
    x = torch.randn(2, 2)
    with hal.use(backend="nope"), pytest.raises(BackendUnavailableError, match=r"backend 'nope' .* is not installed.*No hal backend of that name is known"):
        hal.ops.softmax(x)
    with hal.use(backend="off"), pytest.raises(BackendUnavailableError, match="not usable here: no device"):
        hal.ops.softmax(x)
    with hal.use(backend="cuda"), pytest.raises(BackendUnavailableError, match=r"pip install hal-backend-cuda"):
        hal.ops.softmax(x)  # one of the project's backends: the install hint names its distribution


def test_kernel_overrides(install_plugins, clean_env):
    b = softmax_plugin("b", 10, {"fast": {"priority": 5}, "slow": {"priority": 1}})
    b.kernel("matmul", name="only")(lambda a, b: torch.matmul(a, b))
    install_plugins([b])
    x = torch.randn(2, 2)
    clean_env.setenv("HAL_KERNEL_SOFTMAX", "slow")
    hal.dispatch.reset()
    hal.ops.softmax(x)
    clean_env.delenv("HAL_KERNEL_SOFTMAX")
    hal.dispatch.reset()
    with hal.use(kernel="slow"):  # a name: forced for every op having such a kernel
        hal.ops.softmax(x)
        # an op without a kernel of that name dispatches normally
        assert hal.explain("matmul", x, x).kernel == "only"
        torch.testing.assert_close(hal.ops.matmul(x, x), x @ x)
    with hal.use(kernel={"softmax": "slow"}):
        hal.ops.softmax(x)
    hal.ops.softmax(x)
    assert RAN == ["b/slow", "b/slow", "b/slow", "b/fast"]
    with pytest.raises(InvalidArgumentError, match=r"kernel\['softmax'\]' must be one of the kernels of softmax: fast, slow; got 'missing'"):
        hal.use(kernel={"softmax": "missing"}).__enter__()
    with pytest.raises(InvalidArgumentError, match="keys are declared op names"):
        hal.use(kernel={"softmaxx": "fast"}).__enter__()


def test_forced_kernel_that_cannot_run_raises_with_reasons(install_plugins):
    install_plugins([softmax_plugin("b", 10, {"f16": {"dtypes": ["float16"]}, "any": {}})])
    with hal.use(kernel={"softmax": "f16"}), pytest.raises(UnsupportedError, match=r"(?s)forced kernel b/f16.*dtype float32 not supported"):
        hal.ops.softmax(torch.randn(2, 2))


def test_use_scopes_nest_and_are_per_thread(install_plugins):
    install_plugins([softmax_plugin("hi", 10, {"k": {}}), softmax_plugin("lo", 1, {"k": {}})])
    x = torch.randn(2, 2)
    seen = []
    with hal.use(backend="lo"):
        with hal.use(strict=True) as inner:
            assert inner.backend == "lo" and inner.strict is True
            t = threading.Thread(target=lambda: seen.append(hal.explain("softmax", x).backend))
            t.start()
            t.join()
            hal.ops.softmax(x)
    hal.ops.softmax(x)
    assert seen == ["hi"]
    assert RAN == ["lo/k", "hi/k"]


# --- the decision cache ---------------------------------------------------------------------


def test_cache_follows_dtype_shape_layout_and_array_type(install_plugins):
    install_plugins(
        [
            softmax_plugin(
                "b",
                10,
                {
                    "f32": {"priority": 9, "dtypes": ["float32"]},
                    "small": {"priority": 5, "check": lambda i: None if i["x"].shape[-1] <= 8 else "rows longer than 8"},
                    "contig": {"priority": 3, "check": lambda i: None if i["x"].is_contiguous() else "x is not contiguous"},
                    "any": {"priority": 1},
                },
                array_api="torch",
            )
        ]
    )
    x32 = torch.randn(4, 16)
    x64 = x32.double()
    for x, tag in [
        (x32, "f32"),
        (x64, "contig"),
        (x64[:, :8], "small"),
        (torch.randn(16, 4, dtype=torch.float64).t(), "any"),  # (4, 16), not contiguous
        (x32, "f32"),
        (x64, "contig"),
        (x64.numpy(), "contig"),
    ]:
        RAN.clear()
        out = hal.ops.softmax(x)
        assert RAN == [f"b/{tag}"], (tuple(x.shape), x.dtype)
        assert type(out) is type(x)
        np.testing.assert_allclose(np.asarray(out), torch.softmax(torch.as_tensor(np.asarray(x)), -1).numpy(), rtol=1e-6)


def test_cache_follows_the_device(install_plugins):
    """A backend serving torch's "meta" device stands in for a second device kind."""
    install_plugins([softmax_plugin("cpu_b", 10, {"c": {}}), softmax_plugin("meta_b", 10, {"m": {}}, device_types=("meta",))])
    cpu, meta = torch.randn(3, 4), torch.randn(3, 4, device="meta")
    for x, tag in [(cpu, "cpu_b/c"), (meta, "meta_b/m"), (cpu, "cpu_b/c"), (meta, "meta_b/m")]:
        RAN.clear()
        out = hal.ops.softmax(x)
        assert RAN == [tag] and out.device == x.device
    assert hal.explain("softmax", meta).device == "meta"


def test_eight_threads_calling_at_once(install_plugins):
    install_plugins([softmax_plugin("b", 10, {"f32": {"priority": 5, "dtypes": ["float32"]}, "any": {}})])
    errors: list[BaseException] = []
    per_thread = 200
    barrier = threading.Barrier(8)

    def work(i: int) -> None:
        try:
            dtype = torch.float32 if i % 2 else torch.float64
            x = torch.randn(3, 4 + i, dtype=dtype)
            barrier.wait()
            for _ in range(per_thread):
                out = hal.ops.softmax(x, dim=-1)
                torch.testing.assert_close(out, torch.softmax(x, -1))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    s = hal.stats()
    assert s[("softmax", "b", "f32")]["calls"] == 4 * per_thread
    assert s[("softmax", "b", "any")]["calls"] == 4 * per_thread
    assert RAN.count("b/f32") == 4 * per_thread


# --- array types and in-place ops ------------------------------------------------------------


def numpy_plugin() -> Plugin:
    p = Plugin("npb", "1.0")
    p.define_backend(priority=10, device_types=("cpu",), array_api="numpy")

    @p.kernel("softmax", name="np")
    def softmax(x, dim):
        assert isinstance(x, np.ndarray)
        e = np.exp(x.astype(np.float64) - x.max(axis=dim, keepdims=True))
        return (e / e.sum(axis=dim, keepdims=True)).astype(x.dtype)

    @p.kernel("amp_unscale_", name="np")
    def amp_unscale_(tensors, inv_scale):
        bad = False
        for t in tensors:
            assert isinstance(t, np.ndarray)
            bad |= not np.isfinite(t.astype(np.float64)).all()
            t[...] = (t.astype(np.float64) * float(np.asarray(inv_scale, dtype=np.float64).reshape(()))).astype(t.dtype)
        return np.float32(bad)  # a NumPy scalar: the dispatcher must hand back a 0-d array/tensor

    return p


def test_numpy_backend_gets_numpy_and_returns_the_callers_type(install_plugins):
    install_plugins([numpy_plugin()])
    t = torch.randn(3, 7, dtype=torch.bfloat16)
    out = hal.ops.softmax(t)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), torch.softmax(t.float(), -1), atol=1e-2, rtol=1e-2)
    a = np.random.default_rng(1).standard_normal((2, 5)).astype(np.float16)
    out_np = hal.ops.softmax(a, 0)
    assert isinstance(out_np, np.ndarray) and out_np.dtype == np.float16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_in_place_op_through_numpy_kernel_mutates_the_torch_tensors(install_plugins, dtype):
    install_plugins([numpy_plugin()])
    ts = [torch.randn(5, dtype=dtype), torch.randn(2, 3, dtype=dtype)[:, ::2]]
    before = [t.clone() for t in ts]
    found = hal.ops.amp_unscale_(ts, 0.5)
    assert isinstance(found, torch.Tensor) and found.dim() == 0 and float(found) == 0.0
    for t, b in zip(ts, before):
        torch.testing.assert_close(t, (b.double() * 0.5).to(dtype))
    ts[0][1] = float("inf")
    assert float(hal.ops.amp_unscale_(ts, 2.0)) == 1.0
    arrs = [np.ones(3, np.float32)]
    found_np = hal.ops.amp_unscale_(arrs, 0.25)
    assert isinstance(found_np, np.ndarray) and found_np.shape == () and arrs[0][0] == 0.25


# --- argument checking ------------------------------------------------------------------------


def test_mixed_array_types_and_devices_are_rejected(install_plugins):
    install_plugins([numpy_plugin()])
    with pytest.raises(InvalidArgumentError, match=r"matmul: argument 'b' must be of the same array type and device as 'a'"):
        hal.ops.matmul(torch.randn(2, 2), np.ones((2, 2), np.float32))
    with pytest.raises(InvalidArgumentError, match=r"argument 'tensors\[1\]'"):
        hal.ops.amp_unscale_([torch.ones(2), torch.ones(2, device="meta")], 1.0)
    with pytest.raises(InvalidArgumentError, match="argument 'x' must be a torch.Tensor or numpy.ndarray; got"):
        hal.ops.softmax([1.0, 2.0])


# --- plugins and registration ------------------------------------------------------------------


def test_kernel_signature_is_checked_at_registration():
    p = Plugin("sig", "1.0")
    with pytest.raises(PluginError, match=r"kernel 'k' of op softmax: takes parameters \('x',\), but op softmax declares \('x', 'dim'\)"):
        p.kernel("softmax", name="k")(lambda x: x)
    with pytest.raises(PluginError, match="unknown op"):
        p.kernel("no_such_op", name="k")(lambda x: x)
    with pytest.raises(PluginError, match="claims dtypes"):
        p.kernel("dequantize", name="k", dtypes=["float32"])(lambda q, scale, zero_point, axis: q)


def test_plugin_of_another_api_major_is_refused_and_reported(install_plugins):
    future = softmax_plugin("future", 99, {"k": {}})
    future.api_version = "2.1"
    install_plugins([future, softmax_plugin("ok", 1, {"k": {}})])
    hal.ops.softmax(torch.randn(2, 2))
    assert RAN == ["ok/k"]
    rec = {r.name: r for r in hal.backends()}["future"]
    assert rec.available is False
    assert "built for hal plugin API 2.1" in rec.load_error and "API 1.0" in rec.load_error
    assert "pip install --upgrade hal" in rec.load_error
    old = softmax_plugin("old", 1, {"k": {}})
    old.api_version = "0.9"
    install_plugins([old])
    with pytest.raises(BackendUnavailableError) as info:
        hal.ops.softmax(torch.randn(2, 2))
    assert "plugins not loaded" in str(info.value) and "pip install --upgrade hal-backend-old" in str(info.value)


def test_list_ops_records():
    ops = {o.name: o for o in hal.list_ops()}
    for name in ["conv2d", "batch_norm", "fused_conv_bn_relu", "fused_conv_bn_add_relu", "scale_shift_act", "linear", "matmul", "grouped_gemm",
                 "layer_norm", "rms_norm", "softmax", "scaled_dot_product_attention", "amp_unscale_", "fused_adamw_",
                 "quantize", "dequantize", "fake_quantize", "int8_linear", "rotary_embedding", "swiglu", "cross_entropy",
                 "linear_cross_entropy"]:
        decl = ops[name]
        assert decl.signature.startswith("(") and decl.doc and decl.dtypes and decl.tolerances
    trainable = [o for o in ops.values() if o.backward]
    assert len(trainable) == 19
    for o in trainable:
        if o.nondifferentiable_results:  # rms_norm_amax, swiglu_amax: the backward op of the op they extend
            plain = ops[ops[o.backward].forward]
            assert o.name.startswith(plain.name) and o.gradients == plain.gradients and o.param_names == plain.param_names
        else:
            assert ops[o.backward].forward == o.name
    assert ops["fused_adamw_"].signature.startswith("(params, grads, exp_avgs, exp_avg_sqs, *, lr")


def test_a_static_argument_given_canonical_is_not_substituted_and_one_given_otherwise_is(install_plugins):
    """softmax(t, 1) on a 2-D t: dim is canonical as given, so its plan calls the kernel with the
    call's own arguments (no substitution step on the hot path); dim=-1 is substituted by 1,
    through its own plan."""
    seen: list[Any] = []
    p = Plugin("recorder", "1.0")
    p.define_backend(priority=1000, device_types=("cpu",), array_api="torch")

    @p.kernel("softmax", name="record")
    def record(x, dim):
        seen.append((type(dim), dim))
        return torch.softmax(x, dim)

    install_plugins([p])
    t = torch.randn(3, 5)
    with torch.no_grad():
        for dim in (1, -1, 1, -1):
            torch.testing.assert_close(hal.ops.softmax(t, dim), torch.softmax(t, 1))
    assert seen == [(int, 1)] * 4
    key = next(k for k in hal.dispatch.DISPATCHER._cache if k[0].name == "softmax" and k[-1] == (int, 1))
    assert hal.dispatch.DISPATCHER._cache[key][1] is record, "a call already canonical runs the kernel itself"
