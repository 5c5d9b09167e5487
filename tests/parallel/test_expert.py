"""hal.parallel.expert on real gloo groups: the expert-parallel MoE layer against all experts on one process.

Each rank routes its own tokens (a different number per rank). Every rank also runs the one-process
layer (``group=None``, the same seed, so the same weights) on the concatenation of its expert-parallel
group's tokens and compares: the output rows of its tokens, the auxiliary loss (its mean over the
group), the input gradient, the expert and router gradients (the router's summed over the ranks, as
data parallelism does), and the weights after 3 SGD steps. Dropless and capacity modes, with and
without the chunked overlap, float64 to rounding, float32 and bfloat16 within tolerances; on 2 and 4
ranks, with a custom placement, and on a 2 x 2 mesh (expert parallelism inside each data-parallel
replica). The one-process layer is itself checked against a loop over experts in plain torch.
"""

from __future__ import annotations

import math
import time
import traceback
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F

import hal
from hal.dist.launch import launch
from hal.parallel.expert import ExpertParallelMoE, moe_aux_loss

#: numba's parallel kernels (hal's CPU backend) in every rank would oversubscribe the cores: one thread each
ONE_THREAD = {"NUMBA_NUM_THREADS": "1"}

pytestmark = pytest.mark.timeout(240)

DIM, FFN, TOP_K, LR, AUX = 8, 12, 2, 0.05, 0.1
TOL = {torch.float64: (1e-10, 1e-10), torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2)}


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """Equal within the dtype's tolerance; bfloat16's absolute part scales with the tensor's largest
    value (a sum of bfloat16 products is as exact as its largest terms)."""
    rtol, atol = TOL[dtype]
    if dtype == torch.bfloat16:
        atol = atol * max(1.0, float(want.detach().abs().max()))
    torch.testing.assert_close(got.detach(), want.detach().to(got.dtype), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _tokens(rank: int) -> int:
    return 5 + 3 * rank  # uneven on purpose


def _draw(seed: int, tag: str, step: int, rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + sum(map(ord, tag)) * 10_007 + step * 101 + rank)
    t = torch.randn(shape, generator=g, dtype=torch.float64)
    return torch.where(t == 0, torch.full_like(t, 0.5), t).to(dtype)


def naive_moe(x: torch.Tensor, layer: ExpertParallelMoE) -> tuple[torch.Tensor, torch.Tensor]:
    """A loop over experts in plain torch (the layer holding all experts): (output, aux loss)."""
    t, e_count, k = x.shape[0], layer.num_experts, layer.top_k
    rdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    probs = torch.softmax(x.to(rdt) @ layer.router.to(rdt).T, -1)
    w, e = probs.topk(k, -1)
    w = w / w.sum(-1, keepdim=True)
    keep = torch.ones(t, k, dtype=torch.bool)
    if layer.capacity_factor is not None:
        cap, used = math.ceil(layer.capacity_factor * t * k / e_count), [0] * e_count
        for s in range(k):
            for i in range(t):
                keep[i, s] = used[int(e[i, s])] < cap
                used[int(e[i, s])] += 1
    out = torch.zeros_like(x)
    for ex in range(e_count):
        sel = [(i, s) for i in range(t) for s in range(k) if int(e[i, s]) == ex and keep[i, s]]
        if sel:
            ts, ss = torch.tensor([i for i, _ in sel]), torch.tensor([s for _, s in sel])
            g, u = (x[ts] @ layer.w_gate_up[ex]).chunk(2, -1)
            h = (F.silu(g.to(rdt)) * u.to(rdt)).to(x.dtype) @ layer.w_down[ex]
            out = out.index_add(0, ts, h * w[ts, ss, None].to(x.dtype))
    share = torch.bincount(e.reshape(-1), minlength=e_count).to(rdt) / (t * k)
    return out, e_count * (share * probs.mean(0)).sum()


@pytest.mark.parametrize("capacity_factor", [None, 1.0, 0.5])
def test_one_process_layer_matches_a_loop_over_experts(capacity_factor: Optional[float], seed: int) -> None:
    layer = ExpertParallelMoE(DIM, FFN, 4, TOP_K, capacity_factor=capacity_factor, seed=seed % 1000, dtype=torch.float64)
    x = _draw(seed, "naive", 0, 0, (23, DIM), torch.float64).requires_grad_(True)
    y = layer(x)
    ref, aux = naive_moe(x, layer)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.aux_loss, aux, rtol=1e-12, atol=1e-12)
    params = [x, layer.router, layer.w_gate_up, layer.w_down]
    got = torch.autograd.grad((y * y).sum() + layer.aux_loss, params)
    want = torch.autograd.grad((ref * ref).sum() + aux, params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    if capacity_factor == 0.5:
        assert layer.stats["dropped"] > 0, layer.stats


def test_aux_loss_coef_adds_the_aux_gradient_itself(seed: int) -> None:
    """With aux_loss_coef the backward of the output alone carries coef * aux_loss's gradient."""
    attached = ExpertParallelMoE(DIM, FFN, 4, aux_loss_coef=0.3, seed=seed % 1000, dtype=torch.float64)
    plain = ExpertParallelMoE(DIM, FFN, 4, seed=seed % 1000, dtype=torch.float64)
    x = _draw(seed, "attach", 0, 0, (17, DIM), torch.float64)
    got = torch.autograd.grad(attached(x).sum(), [attached.router, attached.w_gate_up])
    want = torch.autograd.grad(plain(x).sum() + 0.3 * plain.aux_loss, [plain.router, plain.w_gate_up])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)


