"""The CUDA plugin as installed: discovered, unavailable here with its reason, every op covered,
kernels registered without importing Triton."""

from __future__ import annotations

import importlib.metadata
from typing import Optional
import subprocess
import sys

import pytest
import torch
from hal_backend_cuda import plugin
from hal_backend_cuda._device import MIN_CAPABILITY, SM80, probe, probe_reason, sm

import hal


def test_entry_point_is_installed() -> None:
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="hal.backends")}
    assert eps.get("cuda") == "hal_backend_cuda:plugin"
    assert plugin.api_version.split(".")[0] == hal.API_VERSION.split(".")[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_reports_itself_unavailable_with_the_reason() -> None:
    record = {b.name: b for b in hal.backends()}["cuda"]
    assert record.available is False
    assert record.reason == probe()
    if torch.version.cuda is None:
        assert record.reason.startswith("torch is a CPU build")
    else:
        assert record.reason.startswith("no CUDA device")


def test_probe_reasons() -> None:
    assert probe_reason(None, None, 0, []).startswith("torch is a CPU build")
    assert "ROCm build" in probe_reason(None, "6.2", 0, [])
    assert probe_reason("12.4", None, 0, []).startswith("no CUDA device")
    old = probe_reason("12.4", None, 1, [(7, 0)], ["Tesla V100"])
    assert old == "compute capability 7.0 < 8.0 needed by hal-backend-cuda (Tesla V100)"
    assert probe_reason("12.4", None, 2, [(7, 5), (9, 0)]) is None  # one usable device is enough
    assert probe_reason("13.0", None, 1, [MIN_CAPABILITY]) is None


def test_every_op_has_a_cuda_kernel_with_architecture_data() -> None:
    ops = {d.name for d in hal.list_ops()}
    kernels = [k for k in plugin.kernels if k.backend == "cuda"]
    assert {k.op for k in kernels} == ops
    for k in kernels:
        assert k.archs is not None and not k.archs.accepts("sm_75") and k.archs.accepts("sm_90"), k.qualname


def test_architecture_predicates() -> None:
    assert SM80.accepts("sm_80") and SM80.accepts("sm_100") and not SM80.accepts("sm_75")
    assert not SM80.accepts("gfx90a") and SM80.text == "sm_80 or newer"
    assert sm(90).reason("sm_80") == "device architecture sm_80 not supported (this kernel needs sm_90 or newer)"
    assert sm(90).reason(None) == "device architecture unknown (this kernel needs sm_90 or newer)"
    assert MIN_CAPABILITY == (8, 0)


def _kernel(op: str, name: str):
    return next(k for k in plugin.kernels if k.op == op and k.name == name)


def test_kernels_state_what_they_reject_as_sentences() -> None:
    from hal.plugin import Inputs
    from hal.registry import get_op

    decl = get_op("int8_linear")
    xq, wq = torch.zeros(8, 30, dtype=torch.int8), torch.zeros(16, 30, dtype=torch.int8)
    args = (xq, wq, 1.0, 1.0, None, "float16")
    on_volta = Inputs(decl, args, "cuda", torch.device("cuda", 0), "int8", "torch", "sm_70")
    assert _kernel("int8_linear", "cublaslt").not_supported_reasons(on_volta) == [
        "device architecture sm_70 not supported (this kernel needs sm_80 or newer)"
    ]
    on_hopper = Inputs(decl, args, "cuda", torch.device("cuda", 0), "int8", "torch", "sm_90")
    assert _kernel("int8_linear", "cublaslt").not_supported_reasons(on_hopper) == [
        "8 rows; torch._int_mm needs more than 16",
        "K=30, N=16; torch._int_mm needs both multiples of 8",
    ]
    assert _kernel("int8_linear", "triton").not_supported_reasons(on_hopper) == []


def test_residual_tail_is_one_cudnn_call_in_eval_and_torch_ops_otherwise() -> None:
    """fused_conv_bn_add_relu on an H200 (sm_90): eval with symmetric padding is cudnn_fused
    (torch.cudnn_convolution_add_relu on folded weights); training, asymmetric padding and float64
    are torch's ops, and each refusal is a sentence."""
    from hal.dispatch import prepare
    from hal.plugin import Inputs
    from hal.registry import get_op

    decl = get_op("fused_conv_bn_add_relu")

    def chosen(dtype: torch.dtype, training: bool, padding: object = 1) -> tuple[str, dict[str, list[str]]]:
        x, w = torch.randn(2, 8, 6, 6).to(dtype), torch.randn(16, 8, 3, 3).to(dtype)
        vec = [torch.rand(16).to(dtype) + 0.5 for _ in range(4)]
        out = 6 if padding == 1 else 5
        args = [x, w, None, *vec, torch.randn(2, 16, out, out).to(dtype), 1, padding, 1, 1, 1e-5, 0.1, training]
        canonical = prepare(decl, args).inputs
        inputs = Inputs(decl, canonical.args, "cuda", torch.device("cuda", 0), canonical.dtype, "torch", "sm_90")
        passed: dict[str, list[str]] = {}
        for k in sorted((k for k in plugin.kernels if k.op == decl.name), key=lambda k: -k.priority):
            reasons = k.not_supported_reasons(inputs)
            if not reasons:
                return k.name, passed
            passed[k.name] = reasons
        raise AssertionError(passed)

    assert chosen(torch.float16, training=False) == ("cudnn_fused", {})
    assert chosen(torch.float32, training=False)[0] == "cudnn_fused"
    name, passed = chosen(torch.bfloat16, training=True)
    assert name == "torch" and passed["cudnn_fused"] == ["training mode (batch statistics cannot be folded into the weights)"]
    name, passed = chosen(torch.float16, training=False, padding=(1, 0, 1, 0))
    assert name == "torch"
    assert passed["cudnn_fused"] == ["asymmetric padding (cudnn_convolution_add_relu takes one padding per side pair)"]
    assert chosen(torch.float64, training=False)[0] == "torch"


def test_large_swiglu_inputs_go_to_the_triton_kernel_outside_compiled_graphs() -> None:
    """From 2**25 elements torch's swiglu declines what the Triton kernel takes (the halves of a
    packed MoE projection included); smaller inputs, broadcasting ones and a torch.compile trace's
    fake tensors stay with torch's kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hal.plugin import Inputs
    from hal.registry import get_op

    decl, torch_swiglu = get_op("swiglu"), _kernel("swiglu", "torch")

    def reasons(gate: torch.Tensor, up: torch.Tensor) -> list[str]:
        return torch_swiglu.not_supported_reasons(Inputs(decl, (gate, up), "cuda", torch.device("cuda", 0), "bfloat16", "torch", "sm_90"))

    gate, up = torch.empty(8192, 28672, dtype=torch.bfloat16, device="meta").chunk(2, dim=-1)
    assert reasons(gate, up) == ["117440512 elements (at least 2**25): the Triton kernel's one pass each way moves less "
                                 "memory than torch's five kernels, which outweighs its host time"]
    small = torch.empty(4096, 2816, dtype=torch.bfloat16, device="meta")
    assert reasons(small, small) == []
    assert reasons(gate, torch.empty(14336, dtype=torch.bfloat16, device="meta")) == []  # broadcasting: torch's
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.empty(8192, 14336, dtype=torch.bfloat16, device="meta"))
        assert reasons(fake, fake) == []


def test_compiled_graphs_take_torchs_lm_head_and_loss_where_the_logits_fit() -> None:
    """torch's linear_cross_entropy (the whole logits) joins a torch.compile graph for half-precision
    calls whose logits fit GRAPH_LOGITS_LIMIT (fake tensors); eager calls, float32 and larger logits
    keep the Triton kit's blocked kernel (an opaque node in a graph), each with its reason."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hal.plugin import Inputs
    from hal.registry import get_op
    from hal_torch.loss import GRAPH_LOGITS_LIMIT

    decl, torch_lce = get_op("linear_cross_entropy"), _kernel("linear_cross_entropy", "torch")

    def reasons(rows: int, classes: int, dtype: torch.dtype, fake: bool) -> list[str]:
        x, w = torch.empty(rows, 1024, dtype=dtype, device="meta"), torch.empty(classes, 1024, dtype=dtype, device="meta")
        t = torch.empty(rows, dtype=torch.int64, device="meta")
        with FakeTensorMode() as mode:
            if fake:
                x, w, t = (mode.from_tensor(a) for a in (x, w, t))
            inputs = Inputs(decl, (x, w, t, None, -100, 0.0, "mean"), "cuda", torch.device("cuda", 0), str(dtype)[6:], "torch", "sm_90")
            assert torch_lce.not_supported_reasons(inputs) == []  # within one block, or in a graph
            return torch_lce.torch_autograd_reasons(inputs)

    assert reasons(4096, 32000, torch.bfloat16, fake=True) == []  # the Llama step's LM head: 131M logits
    assert reasons(4096, 32000, torch.bfloat16, fake=False) == [
        "holds the whole logits: only inside torch.compile graphs, where Inductor fuses it (eager calls take the blocked kernels)"]
    assert reasons(8192, 128256, torch.bfloat16, fake=True) == []  # Llama-3's LM head over 8k tokens: 1.05G logits
    assert reasons(16384, 128256, torch.bfloat16, fake=True) == [
        f"the whole logits (16384 x 128256) exceed {GRAPH_LOGITS_LIMIT} elements (hal_torch.loss.GRAPH_LOGITS_LIMIT)"]
    assert reasons(4096, 32000, torch.float32, fake=True) == ["float32: torch's recorded backward would run without the IEEE float32 guard"]


def test_eager_lm_head_calls_never_hold_more_logits_than_one_block() -> None:
    """The op's contract (no whole logits) in eager calls: where Triton is installed, torch's LM head
    and loss (the whole logits) take an eager call only within one block of the blocked kernel,
    forward and backward; the blocked kernel takes the rest (the measured choice had given a
    Llama-3 LM head to torch's, 5.37 GiB of logits)."""
    pytest.importorskip("triton")  # without it the torch kernel is the only one and runs every call
    from hal.plugin import Inputs
    from hal.registry import get_op
    from hal_triton.kernels import LCE_BLOCK_ELEMENTS

    def reasons(op: str, rows: int, classes: int) -> list[str]:
        x, w = torch.empty(rows, 64, dtype=torch.bfloat16, device="meta"), torch.empty(classes, 64, dtype=torch.bfloat16, device="meta")
        args = (x, w, torch.empty(rows, dtype=torch.int64, device="meta"), None, -100, 0.0, "mean")
        if op.endswith("_backward"):
            args = (torch.empty((), device="meta"), *args)
        inputs = Inputs(get_op(op), args, "cuda", torch.device("cuda", 0), "bfloat16", "torch", "sm_90")
        return _kernel(op, "torch").not_supported_reasons(inputs)

    for op in ("linear_cross_entropy", "linear_cross_entropy_backward"):
        assert reasons(op, LCE_BLOCK_ELEMENTS // 1024, 1024) == []
        assert reasons(op, 4096, 128256) == [
            f"would hold the whole logits (4096 x 128256) in an eager call, more than one block of the blocked kernel "
            f"({LCE_BLOCK_ELEMENTS} logits), which runs it"]


def test_eval_fused_convolutions_give_compiled_graphs_torchs_ops() -> None:
    """In eval both fused convolution ops run cuDNN's fused call eagerly; inside a torch.compile
    trace (fake tensors) the first kernel made of torch's ops is ``graph``, in the inputs' half
    precision, which declines real tensors with its reason."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hal.dispatch import prepare
    from hal.plugin import Inputs
    from hal.registry import get_op

    def first_traceable(op: str, fake: bool) -> tuple[Optional[str], dict[str, list[str]]]:
        decl = get_op(op)
        x, w = torch.randn(2, 8, 6, 6).bfloat16(), torch.randn(8, 8, 3, 3).bfloat16()
        vec = [torch.rand(8).bfloat16() + 0.5 for _ in range(4)]
        residual = [torch.randn(2, 8, 6, 6).bfloat16()] if op == "fused_conv_bn_add_relu" else []
        args = [x, w, None, *vec, *residual, 1, 1, 1, 1, 1e-5, 0.1, False]
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            if fake:
                args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            canonical = prepare(decl, args).inputs
            inputs = Inputs(decl, canonical.args, "cuda", torch.device("cuda", 0), canonical.dtype, "torch", "sm_90")
            declined: dict[str, list[str]] = {}
            for k in sorted((k for k in plugin.kernels if k.op == op), key=lambda k: -k.priority):
                reasons = k.not_supported_reasons(inputs)
                if not reasons and not k.torch_autograd_reasons(inputs):
                    return k.name, declined
                declined[k.name] = reasons
        return None, declined

    for op in ("fused_conv_bn_relu", "fused_conv_bn_add_relu"):
        assert first_traceable(op, fake=True)[0] == "graph"
        # eagerly: cudnn_fused, an opaque kernel; of torch's ops only the measured eager twin, last
        name, declined = first_traceable(op, fake=False)
        assert name == "eager" and declined["graph"] == [
            "runs only inside torch.compile graphs, where Inductor computes the batch norm, the residual add and the ReLU in "
            "float32 and rounds once (eagerly cudnn_fused or torch's float32 ops do)"]


def test_importing_the_plugin_imports_no_triton() -> None:
    code = "import sys, hal_backend_cuda; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_autotune_cache_persists_and_seeds(tmp_path) -> None:
    import json

    from hal_triton.autotune import Cache

    seed = tmp_path / "seed.json"
    seed.write_text(json.dumps({"choices": {"a": {"config": {"x": 1}}, "b": {"config": {"x": 2}}}}))
    path = tmp_path / "cache" / "autotune-dev.json"
    cache = Cache(path, seed)
    assert cache.get("a") == {"config": {"x": 1}}
    cache.put("b", {"config": {"x": 3}})  # a local measurement overrides the shipped seed
    reloaded = Cache(path, seed)
    assert reloaded.get("b") == {"config": {"x": 3}} and reloaded.get("a") == {"config": {"x": 1}}
    assert json.loads(path.read_text())["choices"]["b"] == {"config": {"x": 3}}


def test_shipped_h200_choices_are_readable() -> None:
    from hal_triton.autotune import Cache
    from hal_backend_cuda.launch import TABLES

    seed_dir = TABLES.seed_dir
    cache = Cache(seed_dir / "unused.json", seed_dir / "autotune-nvidia-h200-sm90.json")
    hit = cache.get("grouped_gemm/torch.bfloat16/m16384/g128/k4096/n1408")
    assert hit is not None and set(hit["config"]) == {"block_m", "block_n", "block_k", "num_warps", "num_stages"}


def test_graph_replays_rank_the_cpp_batch_norm_first_and_the_recorded_fused_kernel_last() -> None:
    """In steps replayed from a CUDA graph (hal.graphs.device_bound) the C++ batch norm outranks
    torch's, and fused_conv_bn_relu's torch kernel yields to the training decomposition."""
    from hal.runtime import Runtime

    rt = Runtime.from_plugins([plugin])
    for op in ("batch_norm", "batch_norm_backward"):
        assert rt.kernels(op, "cuda")[0].name == "native"
        assert rt.kernels(op, "cuda", device_bound=True)[0].name == "cpp"
    assert rt.kernels("fused_adamw_", "cuda")[0].name == "triton"
    assert rt.kernels("fused_adamw_", "cuda", device_bound=True)[0].name == "cpp"
    fused = [k.name for k in rt.kernels("fused_conv_bn_relu", "cuda", device_bound=True)]
    assert fused[-2:] == ["torch", "eager"], "below every kernel but the measured eager twin"
    assert rt.kernels("fused_conv_bn_relu", "cuda")[0].name == "torch"
