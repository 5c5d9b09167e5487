"""The case table (coverage, ids, data), the comparison (tolerances, NaN, ULPs), poisoning, and the
statuses the runner gives kernels that raise, decline or write into their inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hal.conformance import compare
from hal.conformance.cases import (
    all_cases,
    case_id,
    case_inputs,
    cases_for,
    draw_call,
    parse_case_id,
)
from hal.conformance.draw import place
from hal.conformance.poison import Poisoner
from hal_backend_cpu_ref.attention import softmax as ref_softmax

import hal
from hal.registry import get_op

from ._support import make_backend, run_suite


def test_every_op_of_the_registry_has_cases_and_quick_ones_for_every_dtype():
    table = all_cases()
    for decl in hal.list_ops():
        assert decl.name in table, f"no conformance cases for {decl.name}"
        for dtype in decl.dtypes:
            assert cases_for(decl.name, dtype, quick=True), f"no quick case of {decl.name} for {dtype}"
    assert set(table) == {d.name for d in hal.list_ops()}


def test_case_ids_round_trip_and_are_unique():
    ids = [case_id(op, "k", "float16", c.name) for op, cases in all_cases().items() for c in cases]
    assert len(ids) == len(set(ids))
    for i in ids:
        op, kernel, dtype, name = parse_case_id(i)
        assert case_id(op, kernel, dtype, name) == i
    assert parse_case_id("conv2d[numpy,float16,resnet50_conv3x3_b1]") == ("conv2d", "numpy", "float16", "resnet50_conv3x3_b1")
    assert parse_case_id("conv2d[numpy,float16]") is None


def _arrays(args):
    for v in args.values():
        for t in v if isinstance(v, list) else [v]:
            if isinstance(t, torch.Tensor):
                yield t


def test_case_data_is_deterministic_per_seed_fresh_and_never_zero(seed):
    a = case_inputs("conv2d", "float32", "groups4", seed=seed)
    b = case_inputs("conv2d", "float32", "groups4", seed=seed)
    c = case_inputs("conv2d", "float32", "groups4", seed=seed + 1)
    other = case_inputs("conv2d", "float32", "depthwise", seed=seed)
    assert torch.equal(a["x"], b["x"]) and torch.equal(a["weight"], b["weight"])
    assert not torch.equal(a["x"], c["x"])
    assert a["x"].shape != other["x"].shape or not torch.equal(a["x"], other["x"])
    for decl in hal.list_ops():
        for dtype in decl.dtypes:
            for spec in cases_for(decl.name, dtype, quick=True):
                for t in _arrays(draw_call(decl.name, dtype, spec, seed, "cpu").args):
                    if t.is_floating_point() and t.numel() > 1:
                        assert bool((t != 0).any()), f"{decl.name}/{spec.name}: an all-zero input"


def test_layouts_are_what_the_case_names_say(seed):
    assert not case_inputs("conv2d", "float32", "noncontig_input", seed=seed)["x"].is_contiguous()
    cl = case_inputs("conv2d", "float16", "channels_last", seed=seed)["x"]
    assert cl.is_contiguous(memory_format=torch.channels_last) and not cl.is_contiguous()
    w = case_inputs("linear", "float32", "transposed_weight", seed=seed)["weight"]
    assert w.stride() == (1, w.shape[0])
    q = case_inputs("scaled_dot_product_attention", "bfloat16", "heads_transposed_views", seed=seed)["q"]
    assert not q.is_contiguous()
    values = torch.arange(1.0, 13.0).reshape(3, 4)
    view = place(values, "noncontig")
    assert torch.equal(view, values) and view.stride() == (8, 2)
    assert torch.isnan(view.as_strided((12,), (1,))[1::2]).all()  # the gaps hold NaN


def test_comparison_handles_nan_inf_shapes_and_reports_the_worst_element():
    want = torch.tensor([1.0, float("nan"), float("inf"), -2.0], dtype=torch.float64)
    ok = compare.compare("out", torch.tensor([1.0, float("nan"), float("inf"), -2.0]), want, 1e-6, 1e-5)
    assert ok.ok and ok.max_abs_err == 0.0
    bad = compare.compare("out", torch.tensor([1.0, 0.0, float("inf"), -2.5]), want, 1e-6, 1e-5)
    assert not bad.ok and math.isinf(bad.max_abs_err)
    assert "2 of 4 elements beyond tolerance" in bad.message and "1 of them NaN/inf" in bad.message
    close = compare.compare("x", torch.tensor([[1.0, 3.0]]), torch.tensor([[1.0, 3.0 + 1e-3]], dtype=torch.float64), 1e-4, 0.0)
    assert not close.ok and "worst at (0, 1): got 3, expected 3.001" in close.message
    shape = compare.compare("out", torch.zeros(2, 3), torch.zeros(3, 2, dtype=torch.float64), 1.0, 1.0)
    assert not shape.ok and "shape (2, 3), expected (3, 2)" in shape.message


def test_ulp_distance_counts_representable_values():
    x = torch.tensor([1.0, -1.0, 0.0], dtype=torch.float16)
    assert compare.ulp_distance(x, x.double(), torch.ones(3, dtype=torch.bool)) == 0
    one_ulp = torch.tensor([1.0 + 2**-10], dtype=torch.float16)
    assert compare.ulp_distance(one_ulp, torch.tensor([1.0], dtype=torch.float64), torch.ones(1, dtype=torch.bool)) == 1
    across_zero = torch.tensor([-(2.0**-24)], dtype=torch.float16)  # the smallest negative subnormal
    assert compare.ulp_distance(across_zero, torch.tensor([2.0**-24], dtype=torch.float64), torch.ones(1, dtype=torch.bool)) == 2
    q = torch.tensor([5, -3], dtype=torch.int8)
    assert compare.ulp_distance(q, torch.tensor([3.0, -3.0], dtype=torch.float64), torch.ones(2, dtype=torch.bool)) == 2


def test_tolerances_are_the_declared_ones_widened_scaled_and_overridable():
    conv = get_op("conv2d")
    atol, rtol = compare.resolve(conv, "float16", "float16", k=576)
    assert (atol, rtol) == (pytest.approx(conv.tolerances["float16"].atol * 24), conv.tolerances["float16"].rtol)
    assert compare.resolve(conv, "float16", "float16", k=1, scale=1e-9)[0] == 2.0**-24  # never below the subnormal step
    assert compare.resolve(conv, "float32", "float32", k=4, exact=True) == (0.0, 0.0)
    over = compare.parse_overrides("# why\nconv2d float16 0.5 0.25  # cudnn\nconv2d * 0.1 0.2\n", "t.txt")
    assert compare.resolve(conv, "float16", "float16", k=4, overrides=over) == (1.0, 0.25)
    assert compare.resolve(conv, "float32", "float32", k=1, overrides=over) == (0.1, 0.2)
    assert compare.tolerance_key(get_op("quantize"), "float16", "int8") == "int8"
    assert compare.tolerance_key(get_op("dequantize"), "int8", "float16") == "float16"
    assert compare.tolerance_key(get_op("int8_linear"), "int8", "bfloat16") == "bfloat16"
    assert compare.tolerance_key(get_op("batch_norm"), "float16", "float32") == "float16"
    with pytest.raises(ValueError, match="t.txt:1: expected 'op dtype atol rtol'"):
        compare.parse_overrides("conv2d float16 0.5\n", "t.txt")


def test_poisoning_self_test_passes_here():
    ok, method = Poisoner(torch.device("cpu")).self_test()
    assert ok, method
    assert Poisoner(torch.device("cpu"), enabled=False).self_test() == (False, "off (disabled)")


def test_raising_declining_and_input_writing_kernels(install, seed):
    plugin = make_backend()

    @plugin.kernel("softmax", name="raises", dtypes=["float32"])
    def raises(x, dim):
        raise RuntimeError("device fell over")

    @plugin.kernel("softmax", name="declines", dtypes=["float32"], check=lambda inputs: "needs a 16-aligned row" if inputs["x"].shape[-1] % 16 else None)
    def declines(x, dim):
        return ref_softmax(x, dim)

    @plugin.kernel("softmax", name="in_place", dtypes=["float32"])
    def in_place(x, dim):
        y = ref_softmax(x, dim)
        np.copyto(x, y)  # writes the result into its input
        return y

    install(plugin)
    results = run_suite("buggy", seed, ["softmax"], ["float32"], quick=True)
    by = {(r.kernel, r.case): r for r in results.values()}
    assert by[("raises", "attention_probs")].status == "error"
    assert "kernel raised RuntimeError: device fell over" in by[("raises", "attention_probs")].reason
    assert by[("declines", "attention_probs")].status == "pass"  # rows of 16
    declined = by[("declines", "middle_dim")]
    assert declined.status == "skip" and "needs a 16-aligned row" in declined.reason
    written = by[("in_place", "attention_probs")]
    assert written.status == "fail" and "x: the kernel wrote into this input" in written.reason


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fused_backward_grad_out_vanishes_on_the_relu_kink_band(dtype, seed):
    """Where the float64 pre-activation is within KINK_BAND of zero, a correct half-precision
    kernel may put the ReLU's mask either way: the case's grad_out is zero exactly there."""
    from hal.conformance.cases import find_case
    from hal.conformance.cases.conv import KINK_BAND, _pre_activation

    spec = find_case("fused_conv_bn_relu_backward", "resnet50_train_3x3_b2")
    call = draw_call("fused_conv_bn_relu_backward", dtype, spec, seed, "cpu")
    g = call.args["grad_out"].float()
    near = _pre_activation(call.args).abs() <= KINK_BAND[dtype] * call.scale
    assert 0 < int(near.sum()) < g.numel() // 10  # a thin band, but a band
    assert bool((g[near] == 0).all())
    assert bool((g[~near] != 0).float().mean() > 0.99)  # elsewhere the drawn values are kept