def test_bad_arguments_say_what_to_do() -> None:
    with pytest.raises(hal.InvalidArgumentError, match="placement"):
        ExpertParallelMoE(DIM, FFN, 4, placement=[0, 0, 1])
    with pytest.raises(hal.InvalidArgumentError, match="top_k"):
        ExpertParallelMoE(DIM, FFN, 2, top_k=3)
    with pytest.raises(hal.InvalidArgumentError, match="dropless"):
        ExpertParallelMoE(DIM, FFN, 4, capacity_factor=0)
    layer = ExpertParallelMoE(DIM, FFN, 4)
    with pytest.raises(hal.InvalidArgumentError, match="dim=8"):
        layer(torch.randn(3, DIM + 1))
    with pytest.raises(hal.InvalidArgumentError, match="forward"):
        moe_aux_loss(torch.nn.Sequential(ExpertParallelMoE(DIM, FFN, 4)))


# --- distributed checks ---------------------------------------------------------------------------


def _check(
    rank: int, seed: int, dtype: torch.dtype, capacity: Optional[float], chunks: int, *,
    ep_ranks: list[int], replicas: list[list[int]], group: Any, dp_group: Any = None, placement: Optional[list[int]] = None,
) -> None:
    """One configuration: 3 steps of the expert-parallel layer against the one-process layer.

    ``ep_ranks``: the global ranks of this rank's expert-parallel group (group order); ``replicas``:
    every expert-parallel group (the data-parallel replicas), each a list of global ranks. In
    bfloat16 the reference restarts each step from the expert-parallel layer's weights: two
    trajectories one rounding apart may route a token differently after a few steps."""
    n_ep = len(ep_ranks)
    experts = 2 * n_ep
    pseed = seed % 1000
    layer = ExpertParallelMoE(DIM, FFN, experts, TOP_K, group=group, placement=placement, capacity_factor=capacity,
                              overlap_chunks=chunks, seed=pseed, dtype=dtype)
    ref = ExpertParallelMoE(DIM, FFN, experts, TOP_K, capacity_factor=capacity, seed=pseed, dtype=dtype)
    torch.testing.assert_close(layer.w_down.detach(), ref.w_down.detach()[layer.expert_ids], rtol=0, atol=0)
    opt, ref_opt = torch.optim.SGD(layer.parameters(), lr=LR), torch.optim.SGD(ref.parameters(), lr=LR)
    mine = ep_ranks.index(rank)
    for step in range(3):
        if dtype == torch.bfloat16 and step:
            _restart_from(ref, layer)
        xs = {r: _draw(seed, "x", step, r, (_tokens(r), DIM), dtype) for rs in replicas for r in rs}
        probes = {r: _draw(seed, "p", step, r, (_tokens(r), DIM), torch.float32) for r in xs}
        x = xs[rank].clone().requires_grad_(True)
        y = layer(x)
        ((y.float() * probes[rank]).sum() + AUX * layer.aux_loss.float()).backward()
        for p in layer.replicated_parameters():  # data parallelism's job: sum the router's gradient everywhere
            hal.dist.all_reduce(p.grad)
        if dp_group is not None:  # expert replicas across data-parallel groups
            for p in layer.expert_parameters():
                hal.dist.all_reduce(p.grad, group=dp_group)
        aux_mean = hal.dist.all_reduce(layer.aux_loss.detach().clone(), group=layer.group) / n_ep

        ref_loss, mine_y, xin, mine_aux = 0.0, None, None, None
        for rs in replicas:
            xr = torch.cat([xs[r] for r in rs]).requires_grad_(True)
            yr = ref(xr)
            ref_loss = ref_loss + (yr.float() * torch.cat([probes[r] for r in rs])).sum() + AUX * len(rs) * ref.aux_loss.float()
            if rs == ep_ranks:
                xin, mine_y, mine_aux = xr, yr, ref.aux_loss.detach()
        ref_loss.backward()
        start = sum(_tokens(r) for r in ep_ranks[:mine])
        rows = slice(start, start + _tokens(rank))
        ids = layer.expert_ids
        _close(y, mine_y[rows], dtype, f"step {step} output")
        _close(aux_mean, mine_aux, dtype, f"step {step} aux loss")
        _close(x.grad, xin.grad[rows], dtype, f"step {step} input grad")
        _close(layer.w_gate_up.grad, ref.w_gate_up.grad[ids], dtype, f"step {step} w_gate_up grad")
        _close(layer.w_down.grad, ref.w_down.grad[ids], dtype, f"step {step} w_down grad")
        _close(layer.router.grad, ref.router.grad, dtype, f"step {step} router grad")
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    _close(layer.w_gate_up, ref.w_gate_up[layer.expert_ids], dtype, "after 3 steps, w_gate_up")
    _close(layer.w_down, ref.w_down[layer.expert_ids], dtype, "after 3 steps, w_down")
    _close(layer.router, ref.router, dtype, "after 3 steps, router")
    if capacity == 0.5:
        assert layer.stats["dropped"] > 0, f"capacity 0.5 dropped nothing: {layer.stats}"


