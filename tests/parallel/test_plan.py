"""hal.parallel.parallelize on real gloo groups: whole Llama-style models against one process.

Every rank builds the same model from the seed twice: the reference, run whole on this process, and
a copy that :func:`hal.parallel.parallelize` splits over the tensor-parallel ranks. Both train for
three steps on the same tokens; the losses, every parameter's gradient (this rank's shard) and the
parameters after the steps must agree: float64 to rounding, float32 and bfloat16 autocast within
their tolerances. Models: hal's decoder (``bench/models_llama.py``, the reference on torch's ops,
the parallel copy on hal's) and a ``transformers`` ``LlamaForCausalLM`` built from a config (no
download). On the 2 x 2 mesh the "dp" dimension is data parallelism: each replica takes half the
batch and the gradients are averaged over it through ``hal.dist``.
"""

from __future__ import annotations

import copy
import types
from typing import Any, Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hal.dist import launch as _launch_module
from hal.dist.launch import launch
from tests.parallel.test_tensor import CHECKED, run_checks, shard, shard_map, train_compare

pytestmark = pytest.mark.timeout(300)

# the ranks import transformers' Llama (about 3 s each): once, in the fork server, when it starts after this
_launch_module.PRELOAD.append("transformers.models.llama.modeling_llama")


def _hal_decoder(dtype: torch.dtype, seed: int) -> tuple[nn.Module, nn.Module, Callable[..., torch.Tensor]]:
    """(reference on torch's ops, the same weights on hal's ops, loss(model, tokens, targets))."""
    from bench.models_llama import OPS, Decoder, LlamaConfig

    cfg = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, ffn=48, seq=8, batch=4)
    torch.manual_seed(seed)
    ref = Decoder(cfg, OPS["torch"]()).to(dtype)
    with torch.no_grad():  # norms' weights away from 1, so that their gradients matter
        for name, p in ref.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    par = copy.deepcopy(ref)
    for m in [par] + list(par.blocks):
        m.ops = OPS["hal"]()

    def loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = model.hidden(tokens)
        logits = F.linear(h, model.lm_head.weight).flatten(0, 1)
        return F.cross_entropy(logits if logits.dtype == torch.float64 else logits.float(), targets.flatten())

    return ref, par, loss


