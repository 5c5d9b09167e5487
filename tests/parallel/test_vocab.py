"""hal.parallel.vocab on real gloo groups: the vocabulary-parallel embedding and LM head + loss against one process.

Every rank draws the whole problem from the seed (the full table, the rows, the targets), computes
the single-process result with torch's own ops (``F.embedding``, ``F.linear`` + ``F.cross_entropy``),
and compares its loss and its slice of the gradients. On the 2 x 2 mesh the vocabulary is split
over the "tp" dimension and each "dp" replica draws its own data. The memory check measures the
peak of the CPU allocator (:class:`hal.parallel.memory.PeakMemory`) over a forward and backward.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable, Optional

import pytest
import torch
import torch.nn.functional as F

from hal.dist.launch import launch

pytestmark = pytest.mark.timeout(240)

TOL = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=2e-5, atol=2e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-3)}


def _group(n: int, mesh: Optional[tuple[int, int]]) -> tuple[Any, int]:
    """(the tensor-parallel group, the data-parallel replica index)."""
    if mesh is None:
        return None, 0
    from torch.distributed.device_mesh import init_device_mesh

    m = init_device_mesh("cpu", mesh, mesh_dim_names=("dp", "tp"))
    return m.get_group("tp"), m.get_local_rank("dp")


def _problem(seed: int, n_rows: int, k: int, vocab: int, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, vocab, (n_rows,), generator=g)
    t[torch.randperm(n_rows, generator=g)[: n_rows // 5]] = -100  # ignored rows
    return {
        "x": (torch.randn(n_rows, k, generator=g, dtype=torch.float64) + 0.25).to(dtype),
        "w": (torch.randn(vocab, k, generator=g, dtype=torch.float64) * 0.5).to(dtype),
        "b": (torch.randn(vocab, generator=g, dtype=torch.float64) * 0.1).to(dtype),
        "t": t,
    }


def _reference(p: dict[str, torch.Tensor], bias: bool, reduction: str, eps: float, autocast: bool = False) -> tuple:
    """Loss and gradients (x, W, b) on one process, with torch's ops."""
    x, w, b = (p[k].clone().requires_grad_(True) for k in ("x", "w", "b"))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = F.linear(x, w, b if bias else None)
    loss = F.cross_entropy(logits.float() if autocast else logits, p["t"], ignore_index=-100, label_smoothing=eps, reduction=reduction)
    weight = torch.linspace(0.5, 1.5, loss.numel(), dtype=loss.dtype).reshape(loss.shape)
    (loss * weight).sum().backward()
    return loss.detach(), x.grad, w.grad, b.grad if bias else None, weight