@torch.no_grad()
def _restart_from(ref: ExpertParallelMoE, layer: ExpertParallelMoE) -> None:
    """Copy the expert-parallel layer's weights (every rank's experts) into the one-process layer."""
    ids = torch.tensor(hal.dist.all_gather(torch.tensor([layer.expert_ids]), group=layer.group).reshape(-1).tolist())
    for name in ("w_gate_up", "w_down"):
        mine = getattr(layer, name).detach()
        gathered = hal.dist.all_gather(mine.reshape(1, -1), group=layer.group).reshape(-1, *mine.shape[1:])
        getattr(ref, name)[ids] = gathered
    ref.router.copy_(layer.router)


CONFIGS = [  # (name, dtype, capacity_factor, overlap chunks)
    ("f64_dropless", torch.float64, None, 1),
    ("f64_capacity", torch.float64, 0.5, 1),
    ("f64_dropless_overlap", torch.float64, None, 3),
    ("f64_capacity_overlap", torch.float64, 1.0, 2),
    ("f32_dropless", torch.float32, None, 1),
    ("f32_capacity_overlap", torch.float32, 1.0, 3),
    ("bf16_dropless_overlap", torch.bfloat16, None, 2),
    ("bf16_capacity", torch.bfloat16, 1.0, 1),
]


