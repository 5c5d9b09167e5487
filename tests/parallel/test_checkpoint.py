"""hal.parallel.checkpoint: every trainable hal op, hal.nn's modules and the parallel layers under
activation checkpointing (full and selective) give what they give without it, and running
statistics are written once per step.

Ops come from the registry (every op with a backward op) with the smallest float64 conformance
case of each, so an op added later is covered without editing this file. The parallel layers run
on a real gloo group of 2 ranks.
"""

from __future__ import annotations

import copy
import traceback
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import hal
from hal.dist.launch import launch
from hal.parallel import checkpoint as ck

pytestmark = pytest.mark.timeout(240)
POLICIES = ("full", "selective")
EXACT = dict(rtol=1e-12, atol=1e-12, equal_nan=True)


def _numel(args: dict[str, Any]) -> int:
    return sum(v.numel() for v in args.values() if isinstance(v, torch.Tensor))


def _smallest_case(op: str) -> dict[str, Any]:
    """The smallest float64 conformance case of ``op`` with nothing empty (in training for ops
    that write running statistics)."""
    from conformance.cases import cases_for, draw_call

    best = None
    for spec in cases_for(op, "float64"):
        args = draw_call(op, "float64", spec, 1234, "cpu").args
        tensors = [v for v in args.values() if isinstance(v, torch.Tensor)]
        if any(t.numel() == 0 for t in tensors) or args.get("training") is False:
            continue
        decl = hal.registry.get_op(op)
        if decl.mutates and any(args.get(m) is None for m in decl.mutates):
            continue
        if best is None or _numel(args) < _numel(best):
            best = args
    assert best is not None, f"{op}: no usable float64 conformance case"
    return best


def _trainable_ops() -> list[str]:
    return [d.name for d in hal.dispatch.list_ops() if d.backward and not d.forward]


def _run_op(op: str, args: dict[str, Any], how: str) -> tuple:
    """Output, gradients of every differentiable input and the written inputs after a backward."""
    decl = hal.registry.get_op(op)
    call = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    leaves = [n for n in decl.gradients if isinstance(call.get(n), torch.Tensor) and call[n].is_floating_point()]
    for n in leaves:
        call[n] = call[n].detach().requires_grad_(True)
    fn = getattr(hal.ops, op)

    def region(*tensors: torch.Tensor) -> torch.Tensor:
        out = fn(**dict(call, **dict(zip(leaves, tensors))))
        return out[0] if isinstance(out, tuple) else out

    written = [call[m] for m in decl.mutates if isinstance(call.get(m), torch.Tensor)]
    inputs = [call[n] for n in leaves]
    out = region(*inputs) if how == "none" else ck.checkpoint(region, *inputs, policy=how, state=written)
    g = torch.Generator().manual_seed(7)
    up = torch.randn(out.shape, generator=g, dtype=out.dtype)
    (out * up).sum().backward()
    return out.detach(), [t.grad for t in inputs], [w.clone() for w in written]


def test_every_trainable_op_under_checkpoint() -> None:
    ops = _trainable_ops()
    assert {"linear", "scaled_dot_product_attention", "fused_conv_bn_relu", "linear_cross_entropy", "rms_norm"} <= set(ops)
    failures = {}
    for op in ops:
        args = _smallest_case(op)
        want = _run_op(op, args, "none")
        for policy in POLICIES:
            try:
                got = _run_op(op, args, policy)
                torch.testing.assert_close(got[0], want[0], **EXACT)
                for a, b in zip(got[1], want[1]):
                    torch.testing.assert_close(a, b, **EXACT)
                for a, b in zip(got[2], want[2]):  # written once, as without checkpointing
                    torch.testing.assert_close(a, b, **EXACT)
            except Exception:
                failures[f"{op}/{policy}"] = traceback.format_exc()
    assert not failures, "\n".join(f"{k}:\n{v}" for k, v in failures.items())