def _rms_norm_float64(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _hf_llama(dtype: torch.dtype, seed: int, kv_heads: int, impl: str) -> tuple[nn.Module, nn.Module, Callable[..., torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=kv_heads, max_position_embeddings=32, rms_norm_eps=1e-5, initializer_range=0.2,
                      tie_word_embeddings=False, attn_implementation=impl)
    torch.manual_seed(seed)
    ref = LlamaForCausalLM(cfg).to(dtype)
    with torch.no_grad():
        for p in ref.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    if dtype == torch.float64:  # HF's RMSNorm computes in float32 whatever the input: in float64 here, as hal's does
        for m in ref.modules():
            if type(m).__name__ == "LlamaRMSNorm":
                m.forward = types.MethodType(_rms_norm_float64, m)
    par = copy.deepcopy(ref)

    def loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        # the next-token loss from the logits in their own dtype (HF's loss takes float32 even for float64)
        logits = model(input_ids=tokens, attention_mask=mask).logits[:, :-1].flatten(0, 1)
        return F.cross_entropy(logits if logits.dtype == torch.float64 else logits.float(), targets[:, 1:].flatten(), ignore_index=-100)

    return ref, par, loss


def _checks(rank: int, n: int, seed: int, mesh_shape: tuple[int, ...]) -> dict[str, str]:
    import hal
    import hal.dist as hd
    from hal.parallel import (BlockParallel, SequenceEntry, SequenceExit, full_state_dict, llama_plan, load_full_state_dict,
                              parallelize)
    from hal.parallel.tensor import DTensor, local_tensor
    from torch.distributed.device_mesh import init_device_mesh

    names = ("tp",) if len(mesh_shape) == 1 else ("dp", "tp")
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    tp = mesh["tp"].size()
    tp_rank = mesh["tp"].get_local_rank()
    dp, dp_rank = (mesh["dp"].size(), mesh["dp"].get_local_rank()) if "dp" in names else (1, 0)
    dp_group = mesh["dp"].get_group() if dp > 1 else None
    f64, f32, bf16 = torch.float64, torch.float32, torch.bfloat16

    def model_case(kind: str, dtype: torch.dtype, sp: bool, overlap: bool = False, dtensor: bool = False, padded: bool = False,
                   impl: str = "sdpa") -> Callable[[], None]:
        def check() -> None:
            pd = f32 if dtype == bf16 else dtype
            if kind == "hal":
                ref, par, loss = _hal_decoder(pd, seed)
            else:
                ref, par, loss = _hf_llama(pd, seed, 2 if tp <= 2 else 4, impl)
            par = parallelize(par, mesh, sequence_parallel=sp, overlap=overlap, dtensor=dtensor, chunks=3)
            g = torch.Generator().manual_seed(seed + 1)
            batch, seq = 2 * dp, 8
            tokens = torch.randint(0, 64, (batch, seq), generator=g)
            targets = torch.randint(0, 64, (batch, seq), generator=g)
            mask = None
            extra: dict[str, Any] = {}
            if padded:  # row 1 left-padded by 3 tokens, its labels ignored there
                mask = torch.ones(batch, seq, dtype=torch.long)
                mask[1, :3] = 0
                targets[1, :3] = -100
                extra = {"mask": mask}
            mine = slice(dp_rank * batch // dp, (dp_rank + 1) * batch // dp)

            def ref_loss(m: nn.Module) -> tuple[torch.Tensor, Any]:
                value = loss(m, tokens, targets, **extra)
                return value, {"loss": value.detach()}

            def par_loss() -> tuple[torch.Tensor, Any]:
                value = loss(par, tokens[mine], targets[mine], **{k: v[mine] for k, v in extra.items()})
                mean = value.detach().clone()
                if dp > 1:
                    hd.all_reduce(mean, op="avg", group=dp_group)
                return value, {"loss": mean}

            def grad_sync(model: nn.Module) -> None:
                if dp > 1:
                    for p in model.parameters():
                        if p.grad is not None:
                            hd.all_reduce(local_tensor(p.grad), op="avg", group=dp_group)

            train_compare(ref, par, ref_loss, par_loss, tp, tp_rank, dtype, grad_sync=grad_sync)
            if dtensor:
                assert any(isinstance(p, DTensor) for p in par.parameters())
            # the gathered state_dict has the reference's keys and shapes, this rank's shards where they belong
            full, want, dims = full_state_dict(par), ref.state_dict(), shard_map(par)
            assert set(full) == set(want), set(full) ^ set(want)
            mine = par.state_dict()
            for key, value in want.items():
                assert full[key].shape == value.shape and full[key].dtype == value.dtype, key
                torch.testing.assert_close(shard(full[key], dims.get(key), tp, tp_rank), local_tensor(mine[key]), rtol=0, atol=0)
            # loading the reference's state gives this rank's shards of it, exactly
            load_full_state_dict(par, want)
            for key, value in full_state_dict(par).items():
                torch.testing.assert_close(value, want[key], rtol=0, atol=0, msg=lambda m: f"reloaded {key}: {m}")

        return check

    def plan_shape() -> None:
        ref, _, _ = _hal_decoder(f64, seed)
        plan = llama_plan(ref)
        assert list(plan) == ["blocks.0", "blocks.1"], plan
        assert [type(s) for s in plan["blocks.0"]] == [BlockParallel, SequenceEntry]
        assert [type(s) for s in plan["blocks.1"]] == [BlockParallel, SequenceExit]
        hf, _, _ = _hf_llama(f64, seed, 2, "sdpa")
        plan = llama_plan(hf)
        assert "model.layers.1.self_attn" in plan and "model.layers.0.mlp" in plan and "model.layers.1.input_layernorm" in plan
        assert isinstance(plan["model.layers.0"], SequenceEntry) and isinstance(plan["model.layers.1"], SequenceExit)
        par = parallelize(copy.deepcopy(hf), mesh)
        assert set(par.state_dict()) == set(hf.state_dict())  # same keys
        attn = par.model.layers[0].self_attn
        assert attn.q_proj.weight.shape == (32 // tp, 32) and attn.o_proj.weight.shape == (32, 32 // tp)

    def torch_styles() -> None:
        """A plan written with torch's ColwiseParallel / RowwiseParallel runs on hal's layers."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        torch.manual_seed(seed + 2)
        ref = nn.Sequential(nn.Linear(8, 4 * tp), nn.ReLU(), nn.Linear(4 * tp, 8)).double()
        par = parallelize(copy.deepcopy(ref), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        assert type(par[0]).__name__ == "ColumnParallelLinear" and type(par[2]).__name__ == "RowParallelLinear"
        x = torch.randn(3, 5, 8, dtype=f64)
        torch.testing.assert_close(par(x), ref(x))

    def bad_plans() -> None:
        from hal.errors import InvalidArgumentError

        def expect(fn: Callable[[], Any], *fragments: str) -> None:
            try:
                fn()
            except InvalidArgumentError as exc:
                assert all(f in str(exc) for f in fragments), str(exc)
                return
            raise AssertionError("InvalidArgumentError not raised")

        seq = nn.Sequential(nn.Linear(8, 8))
        expect(lambda: parallelize(seq, mesh), "Llama-style blocks")
        expect(lambda: parallelize(seq, mesh, {"nothing.*": BlockParallel()}), "matches none")
        expect(lambda: parallelize(seq, mesh, {"0": "colwise"}), "hal.parallel style")
        expect(lambda: parallelize(seq, mesh, {"0": BlockParallel()}), "Llama-style block")
        expect(lambda: parallelize(seq, mesh, {}, overlap=True), "overlap")
        if len(mesh_shape) > 1:
            expect(lambda: parallelize(seq, mesh, {}, tp_dim="pp"), "tp_dim")
        ref, par, loss = _hal_decoder(f64, seed)
        par = parallelize(par, mesh, sequence_parallel=True)
        odd = torch.zeros(1, 8 * tp + 1, dtype=torch.long)
        expect(lambda: loss(par, odd, odd), "multiple of the", "tensor-parallel ranks")

    def broadcast() -> None:
        """broadcast_from=0: every rank takes rank 0's weights before they are split."""
        ref, par, _ = _hal_decoder(f64, seed)
        if tp_rank != 0:
            with torch.no_grad():
                for p in par.parameters():
                    p.add_(1.0)
        full = full_state_dict(parallelize(par, mesh, broadcast_from=0))
        for key, value in ref.state_dict().items():
            torch.testing.assert_close(full[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")

    cases: list[tuple[str, Callable[[], None]]] = []
    if mesh_shape == (2,):
        cases += [
            ("hal f64 tp", model_case("hal", f64, False)),
            ("hal f64 sp overlap", model_case("hal", f64, True, overlap=True)),
            ("hal f32 sp dtensor", model_case("hal", f32, True, dtensor=True)),
            ("hal bf16 sp", model_case("hal", bf16, True)),
            ("hf f64 tp", model_case("hf", f64, False)),
            ("hf f64 sp overlap padded", model_case("hf", f64, True, overlap=True, padded=True)),
            # (eager float64 overflows its additive mask into NaN on fully padded rows: float32 here)
            ("hf f32 eager sp padded", model_case("hf", f32, True, padded=True, impl="eager")),
            ("hf f32 sp", model_case("hf", f32, True)),
            ("hf bf16 tp dtensor", model_case("hf", bf16, False, dtensor=True)),
            ("plan shape", plan_shape), ("torch styles", torch_styles), ("bad plans", bad_plans), ("broadcast_from", broadcast),
        ]
    elif mesh_shape == (4,):
        cases += [
            ("hal f64 sp overlap", model_case("hal", f64, True, overlap=True)),
            ("hf f64 sp", model_case("hf", f64, True)),
            ("hf f64 tp dtensor", model_case("hf", f64, False, dtensor=True)),
        ]
    elif mesh_shape == (2, 4):  # 8 ranks: the layout of 2 nodes x 4 GPUs, tensor-parallel within a node
        cases += [
            ("dp2 x tp4: hal f64 sp overlap", model_case("hal", f64, True, overlap=True)),
            ("dp2 x tp4: hf f64 sp", model_case("hf", f64, True)),
        ]
    else:
        cases += [
            ("dp x tp: hal f64 sp overlap", model_case("hal", f64, True, overlap=True)),
            ("dp x tp: hf f64 tp dtensor", model_case("hf", f64, False, dtensor=True)),
            ("dp x tp: hf bf16 sp", model_case("hf", bf16, True)),
            ("dp x tp: bad plans", bad_plans),
        ]
    return run_checks(cases)


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2), (2, 4)], ids=["tp2", "tp4", "dp2xtp2", "dp2xtp4"])
def test_parallelized_models_match_one_process(mesh_shape: tuple[int, ...], seed: int) -> None:
    n = 1
    for s in mesh_shape:
        n *= s
    results = launch(_checks, n, (seed, mesh_shape), timeout_s=280, env=CHECKED)
    bad = [f"rank {r.rank}: {r.message}\n{r.traceback}" for r in results if not r.ok]
    assert not bad, "\n".join(bad)
    failures = {f"rank {r.rank} {k}": v for r in results for k, v in r.value.items()}
    assert not failures, f"HAL_TEST_SEED={seed}\n" + "\n".join(f"{k}:\n{v}" for k, v in list(failures.items())[:6])


# --- on a GPU (the H200): the local compute on hal's CUDA kernels, one rank ------------------------------


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _cuda_checks(rank: int, n: int, seed: int) -> dict[str, Any]:
    """Each model and the overlapped column layer on CUDA (float32; bfloat16 autocast) against the
    same computation in float64 on the CPU; which backend ran each hal op."""
    import traceback

    import hal
    from hal.parallel import parallelize
    from hal.parallel.tensor import _GatherLinear
    from torch.distributed.device_mesh import init_device_mesh

    dev = torch.device("cuda", torch.cuda.current_device())
    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("tp",))
    hal.reset_stats()
    errors: dict[str, float] = {}
    failures: dict[str, str] = {}
    bounds = {torch.float32: 1e-2, torch.bfloat16: 5e-2}  # TF32 GEMMs; bfloat16

    def model(kind: str, dtype: torch.dtype, sp: bool) -> None:
        ref, par, loss = _hal_decoder(torch.float64, seed) if kind == "hal" else _hf_llama(torch.float64, seed, 2, "sdpa")
        g = torch.Generator().manual_seed(seed + 1)
        tokens, targets = torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g)
        want = loss(ref, tokens, targets)
        want.backward()
        par = parallelize(par.float().to(dev), mesh, sequence_parallel=sp, overlap=sp)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            got = loss(par, tokens.to(dev), targets.to(dev))
        got.backward()
        key = f"{kind} {str(dtype)[6:]} sp={sp}"
        errors[key + " loss"] = _rel(got, want)
        ref_params = dict(ref.named_parameters())
        errors[key + " grads"] = max(_rel(p.grad, ref_params[name].grad) for name, p in par.named_parameters())
        assert errors[key + " loss"] < bounds[dtype] and errors[key + " grads"] < bounds[dtype] * 4, errors

    def overlap_chunks() -> None:
        """The chunked all-gather + GEMM (side stream on the GPU) on a group of one against F.linear."""
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(2, 12, 16, generator=g, dtype=torch.float64)
        w1, w2 = torch.randn(24, 16, generator=g, dtype=torch.float64) / 4, torch.randn(8, 16, generator=g, dtype=torch.float64) / 4
        b1 = torch.randn(24, generator=g, dtype=torch.float64)
        ts = [t.clone().requires_grad_(True) for t in (x, w1, w2, b1)]
        y1, y2 = F.gelu(F.linear(ts[0], ts[1], ts[3])), F.linear(ts[0], ts[2])
        (y1.sum() + (y2 * y2).sum()).backward()
        cs = [t.detach().float().to(dev).requires_grad_(True) for t in (x, w1, w2, b1)]
        z1, z2 = _GatherLinear.apply(cs[0], 1, mesh.get_group(), 3, ("gelu", "none"), cs[1], cs[2], cs[3], None)
        (z1.sum() + (z2 * z2).sum()).backward()
        torch.cuda.synchronize()
        errors["overlap outputs"] = max(_rel(z1, y1), _rel(z2, y2))
        errors["overlap grads"] = max(_rel(c.grad, t.grad) for c, t in zip(cs, ts))
        assert errors["overlap outputs"] < 1e-2 and errors["overlap grads"] < 1e-2, errors

    cases = [("overlap", overlap_chunks)]
    for kind in ("hal", "hf"):
        for dtype in (torch.float32, torch.bfloat16):
            for sp in (False, True):
                cases.append((f"{kind} {dtype} sp={sp}", (lambda k=kind, d=dtype, s=sp: model(k, d, s))))
    for name, fn in cases:
        try:
            fn()
        except Exception:  # reported per check
            failures[name] = traceback.format_exc()
    ran = sorted({(op, backend) for (op, backend, _kernel), c in hal.stats().items() if c["calls"]})
    return {"failures": failures, "errors": errors, "ran": ran}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the H200)")
def test_cuda_local_compute_runs_on_hal_cuda_kernels(seed: int) -> None:
    (result,) = launch(_cuda_checks, 1, (seed,), backend="nccl", timeout_s=280)
    assert result.ok, f"{result.message}\n{result.traceback}"
    value = result.value
    print("errors against float64 on the CPU:", value["errors"])
    print("hal ops run (op, backend):", value["ran"])
    assert not value["failures"], "\n".join(f"{k}:\n{v}" for k, v in value["failures"].items())
    off_gpu = [(op, backend) for op, backend in value["ran"] if backend != "cuda"]
    assert not off_gpu, f"hal ops that ran off the cuda backend: {off_gpu}"
