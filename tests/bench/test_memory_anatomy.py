"""hal_bench.memory_anatomy's replay of an allocation history (the device script,
benchmarks/memory_anatomy.py, needs CUDA: its runs are in benchmarks/results). Histories here are
drawn at random with a known answer: the peak is computed independently by brute force over every
prefix, and the blocks alive there by their lifetimes."""

from __future__ import annotations

import random

import pytest

from hal_bench.memory_anatomy import peak_anatomy, phase_of, site_of

HAL = {"filename": "/x/hal/nn/patch_hf.py", "line": 12, "name": "forward"}
TORCH = {"filename": "/x/site-packages/torch/nn/functional.py", "line": 3, "name": "linear"}
BACKWARD = {"filename": "/x/site-packages/torch/autograd/graph.py", "line": 8, "name": "_engine_run_backward"}
STEP = {"filename": "/x/hal/optim.py", "line": 40, "name": "step"}
SITES = [[TORCH, HAL], [HAL, BACKWARD], [TORCH, STEP], [{"filename": "/x/liger_kernel/ops/rms_norm.py", "line": 5, "name": "fwd"}]]


def test_site_and_phase_of_a_stack() -> None:
    assert site_of([TORCH, HAL]) == "nn/patch_hf.py:12 (forward)"  # the innermost frame outside torch
    assert site_of([TORCH]) == "nn/functional.py:3 (linear)" and site_of([]) == "(no stack)"
    assert phase_of([TORCH, HAL]) == "forward" and phase_of([HAL, BACKWARD]) == "backward"
    assert phase_of([TORCH, STEP, BACKWARD]) == "optimizer"
    # a benchmark's own step() around forward and backward marks nothing (the H100's anatomy at
    # 66d0b65 charged every activation to the optimizer through it); torch's optimizers do
    bench_step = {"filename": "/x/bench/models_hf.py", "line": 209, "name": "step"}
    hal_optimize = {"filename": "/x/hal/optimize/step.py", "line": 9, "name": "step"}
    assert phase_of([HAL, bench_step]) == "forward" and phase_of([BACKWARD, bench_step]) == "backward"
    assert phase_of([HAL, hal_optimize]) == "forward"
    assert phase_of([{"filename": "/x/site-packages/torch/optim/adamw.py", "line": 1, "name": "step"}, bench_step]) == "optimizer"


def _history(rng: random.Random, held: dict[int, int]) -> list[dict]:
    """Random allocs and frees (free_requested then free_completed, or free_completed alone), some of
    blocks held before the history; addresses are reused after a free."""
    events, alive, next_addr = [], {}, 1 << 20
    free_addrs: list[int] = []
    held = dict(held)
    for _ in range(rng.randint(20, 200)):
        if alive and rng.random() < 0.45 or (not alive and held and rng.random() < 0.2):
            pool = alive if alive and (not held or rng.random() < 0.8) else held
            addr = rng.choice(sorted(pool))
            size = pool.pop(addr)
            if rng.random() < 0.7:
                events.append({"action": "free_requested", "addr": addr, "size": size, "frames": []})
                events.append({"action": "free_completed", "addr": addr, "size": size, "frames": []})
            elif pool is alive:  # a block freed without a recorded request (free_completed alone)
                events.append({"action": "free_completed", "addr": addr, "size": size, "frames": []})
            else:
                events.append({"action": "free_requested", "addr": addr, "size": size, "frames": []})
            free_addrs.append(addr)
        else:
            addr = free_addrs.pop() if free_addrs and rng.random() < 0.5 else next_addr
            next_addr += 4096
            size = rng.randint(1, 64) * 512
            alive[addr] = size
            events.append({"action": "alloc", "addr": addr, "size": size, "frames": rng.choice(SITES)})
    return events


@pytest.mark.parametrize("trial", range(40))
def test_peak_and_alive_blocks_match_brute_force(seed: int, trial: int) -> None:
    rng = random.Random(seed * 100 + trial)
    held = {(1 << 40) + 4096 * i: rng.randint(1, 8) * 1024 for i in range(rng.randint(0, 5))}
    held_bytes = sum(held.values())
    events = _history(rng, held)
    # brute force: the allocated count after each event, from lifetimes
    level, best, best_i = held_bytes, held_bytes, -1
    live: dict[int, tuple[int, int]] = {}  # addr -> (size, event index)
    live_at_best: dict[int, tuple[int, int]] = {}
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], i)
            level += e["size"]
        elif e["addr"] in live:
            level -= live.pop(e["addr"])[0]
        elif e["action"] == "free_requested":
            level -= e["size"]
        if level > best:
            best, best_i, live_at_best = level, i, dict(live)
    got = peak_anatomy(events, held_bytes)
    assert (got.peak_bytes, got.peak_event) == (best, best_i)
    assert sum(s.bytes for s in got.sites) == best  # held before (less its freed part) + the alive blocks
    step_bytes = sum(size for size, _ in live_at_best.values())
    assert sum(s.bytes for s in got.sites if s.phase != "before") == step_bytes
    assert sum(s.blocks for s in got.sites) == len(live_at_best)
    # each alive block charged to its allocating event's site
    want: dict[str, int] = {}
    for size, i in live_at_best.values():
        where = site_of(events[i]["frames"])
        want[where] = want.get(where, 0) + size
    have: dict[str, int] = {}
    for s in got.sites[1:]:
        have[s.where] = have.get(s.where, 0) + s.bytes
    assert have == want


def test_top_folds_the_rest_into_one_line() -> None:
    events = [{"action": "alloc", "addr": i, "size": 100 * (i + 1), "frames": [SITES[i % 4][-1] | {"line": i}]} for i in range(6)]
    got = peak_anatomy(events, 0, top=2)
    assert [s.bytes for s in got.sites] == [0, 600, 500, 1000]
    assert got.sites[-1].where == "other sites" and got.sites[-1].blocks == 4