def _run_checks(rank: int, n: int, seed: int, mesh: bool) -> dict[str, tuple[str, float]]:
    import torch.distributed as dist

    world = list(range(n))
    todo: list[tuple[str, Any]] = []
    for name, dtype, cap, chunks in CONFIGS:
        todo.append((name, lambda d=dtype, c=cap, k=chunks: _check(rank, seed, d, c, k, ep_ranks=world, replicas=[world], group=dist.group.WORLD)))
    if n == 4:  # experts dealt round-robin, and a rank that owns three experts while another owns one
        todo.append(("f64_round_robin", lambda: _check(rank, seed, torch.float64, 1.0, 2, ep_ranks=world, replicas=[world],
                                                         group=dist.group.WORLD, placement=[0, 1, 2, 3, 0, 1, 2, 3])))
        todo.append(("f64_uneven_placement", lambda: _check(rank, seed, torch.float64, None, 1, ep_ranks=world, replicas=[world],
                                                              group=dist.group.WORLD, placement=[3, 0, 0, 1, 2, 0, 1, 2])))
    if mesh:
        from torch.distributed.device_mesh import init_device_mesh

        m = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
        replicas = [[0, 1], [2, 3]]
        mine = replicas[rank // 2]
        for name, dtype, cap, chunks in [("mesh_f64_capacity_overlap", torch.float64, 1.0, 2), ("mesh_f32_dropless", torch.float32, None, 1)]:
            todo.append((name, lambda d=dtype, c=cap, k=chunks: _check(rank, seed, d, c, k, ep_ranks=mine, replicas=replicas,
                                                                      group=m["ep"], dp_group=m.get_group("dp"))))
    out = {}
    for name, fn in todo:
        started = time.monotonic()
        try:
            fn()
            error = ""
        except Exception:
            error = traceback.format_exc()
        out[name] = (error, time.monotonic() - started)
    return out


Outcomes = dict[str, list[tuple[str, float]]]


def _launch(n: int, seed: int, mesh: bool) -> Outcomes:
    results = launch(_run_checks, n, (seed, mesh), timeout_s=200, env=ONE_THREAD)
    bad = [f"rank {r.rank}: {r.message}\n{r.traceback}" for r in results if not r.ok]
    assert not bad, f"HAL_TEST_SEED={seed}\n" + "\n".join(bad)
    return {name: [r.value[name] for r in results] for name in results[0].value}


@pytest.fixture(scope="module")
def two_ranks(seed: int) -> Outcomes:
    return _launch(2, seed, mesh=False)


@pytest.fixture(scope="module")
def four_ranks(seed: int) -> Outcomes:
    return _launch(4, seed, mesh=True)


def _passed(outcomes: Outcomes, name: str, seed: int) -> None:
    print(f"{name}: {max(s for _, s in outcomes[name]):.2f} s on the slowest rank")
    errors = [f"rank {r}:\n{e}" for r, (e, _) in enumerate(outcomes[name]) if e]
    assert not errors, f"{name} failed (HAL_TEST_SEED={seed}):\n" + "\n".join(errors)


@pytest.mark.parametrize("name", [c[0] for c in CONFIGS])
def test_two_ranks_match_one_process(two_ranks: Outcomes, name: str, seed: int) -> None:
    _passed(two_ranks, name, seed)


@pytest.mark.parametrize("name", [c[0] for c in CONFIGS] + ["f64_round_robin", "f64_uneven_placement",
                                                             "mesh_f64_capacity_overlap", "mesh_f32_dropless"])
def test_four_ranks_and_a_2x2_mesh_match_one_process(four_ranks: Outcomes, name: str, seed: int) -> None:
    _passed(four_ranks, name, seed)
