"""What hal.parallel's agreement checks cost in a tensor-parallel training step on gloo (CPU ranks).

    python benchmarks/parallel_checks.py [--ranks 2] [--threads 4] [--rounds 6] [--size medium]

The model is hal's benchmark Llama decoder (``bench/models_llama.py``) parallelized over all ranks
(``hal.parallel.parallelize``: q/k/v and gate/up column-parallel, o and down row-parallel), with a
:class:`~hal.parallel.VocabParallelEmbedding` and a :class:`~hal.parallel.VocabParallelLMHead` +
loss, and AdamW: one step is forward, backward and the optimizer step, float32. Rounds alternate
the checks on and off (``hal.parallel.set_checks``) so that drift in the machine's load hits both
alike; the script prints the median step of each, the checked calls per step, the median cost of
one check alone, and the overhead. Not a test (it asserts nothing): the figures go in
docs/parallel.md ("Agreement checks").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # ``bench`` (the benchmark models) and ``hal`` from this checkout, in every rank too
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

SIZES = {  # (vocab, dim, layers, heads, ffn, seq, batch)
    "small": (4096, 256, 2, 8, 704, 128, 4),
    "medium": (8192, 512, 4, 8, 1408, 256, 4),
}


def _rank(rank: int, n: int, size: str, rounds: int, steps: int, sequence_parallel: bool) -> dict[str, Any]:
    import torch.distributed as dist

    import hal
    import hal.parallel
    from bench.models_llama import OPS, Decoder, LlamaConfig
    from hal.parallel import checks

    vocab, dim, layers, heads, ffn, seq, batch = SIZES[size]
    cfg = LlamaConfig(vocab=vocab, dim=dim, layers=layers, heads=heads, ffn=ffn, seq=seq, batch=batch)
    torch.manual_seed(0)
    model = Decoder(cfg, OPS["hal"]())
    model = hal.parallel.parallelize(model, dist.group.WORLD, sequence_parallel=sequence_parallel)
    embed = hal.parallel.VocabParallelEmbedding.from_embedding(model.embed)
    head = hal.parallel.VocabParallelLMHead.from_linear(model.lm_head)
    params = [p for name, p in model.named_parameters() if not name.startswith(("embed", "lm_head"))]
    opt = torch.optim.AdamW(params + list(embed.parameters()) + list(head.parameters()), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    targets = torch.randint(0, vocab, (batch, seq), generator=g)
    calls = [0]
    agree = checks.agree

    def counted(*args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        agree(*args, **kwargs)

    checks.agree = counted

    def step() -> None:  # the first and last blocks split and gather the sequence under sequence parallelism
        x = embed(tokens)
        for blk in model.blocks:
            x = blk(x, model.cos[:seq], model.sin[:seq])
        loss = head(hal.ops.rms_norm(x, (dim,), model.norm, model.eps), targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def timed(on: bool) -> float:
        hal.parallel.set_checks(on)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        dist.barrier()
        return (time.perf_counter() - start) / steps

    timed(True), timed(False)  # warm: decisions, workspaces
    calls[0] = 0
    hal.parallel.set_checks(True)
    step()
    per_step = calls[0]
    on, off = [], []
    for _ in range(rounds):
        on.append(timed(True))
        off.append(timed(False))
    hal.parallel.set_checks(True)
    probe = torch.ones(batch, seq, dim)
    one = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(50):
            agree("copy_to_parallel", None, probe.device, [("x", probe)])
        one.append((time.perf_counter() - start) / 50)
    return {"on_s": statistics.median(on), "off_s": statistics.median(off), "checks_per_step": per_step,
            "one_check_s": statistics.median(one), "on_all": on, "off_all": off}


def main() -> None:
    from hal.dist.launch import launch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads", type=int, default=4, help="torch threads per rank")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3, help="steps per round")
    parser.add_argument("--size", choices=sorted(SIZES), default="medium")
    parser.add_argument("--sequence-parallel", action="store_true")
    a = parser.parse_args()
    results = launch(_rank, a.ranks, (a.size, a.rounds, a.steps, a.sequence_parallel), threads=a.threads, timeout_s=580,
                     env={"NUMBA_NUM_THREADS": str(a.threads)})
    bad = [f"rank {r.rank}: {r.message}\n{r.traceback}" for r in results if not r.ok]
    if bad:
        raise SystemExit("\n".join(bad))
    r = results[0].value
    extra = r["on_s"] - r["off_s"]
    print(f"{a.ranks} gloo ranks x {a.threads} threads, size {a.size} {SIZES[a.size]}, sequence_parallel={a.sequence_parallel}, "
          f"torch {torch.__version__}")
    print(f"step with checks {r['on_s'] * 1e3:.1f} ms, without {r['off_s'] * 1e3:.1f} ms (medians of {a.rounds} rounds of {a.steps}); "
          f"difference {extra * 1e3:+.2f} ms = {100 * extra / r['off_s']:+.2f} %")
    print(f"{r['checks_per_step']} checked calls per step; one check alone {r['one_check_s'] * 1e6:.0f} us -> "
          f"{r['checks_per_step'] * r['one_check_s'] * 1e3:.2f} ms = {100 * r['checks_per_step'] * r['one_check_s'] / r['off_s']:.2f} % of the step")
    print("rounds on:", " ".join(f"{t * 1e3:.1f}" for t in r["on_all"]), "| off:", " ".join(f"{t * 1e3:.1f}" for t in r["off_all"]))


if __name__ == "__main__":
    main()