class _ConvNet(nn.Module):
    def __init__(self, momentum: Any) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([
            hal.nn.FusedConvBNReLU2d(3, 6, 3, padding=1, momentum=momentum),
            hal.nn.FusedConvBN2d(6, 6, 3, padding=1, momentum=momentum),
            nn.Sequential(nn.Conv2d(6, 6, 1), nn.BatchNorm2d(6, momentum=momentum), nn.ReLU()),
        ])
        self.head = hal.nn.Linear(6, 5, act="gelu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean((2, 3)))


def _train(model: nn.Module, steps: int, seed: int, wrap: Callable[[nn.Module], None]) -> tuple[list[float], dict[str, torch.Tensor]]:
    wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 3, 6, 6, generator=g, dtype=torch.float64) + 0.5
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("momentum", [0.1, None])
def test_running_statistics_written_once(momentum: Any, seed: int) -> None:
    torch.manual_seed(seed)
    base = _ConvNet(momentum).double().train()
    want_losses, want = _train(copy.deepcopy(base), 3, seed, lambda m: None)
    for policy in POLICIES:
        model = copy.deepcopy(base)
        keys = list(model.state_dict())
        losses, got = _train(model, 3, seed, lambda m: ck.checkpoint_blocks(m, policy=policy))
        assert list(model.state_dict()) == keys, "checkpointing changed the state_dict keys"
        torch.testing.assert_close(losses, want_losses, **EXACT)
        for k in want:
            torch.testing.assert_close(got[k], want[k], **EXACT, msg=f"{policy}: {k}")
    # torch's checkpoint alone writes the statistics again in the recomputation (what this module mends)
    plain = copy.deepcopy(base)

    def torch_checkpoint(m: nn.Module) -> None:
        for b in m.blocks:
            inner = b.forward
            b.forward = lambda *a, inner=inner: torch.utils.checkpoint.checkpoint(inner, *a, use_reentrant=False)

    _, twice = _train(plain, 3, seed, torch_checkpoint)
    assert int(twice["blocks.0.1.num_batches_tracked"]) == 6 and int(want["blocks.0.1.num_batches_tracked"]) == 3


class _Count(TorchDispatchMode):
    """Counts the GEMM-like ops that run (the policy's EXPENSIVE_ATEN)."""

    def __init__(self) -> None:
        super().__init__()
        self.gemms = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if ck.saves(func):
            self.gemms += 1
        return func(*args, **(kwargs or {}))


def test_selective_policy_keeps_gemms_and_recomputes_the_rest(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    w1, w2 = (torch.randn(24, 24, generator=g, dtype=torch.float64).requires_grad_(True) for _ in range(2))
    q = torch.randn(2, 2, 8, 12, generator=g, dtype=torch.float64)

    def block(x: torch.Tensor) -> torch.Tensor:
        h = hal.ops.linear(hal.ops.rms_norm(x, (24,), None), w1, None, "gelu")
        a = hal.ops.scaled_dot_product_attention(q + h.reshape(2, 8, 2, 12).transpose(1, 2), q, q, is_causal=True)
        return hal.ops.linear(torch.tanh(h) + a.transpose(1, 2).reshape(2, 8, 24), w2)

    counts = {}
    for how in ("none", "full", "selective"):
        x = torch.randn(2, 8, 24, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).requires_grad_(True)
        y = block(x) if how == "none" else ck.checkpoint(block, x, policy=how)
        with _Count() as c:
            y.sum().backward()
        counts[how] = (c.gemms, x.grad)
    assert counts["full"][0] > counts["none"][0], counts
    assert counts["selective"][0] == counts["none"][0], f"selective recomputed a GEMM: {counts}"
    for how in ("full", "selective"):
        torch.testing.assert_close(counts[how][1], counts["none"][1], **EXACT)
    assert ck.saves(torch.ops.aten.mm.default) and not ck.saves(torch.ops.aten.gelu.default)
    assert ck.saves(torch.ops.hal.linear.default) and not ck.saves(torch.ops.hal.rms_norm.default)
    assert not ck.saves(torch.ops.aten.add_.Tensor)  # ops that write their inputs are recomputed
    policy = ck.selective_policy(["aten.gelu"])
    assert policy(None, torch.ops.aten.gelu.default) == torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE


def test_dropout_masks_replayed_with_undecided_ops(seed: int) -> None:
    """A region whose hal calls are not decided yet (a fresh shape): the recomputation draws the
    forward's dropout mask, so the gradient matches the output's mask."""
    g = torch.Generator().manual_seed(seed)
    k = 17 + seed % 13  # a shape no earlier call decided
    w = torch.randn(k + 3, k, generator=g, dtype=torch.float64)
    x = torch.randn(9, k, generator=g, dtype=torch.float64).requires_grad_(True)
    for policy in POLICIES:
        x.grad = None
        y = ck.checkpoint(lambda t: F.dropout(hal.ops.linear(t, w), 0.5, training=True), x, policy=policy)
        y.sum().backward()
        kept = (y != 0).to(torch.float64) * 2.0
        torch.testing.assert_close(x.grad, kept @ w, **EXACT)


def test_checkpoint_blocks_selection_and_removal() -> None:
    layers = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(4)]
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(*layers))
    holder = nn.Module()
    holder.stem, holder.layers = nn.Linear(4, 4), nn.ModuleList(layers[:3])
    assert ck.default_blocks(holder) == ["layers.0", "layers.1", "layers.2"]
    assert ck.default_blocks(model) == []
    chosen = ck.checkpoint_blocks(model, nn.Sequential, every=2)
    assert chosen == ["1"], chosen  # the outer Sequential covers its children
    assert ck.remove_checkpointing(model) == 1
    chosen = ck.checkpoint_blocks(model, lambda name, m: name.startswith("1.") and name.count(".") == 1, every=2)
    assert chosen == ["1.0", "1.2"], chosen
    x = torch.randn(3, 4, requires_grad=True)
    with torch.no_grad():
        model(x)  # no_grad: the blocks run plainly
    model(x).sum().backward()
    assert ck.remove_checkpointing(model) == 2 and "forward" not in layers[0].__dict__
    with pytest.raises(hal.InvalidArgumentError, match="policy"):
        ck.checkpoint_blocks(model, policy="some")
    assert not ck.is_recomputing()