def _checks(rank: int, n: int, seed: int, mesh: Optional[tuple[int, int]]) -> dict[str, str]:
    import hal
    from hal.parallel import checkpoint as ck
    from hal.parallel import comm
    from hal.parallel.memory import PeakMemory
    from hal.parallel.vocab import VocabParallelEmbedding, VocabParallelLMHead, vocab_parallel_linear_cross_entropy, vocab_slice

    group, replica = _group(n, mesh)
    tp, tp_rank = comm.group_size(group), comm.group_rank(group)
    failures: dict[str, str] = {}

    def case(name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            failures[name] = traceback.format_exc()

    def shard(full: torch.Tensor, vocab: int) -> torch.Tensor:
        start, per_rank, real = vocab_slice(vocab, group)
        out = full.new_zeros((per_rank, *full.shape[1:]))
        out[:real] = full[start : start + real]
        return out

    def loss_and_grads(dtype: torch.dtype, reduction: str, eps: float, bias: bool, vocab: int, chunk: Optional[int] = 7) -> None:
        p = _problem(seed * 31 + replica, 45, 12, vocab, dtype)
        want, gx, gw, gb, weight = _reference(p, bias, reduction, eps)
        x = p["x"].clone().requires_grad_(True)
        w = shard(p["w"], vocab).requires_grad_(True)
        b = shard(p["b"], vocab).requires_grad_(True) if bias else None
        loss = vocab_parallel_linear_cross_entropy(x, w, p["t"], group, vocab_size=vocab, bias_shard=b, label_smoothing=eps,
                                                   reduction=reduction, chunk_rows=chunk)
        assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32), loss.dtype
        (loss * weight.to(loss.dtype)).sum().backward()
        tol = TOL[dtype]
        torch.testing.assert_close(loss, want.to(loss.dtype), **tol)
        torch.testing.assert_close(x.grad, gx, **tol)
        torch.testing.assert_close(w.grad, shard(gw, vocab), **tol)
        if bias:
            torch.testing.assert_close(b.grad, shard(gb, vocab), **tol)

    def float64_cases() -> None:
        for reduction, eps, bias, vocab, chunk in [("mean", 0.0, False, 16 * tp, 7), ("sum", 0.1, True, 16 * tp - 3, None),
                                                   ("none", 0.2, True, 11 * tp + 1, 45), ("mean", 0.1, True, 9 * tp - 1, 1)]:
            loss_and_grads(torch.float64, reduction, eps, bias, vocab, chunk)

    def float32_cases() -> None:
        loss_and_grads(torch.float32, "mean", 0.1, True, 16 * tp - 1)
        loss_and_grads(torch.float32, "none", 0.0, False, 16 * tp)

    def bf16_autocast() -> None:
        vocab = 24 * tp - 5
        p = _problem(seed * 37 + replica, 40, 16, vocab, torch.float32)
        want, gx, gw, gb, weight = _reference(p, True, "mean", 0.1, autocast=True)
        x = p["x"].clone().requires_grad_(True)
        w, b = shard(p["w"], vocab).requires_grad_(True), shard(p["b"], vocab).requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = vocab_parallel_linear_cross_entropy(x, w, p["t"], group, vocab_size=vocab, bias_shard=b, label_smoothing=0.1)
        assert loss.dtype == torch.float32
        (loss * weight).sum().backward()
        assert x.grad.dtype == w.grad.dtype == torch.float32
        torch.testing.assert_close(loss, want, rtol=1e-2, atol=1e-3)
        for got, ref in [(x.grad, gx), (w.grad, shard(gw, vocab)), (b.grad, shard(gb, vocab))]:
            torch.testing.assert_close(got, ref, rtol=3e-2, atol=3e-3 * float(ref.abs().max()))

    def sequence_parallel() -> None:
        vocab = 10 * tp + 3
        p = _problem(seed * 41 + replica, 12 * tp, 8, vocab)
        want, gx, gw, _, weight = _reference(p, False, "none", 0.0)
        rows = slice(tp_rank * 12, (tp_rank + 1) * 12)
        x = p["x"][rows].clone().requires_grad_(True)
        w = shard(p["w"], vocab).requires_grad_(True)
        loss = vocab_parallel_linear_cross_entropy(x, w, p["t"][rows], group, vocab_size=vocab, reduction="none", sequence_parallel=True)
        (loss * weight[rows]).sum().backward()
        torch.testing.assert_close(loss, want[rows], **TOL[torch.float64])
        torch.testing.assert_close(x.grad, gx[rows], **TOL[torch.float64])
        torch.testing.assert_close(w.grad, shard(gw, vocab), **TOL[torch.float64])

    def embedding() -> None:
        vocab, dim = 13 * tp - 2, 6
        g = torch.Generator().manual_seed(seed * 43 + replica)
        full = torch.nn.Embedding(vocab, dim, padding_idx=3, dtype=torch.float64)
        with torch.no_grad():
            full.weight.copy_(torch.randn(vocab, dim, generator=g, dtype=torch.float64))
        ids = torch.randint(0, vocab, (4, 2 * tp), generator=g)
        ids[0, 0] = 3
        up = torch.randn(4, 2 * tp, dim, generator=g, dtype=torch.float64)
        (full(ids) * up).sum().backward()
        for seq in (None, 1):
            emb = hal.parallel.VocabParallelEmbedding.from_embedding(full, group, sequence_dim=seq)
            assert isinstance(emb, VocabParallelEmbedding) and emb.weight.shape == (-(-vocab // tp), dim)
            y = emb(ids)
            want = full(ids).detach()
            mine = up
            if seq is not None:
                want, mine = want.chunk(tp, 1)[tp_rank], up.chunk(tp, 1)[tp_rank]
            torch.testing.assert_close(y, want, rtol=0, atol=0)
            (y * mine).sum().backward()
            torch.testing.assert_close(emb.weight.grad, shard(full.weight.grad, vocab), **TOL[torch.float64])

    def three_steps() -> None:
        """Embedding -> tanh -> LM head + loss, 3 SGD steps: the same losses and parameters as one process."""
        vocab, dim, rows = 12 * tp - 1, 10, 24
        g = torch.Generator().manual_seed(seed * 47 + replica)
        emb, head = torch.nn.Embedding(vocab, dim, dtype=torch.float64), torch.nn.Linear(dim, vocab, bias=True, dtype=torch.float64)
        with torch.no_grad():
            for prm in (*emb.parameters(), *head.parameters()):
                prm.copy_(torch.randn(prm.shape, generator=g, dtype=torch.float64) * 0.3)
        p_emb = VocabParallelEmbedding.from_embedding(emb, group)
        p_head = VocabParallelLMHead.from_linear(head, group, label_smoothing=0.05)
        opt = torch.optim.SGD([*emb.parameters(), *head.parameters()], lr=0.5, momentum=0.9)
        p_opt = torch.optim.SGD([*p_emb.parameters(), *p_head.parameters()], lr=0.5, momentum=0.9)
        for _ in range(3):
            ids = torch.randint(0, vocab, (2, rows // 2), generator=g)
            target = torch.randint(0, vocab, (2, rows // 2), generator=g)
            want = F.cross_entropy(head(torch.tanh(emb(ids))).reshape(rows, vocab), target.reshape(-1), label_smoothing=0.05)
            got = p_head(torch.tanh(p_emb(ids)), target)
            torch.testing.assert_close(got, want.detach(), **TOL[torch.float64])
            for o, loss in ((opt, want), (p_opt, got)):
                o.zero_grad()
                loss.backward()
                o.step()
        torch.testing.assert_close(p_emb.weight, shard(emb.weight.detach(), vocab), **TOL[torch.float64])
        torch.testing.assert_close(p_head.weight, shard(head.weight.detach(), vocab), **TOL[torch.float64])
        torch.testing.assert_close(p_head.bias, shard(head.bias.detach(), vocab), **TOL[torch.float64])

    def head_logits() -> None:
        vocab = 7 * tp - 1
        p = _problem(seed * 53 + replica, 6, 5, vocab)
        head = torch.nn.Linear(5, vocab, dtype=torch.float64)
        ph = VocabParallelLMHead.from_linear(head, group)
        want = head(p["x"]).detach()
        torch.testing.assert_close(ph(p["x"], gather=True), want, **TOL[torch.float64])
        start, _, real = vocab_slice(vocab, group)
        torch.testing.assert_close(ph(p["x"])[:, :real], want[:, start : start + real], **TOL[torch.float64])

    def memory() -> None:
        """No rank allocates its share of the logits (rows x per_rank float32), forward and backward
        together; the single-process loss over the whole vocabulary allocates more than all of it."""
        rows, k, per_rank = 1024, 16, 512
        vocab = per_rank * tp
        p = _problem(seed * 59 + replica, rows, k, vocab, torch.float32)
        share = rows * per_rank * 4
        x = p["x"].clone().requires_grad_(True)
        w = shard(p["w"], vocab).requires_grad_(True)
        vocab_parallel_linear_cross_entropy(x, w, p["t"], group).backward()  # warm: decisions, workspaces
        x.grad = w.grad = None
        with PeakMemory("cpu") as peak:
            vocab_parallel_linear_cross_entropy(x, w, p["t"], group).backward()
        assert peak.events > 0, "the profiler reported no allocation"
        assert peak.bytes < share, f"peak {peak.bytes} B >= one rank's share of the logits {share} B"
        assert peak.bytes < share / 2, f"peak {peak.bytes} B: more than half the share {share} B"
        # under selective activation checkpointing too: the chunks' GEMM outputs are not kept
        with PeakMemory("cpu") as selective:
            ck.checkpoint(lambda a, b: vocab_parallel_linear_cross_entropy(a, b, p["t"], group), x, w, policy="selective").backward()
        assert selective.bytes < share / 2, f"selective checkpointing: peak {selective.bytes} B, the share is {share} B"
        if tp_rank == 0:
            xf, wf = p["x"].clone().requires_grad_(True), p["w"].clone().requires_grad_(True)
            with PeakMemory("cpu") as full:
                F.cross_entropy(F.linear(xf, wf), p["t"]).backward()
            assert full.bytes >= tp * share, f"whole-vocabulary loss peaked at {full.bytes} B, below the logits' {tp * share} B"

    def errors() -> None:
        from hal.errors import InvalidArgumentError

        x, w = torch.randn(4, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
        for kwargs, fragment in [({"target": torch.zeros(3, dtype=torch.long)}, "target"),
                                 ({"target": torch.zeros(4, dtype=torch.long), "reduction": "avg"}, "reduction"),
                                 ({"target": torch.zeros(4, dtype=torch.long), "vocab_size": 5 * tp + 1}, "vocab_size")]:
            try:
                vocab_parallel_linear_cross_entropy(x, w, group=group, **kwargs)
            except InvalidArgumentError as exc:
                assert fragment in str(exc), str(exc)
            else:
                raise AssertionError(f"no error for {kwargs}")

    for name, fn in [("float64", float64_cases), ("float32", float32_cases), ("bf16_autocast", bf16_autocast),
                     ("sequence_parallel", sequence_parallel), ("embedding", embedding), ("three_steps", three_steps),
                     ("head_logits", head_logits), ("memory", memory), ("errors", errors)]:
        case(name, fn)
    return failures


@pytest.mark.parametrize("n, mesh", [(2, None), (4, None), (4, (2, 2))], ids=["2", "4", "2x2"])
def test_vocab_parallel_matches_one_process(n: int, mesh: Optional[tuple[int, int]], seed: int) -> None:
    results = launch(_checks, n, (seed, mesh), timeout_s=200)
    bad = [f"rank {r.rank}: {r.message}\n{r.traceback}" for r in results if not r.ok]
    assert not bad, "\n".join(bad)
    failures = {f"rank {r.rank} {k}": v for r in results for k, v in r.value.items()}
    assert not failures, f"HAL_TEST_SEED={seed}\n" + "\n".join(f"{k}:\n{v}" for k, v in failures.items())
