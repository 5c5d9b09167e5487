"""hal.dist on ROCm: torch.distributed's "nccl" backend is RCCL on a ROCm build, and hal.dist treats
it as the GPU engine it is (the same algorithms, checks and averaging as NCCL, RCCL's own cost
model, "RCCL" in what it says). No RCCL runs here: the decisions are checked on group descriptions
(as tests/dist/test_local.py does for gloo); the two tests that stand in for a ROCm build of torch
set ``torch.version.hip`` and say so."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hal
import hal.dist as hd
from hal.dist import checks, groups, select
from hal.dist.algorithms import REGISTRY, Call
from hal.dist.cost import DEFAULTS
from hal.dist.groups import GroupInfo, engine_name
from hal.dist.launch import torch_backend


def _group(engine: str, n: int = 8, per_node: int = 4) -> GroupInfo:
    nodes = tuple(tuple(range(i, i + per_node)) for i in range(0, n, per_node))
    return GroupInfo(None, 0, n, tuple(range(n)), engine, nodes, topology_known=True)


def test_nccl_is_rccl_on_a_rocm_build() -> None:
    assert engine_name("nccl", "cuda", "6.2.41133") == "rccl"
    assert engine_name("NCCL", "cuda", None) == "nccl"
    assert engine_name("cpu:gloo,cuda:nccl", "cuda", "6.2.41133") == "rccl"
    assert engine_name("cpu:gloo,cuda:nccl", "cpu", "6.2.41133") == "gloo"
    assert engine_name("gloo", "cpu", "6.2.41133") == "gloo"
    assert engine_name("cpu:gloo", "cuda", None) == ""  # no engine for that device: _check_device says so
    assert torch_backend("rccl") == torch_backend("RCCL") == "nccl" and torch_backend("gloo") == "gloo"


@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_rccl_reduces_as_nccl_does(op: str) -> None:
    t = torch.ones(16)
    rccl, nccl, gloo = (Call("all_reduce", t, _group(e), op=op) for e in ("rccl", "nccl", "gloo"))
    assert rccl.reduce_op() == nccl.reduce_op()
    if op == "avg":
        assert rccl.reduce_op() == dist.ReduceOp.AVG and gloo.reduce_op() == dist.ReduceOp.SUM
        before = t.clone()
        rccl.finish_avg(t)  # RCCL averages itself: nothing left to divide
        assert torch.equal(t, before)


def test_rccl_has_its_own_cost_model_and_the_same_algorithms() -> None:
    assert hd.cost_model("rccl") == DEFAULTS["rccl"] != DEFAULTS["nccl"]
    assert DEFAULTS["rccl"].topology_aware_native
    nccl_params = {f: getattr(DEFAULTS["nccl"], f) for f in ("latency_us_intra", "latency_us_inter", "gbps_intra", "gbps_inter",
                                                               "compress_gbps", "launch_us")}
    try:
        hd.set_cost_model("rccl", **nccl_params)  # with NCCL's numbers, RCCL groups decide as NCCL groups do
        for numel in (1 << 8, 1 << 16, 1 << 22):
            for dtype in (torch.float32, torch.bfloat16):
                t = torch.empty(numel, dtype=dtype)
                picks = {}
                for engine in ("rccl", "nccl"):
                    call = Call("all_reduce", t, _group(engine), op="sum")
                    decision = select.decision(call, "auto")
                    picks[engine] = (decision.kernel, [(c.kernel, c.reasons) for c in decision.candidates])
                    assert f"cost model ({engine})" in " ".join(decision.inputs)
                assert picks["rccl"] == picks["nccl"]
    finally:
        hd.reset_cost_model()


def test_rccl_calls_check_as_nccl_calls() -> None:
    t = torch.empty(4, 6)
    for engine in ("rccl", "nccl"):
        call = Call("all_reduce", t, _group(engine, n=2, per_node=2), op="sum")
        rows = [checks.signature(call, "native"), checks.signature(Call("all_reduce", torch.empty(4, 7), call.gi, op="sum"), "native")]
        error = checks.compare(call, rows)
        assert error is not None and "rank 0: float32 (4, 6); rank 1: float32 (4, 7)" in str(error)
    assert set(REGISTRY["all_reduce"]) >= {"native", "hierarchical", "compressed_fp16", "compressed_bf16"}


def test_a_gpu_tensor_on_gloo_names_rccl_on_a_rocm_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stands in for a ROCm build: torch.version.hip set; no tensor is made on the device."""
    device = torch.device("cuda", 0)
    with pytest.raises(hal.InvalidArgumentError) as cuda_error:
        groups._check_device("all_reduce", "gloo", device, None)
    assert "or an nccl group for GPU tensors" in str(cuda_error.value)
    monkeypatch.setattr(torch.version, "hip", "6.2.41133", raising=False)
    with pytest.raises(hal.InvalidArgumentError) as rocm_error:
        groups._check_device("all_reduce", "gloo", device, None)
    assert "or an nccl (RCCL) group for GPU tensors" in str(rocm_error.value)


def test_the_engine_of_a_rocm_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stands in for a ROCm build (torch.version.hip set) on a real gloo group of one rank: the CPU
    side stays gloo, and a group torch reports as nccl would be RCCL."""
    if dist.is_initialized():
        pytest.skip("a process group exists in this test process")
    import tempfile

    store = tempfile.NamedTemporaryFile(delete=False)
    dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
    try:
        monkeypatch.setattr(torch.version, "hip", "6.2.41133", raising=False)
        assert groups._engine(None, torch.device("cpu")) == "gloo"
        t = torch.arange(6.0)
        hd.all_reduce(t)
        assert torch.equal(t, torch.arange(6.0))
    finally:
        dist.destroy_process_group()