# --- the parallel layers, on 2 ranks -------------------------------------------------------------


def _parallel_model(group: Any, seed: int) -> nn.Module:
    from hal.parallel import ParallelAttention, ParallelMLP, ParallelRMSNorm, VocabParallelEmbedding, VocabParallelLMHead

    torch.manual_seed(seed)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = ParallelRMSNorm(16, mesh=group, dtype=torch.float64)
            self.attn = ParallelAttention(16, 4, 2, mesh=group, dtype=torch.float64)
            self.mlp = ParallelMLP(16, 32, mesh=group, dtype=torch.float64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.norm(x))
            return x + F.dropout(self.mlp(x), 0.1, training=self.training)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = VocabParallelEmbedding(37, 16, group, dtype=torch.float64)
            self.layers = nn.ModuleList([Block() for _ in range(2)])
            self.head = VocabParallelLMHead(16, 37, group, dtype=torch.float64)

        def forward(self, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            x = self.embed(ids)
            for b in self.layers:
                x = b(x)
            return self.head(x, target)

    return Net()


def _parallel_checks(rank: int, n: int, seed: int) -> dict[str, str]:
    failures = {}
    base = _parallel_model(None, seed)
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randint(0, 37, (2, 6), generator=g), torch.randint(0, 37, (2, 6), generator=g)) for _ in range(3)]

    def train(model: nn.Module) -> tuple[list[float], list[torch.Tensor]]:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        torch.manual_seed(seed + 1)  # dropout: the same masks in every run
        losses = []
        for ids, target in data:
            loss = model(ids, target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, [p.detach().clone() for p in model.parameters()]

    want = train(copy.deepcopy(base))
    everything = ["embed", "layers.0", "layers.1", "head"]
    for policy, blocks in [("full", None), ("selective", None), ("selective", everything)]:
        try:
            model = copy.deepcopy(base)
            chosen = ck.checkpoint_blocks(model, blocks, policy=policy)
            assert chosen == (blocks or ["layers.0", "layers.1"]), chosen
            got = train(model)
            torch.testing.assert_close(got[0], want[0], **EXACT)
            for a, b in zip(got[1], want[1]):
                torch.testing.assert_close(a, b, **EXACT)
        except Exception:
            failures[f"{policy} {blocks or 'layers'}"] = traceback.format_exc()
    return failures


def test_parallel_layers_under_checkpoint(seed: int) -> None:
    results = launch(_parallel_checks, 2, (seed,), timeout_s=200)
    bad = [f"rank {r.rank}: {r.message}\n{r.traceback}" for r in results if not r.ok]
    assert not bad, "\n".join(bad)
    failures = {f"rank {r.rank} {k}": v for r in results for k, v in r.value.items()}
    assert not failures, f"HAL_TEST_SEED={seed}\n" + "\n".join(f"{k}:\n{v}" for k, v in failures.items())
