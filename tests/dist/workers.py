"""What the ranks of tests/dist run (inside groups started by hal.dist.launch).

Each check is a function ``check(rank, n, seed)`` that asserts; :func:`run_checks` runs several in
one process group (process start-up is the expensive part on a small CI machine) and reports each
one's outcome separately. Every rank draws every rank's input from the seed, so each can compute
the NumPy reference of the whole collective itself.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

import hal
import hal.dist as hd
from hal.dist.launch import RankResult


def inputs(seed: int, tag: str, n: int, shape: tuple[int, ...], scale: float = 1.0) -> list[np.ndarray]:
    """Every rank's float64 input for check ``tag``: normal draws times ``scale`` (never zeros)."""
    out = []
    for r in range(n):
        rng = np.random.default_rng([seed, sum(map(ord, tag)), r])
        x = rng.standard_normal(shape) * scale
        out.append(np.where(x == 0, scale, x))
    return out


def device() -> torch.device:
    """The device of this rank's group: its GPU under NCCL/RCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def as_tensor(x: np.ndarray, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.from_numpy(np.array(x)).to(dtype).to(device())


def ones(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.ones(shape, dtype=dtype, device=device())


def npy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().double().numpy()


def expect_error(kind: type, fn: Callable[[], Any], *fragments: str) -> str:
    """Run ``fn``; it must raise ``kind`` with every fragment in the message. Returns the message."""
    try:
        fn()
    except kind as exc:
        message = str(exc)
        for f in fragments:
            assert f in message, f"{f!r} not in the {kind.__name__} message: {message}"
        return message
    raise AssertionError(f"{kind.__name__} not raised")


def compressed_bound(xs: list[np.ndarray], unit: float, avg: bool = False) -> np.ndarray:
    """Per-element error bound of a compressed all-reduce: rounding of each input and of the sum."""
    n = len(xs)
    stack = np.stack(xs)
    amax = float(np.abs(stack).max())
    bound = unit * (np.abs(stack).sum(0) + np.abs(stack.sum(0))) + (n + 1) * 2.0**-24 * n * amax * 2.0**-14
    return bound / n if avg else bound


# --- checks on 4 ranks -----------------------------------------------------------------------------


def check_async(rank: int, n: int, seed: int) -> None:
    """Async calls return Work handles; queued calls keep their order; futures carry the result."""
    xs = inputs(seed, "async", n, (3001,))
    ref = np.sum(xs, 0)
    a = as_tensor(xs[rank])
    work = hd.all_reduce(a, async_op=True)
    assert isinstance(work, hd.Work)
    assert work.wait() is a
    np.testing.assert_allclose(npy(a), ref, rtol=1e-5, atol=1e-5)

    # a multi-step algorithm in flight, then calls that must queue behind it on every rank
    b, c = as_tensor(xs[rank]), as_tensor(xs[rank])
    w_b = hd.all_reduce(b, op="avg", algorithm="compressed_fp16", async_op=True)
    hd.all_reduce(c, op="max")
    gathered = hd.all_gather(as_tensor(xs[rank][:7]), async_op=True)
    w_e = hd.all_to_all(torch.arange(n, dtype=torch.float32, device=device()) + 10 * rank, input_split_sizes=[1] * n, async_op=True)
    assert w_b.wait() is b
    np.testing.assert_allclose(npy(b), ref / n, atol=compressed_bound(xs, 2.0**-11, avg=True).max())
    np.testing.assert_array_equal(npy(c), np.max(xs, 0).astype(np.float32))
    np.testing.assert_array_equal(npy(gathered.get_future().wait()), np.concatenate([x[:7] for x in xs]).astype(np.float32))
    np.testing.assert_array_equal(npy(w_e.wait()), [rank + 10.0 * s for s in range(n)])
    assert w_e.is_completed()


def check_numpy_inputs(rank: int, n: int, seed: int) -> None:
    """NumPy arrays work in place (shared memory) and come back as arrays; bf16 via ml_dtypes."""
    xs = inputs(seed, "numpy", n, (5, 7))
    arr = xs[rank].astype(np.float32)
    assert hd.all_reduce(arr) is arr
    np.testing.assert_allclose(arr, np.sum(xs, 0), rtol=1e-5, atol=1e-5)
    out = hd.all_gather(xs[rank].astype(np.float64))
    assert isinstance(out, np.ndarray) and out.shape == (5 * n, 7)
    np.testing.assert_array_equal(out, np.concatenate(xs))
    bf = hal.arrays.to_numpy(torch.full((4,), float(rank + 1), dtype=torch.bfloat16))
    hd.all_reduce(bf)
    assert bf.dtype == hal.arrays.BFLOAT16 and float(bf[0]) == n * (n + 1) / 2


def check_explain_and_choice(rank: int, n: int, seed: int) -> None:
    """hal.explain shows every algorithm with reasons and estimates; cost overrides and forcing work."""
    t = as_tensor(inputs(seed, "explain", n, (1 << 16,))[rank])
    text = str(hal.explain("all_reduce", t))
    assert "chosen: gloo/native" in text, text
    assert "hierarchical" in text and "node layout is unknown" in text, text
    assert "compressed_fp16 [est." in text and "lossy" in text and "allow_lossy=True" in text, text
    try:  # make the wire slow and compression free: auto must pick the 16-bit transfer
        hd.set_cost_model("gloo", allow_lossy=True, gbps_intra=0.01, compress_gbps=1e6)
        decision = hal.explain("all_reduce", t)  # bf16 needs no max-exchange first: a little cheaper
        assert decision.kernel == "compressed_bf16", str(decision)
        assert "ok gloo/compressed_fp16 [est." in str(decision) and "ok gloo/native" in str(decision), str(decision)
        assert hal.explain("all_reduce", t.to(torch.int32)).kernel == "native"  # not for integers
        assert hal.explain("all_reduce", t, op="max").kernel == "native"
    finally:
        hd.reset_cost_model()
    with hal.use(kernel={"all_reduce": "compressed_bf16"}):
        decision = hal.explain("all_reduce", t)
        assert decision.kernel == "compressed_bf16" and "hal.use" in str(decision), str(decision)
    for name, args in [
        ("all_gather", (t,)),
        ("reduce_scatter", (t,)),
        ("all_to_all", (t,)),
        ("broadcast", (t, 0)),
        ("send", (t, (rank + 1) % n)),
    ]:
        assert hal.explain(name, *args).kernel == "native", name
    # a forced algorithm that cannot run raises on every rank before anything is sent
    expect_error(hal.UnsupportedError, lambda: hd.all_reduce(t.to(torch.int32), algorithm="compressed_fp16"), "floating-point")
    expect_error(hal.InvalidArgumentError, lambda: hd.all_reduce(t, algorithm="ring"), "'algorithm'", "native")
    hd.all_reduce(t)  # the group is still in step


def check_bad_arguments(rank: int, n: int, seed: int) -> None:
    """Local validation names the collective, the argument, what was expected and what came."""
    t = torch.randn(8)
    bad = hal.InvalidArgumentError
    expect_error(bad, lambda: hd.all_reduce(t, op="prod"), "all_reduce", "'op'", "'sum', 'avg'")
    expect_error(bad, lambda: hd.all_reduce(torch.ones(3, dtype=torch.int32), op="avg"), "avg needs floating point")
    expect_error(bad, lambda: hd.all_reduce([1.0, 2.0]), "torch.Tensor or a numpy.ndarray")
    expect_error(bad, lambda: hd.all_reduce(torch.ones(2, dtype=torch.complex64)), "a tensor of one of")
    expect_error(bad, lambda: hd.reduce_scatter(torch.ones(n + 1)), "multiple of the group size")
    expect_error(bad, lambda: hd.all_to_all(torch.ones(n), input_split_sizes=[1] * (n + 1)), "input_split_sizes", "one per rank")
    expect_error(bad, lambda: hd.all_to_all(torch.ones(n), input_split_sizes=[2] * n), "summing to dim 0")
    expect_error(bad, lambda: hd.broadcast(t, n + 3), "'src'", "global rank of the group")
    expect_error(bad, lambda: hd.send(t, rank), "another rank than this one")
    expect_error(bad, lambda: hd.all_reduce(t, group="world"), "'group'")
    expect_error(bad, lambda: hd.all_reduce(np.ones(3, np.float32)[::-1]), "writeable NumPy array")
    expect_error(bad, lambda: hd.set_cost_model(gbps_intra=-1), "positive number")
    expect_error(bad, lambda: hd.set_cost_model(bandwidth=3), "'bandwidth'")


def check_debug_mismatch(rank: int, n: int, seed: int) -> None:
    """With the debug check on, disagreeing calls raise InvalidArgumentError on every rank; the group survives."""
    hd.set_debug(True)
    last = n - 1
    try:
        shape = (5,) if rank == last else (4,)
        msg = expect_error(hal.InvalidArgumentError, lambda: hd.all_reduce(ones(*shape)), "same dtype and shape")
        others = f"ranks 0-{last - 1}" if last > 2 else "rank 0" if last == 1 else "ranks 0, 1"
        assert f"{others}: float32 (4,)" in msg and f"rank {last}: float32 (5,)" in msg, msg
        dtype = torch.float64 if rank == 0 else torch.float32
        expect_error(hal.InvalidArgumentError, lambda: hd.all_gather(ones(3, dtype=dtype)), "rank 0: float64 (3,)")
        op = "max" if rank == 0 else "sum"
        expect_error(hal.InvalidArgumentError, lambda: hd.all_reduce(ones(3), op=op), "'op'", "rank 0: max")
        src = 0 if rank else 1
        expect_error(hal.InvalidArgumentError, lambda: hd.broadcast(ones(2), src), "'src'")
        recv_splits = [1] * n
        if rank == 0:
            recv_splits = [2] + [1] * (n - 2) + [0]  # claims 2 rows from rank 0 and none from the last
        expect_error(
            hal.InvalidArgumentError,
            lambda: hd.all_to_all(ones(n, 2), input_split_sizes=[1] * n, output_split_sizes=recv_splits),
            "output_split_sizes",
        )
        if rank in (0, 1):  # a send/recv pair with different shapes: both sides raise
            peer = 1 - rank
            call = (lambda: hd.send(ones(4), peer)) if rank == 0 else (lambda: hd.recv(ones(5), peer))
            expect_error(hal.InvalidArgumentError, call, "the matching")
        x = ones(6) * rank
        hd.all_reduce(x)  # agreeing calls pass the check
        assert x.tolist() == [n * (n - 1) / 2] * 6
    finally:
        hd.set_debug(None)


def check_compressed_numerics(rank: int, n: int, seed: int) -> None:
    """16-bit transfers stay within the rounding bound, never overflow near the fp16 maximum,
    keep tiny values (pre-scaled up), and pass infinities through."""
    from hal.dist import compressed, engine

    for tag, scale, unit, alg, small in [
        ("normal", 1.0, 2.0**-11, "compressed_fp16", False),
        ("tiny", 1e-6, 2.0**-11, "compressed_fp16", False),  # unscaled, most would be fp16 subnormals
        ("normal", 3.0, 2.0**-8, "compressed_bf16", False),
        # CPU pipeline of 4 pieces, all-gathers point to point: the paths of messages of many MiB
        ("pieces", 1.0, 2.0**-11, "compressed_fp16", True),
        ("pieces", 1.0, 2.0**-8, "compressed_bf16", True),
    ]:
        xs = inputs(seed, tag, n, (20011,), scale)
        t = as_tensor(xs[rank])
        saved = compressed._PIECE_BYTES, engine.P2P_MIN_BYTES
        if small:
            compressed._PIECE_BYTES, engine.P2P_MIN_BYTES = 1 << 14, 0
        try:
            hd.all_reduce(t, algorithm=alg)
        finally:
            compressed._PIECE_BYTES, engine.P2P_MIN_BYTES = saved
        err = np.abs(npy(t) - np.sum(xs, 0))
        bound = compressed_bound(xs, unit)
        assert np.all(err <= bound), f"{alg} {tag}: {int((err > bound).sum())} elements beyond the bound"

    rng = np.random.default_rng([seed, 99])
    near = [rng.uniform(0.9, 1.0, 4099) * 65504.0 for _ in range(n)]  # every sum overflows fp16
    native16 = as_tensor(near[rank], torch.float16)
    hd.all_reduce(native16)
    assert torch.isinf(native16).all(), "fp16 sums near the maximum should overflow natively"
    for alg, unit in [("compressed_fp16", 2.0**-11), ("compressed_bf16", 2.0**-8)]:
        t = as_tensor(near[rank])
        hd.all_reduce(t, algorithm=alg)
        assert torch.isfinite(t).all(), f"{alg} overflowed"
        assert np.all(np.abs(npy(t) - np.sum(near, 0)) <= compressed_bound(near, unit)), alg
        half = as_tensor(near[rank], torch.float16)  # fp16 in, fp16 out: the average fits
        hd.all_reduce(half, op="avg", algorithm=alg)
        want = np.mean([x.astype(np.float16).astype(np.float64) for x in near], 0)
        assert torch.isfinite(half).all(), f"{alg} avg of fp16 overflowed"
        assert np.all(np.abs(npy(half) - want) <= compressed_bound(near, unit, avg=True) + 32), alg

    for alg in ("compressed_fp16", "compressed_bf16"):  # rounding must not push an fp16 average to inf
        top = ones(64, dtype=torch.float16) * 65504
        hd.all_reduce(top, op="avg", algorithm=alg)
        assert torch.all(top == 65504), f"{alg}: {top[:4].tolist()}"

    t = torch.ones(64, device=device()) * (rank + 1)
    if rank == 1:
        t[3] = float("inf")
    hd.all_reduce(t, algorithm="compressed_fp16")
    assert torch.isinf(t[3]) and torch.all(t[:3] == n * (n + 1) / 2) and torch.all(t[4:] == n * (n + 1) / 2)


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(32, 64)
        self.b = torch.nn.Linear(64, 64)
        self.c = torch.nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _train(seed: int, rank: int, hook: Any, steps: int = 4) -> tuple[list[torch.Tensor], int]:
    torch.manual_seed(seed)
    dev = device()
    net = _Net().to(dev)
    ids = [dev.index] if dev.type == "cuda" else None
    model = torch.nn.parallel.DistributedDataParallel(net, device_ids=ids, bucket_cap_mb=0.01)  # ~2600 floats a bucket
    calls = [0]
    if hook is not None:

        def counting(state, bucket):  # type: ignore[no-untyped-def]  (DDP rejects string annotations)
            calls[0] += 1
            return hook(state, bucket)

        model.register_comm_hook(None, counting)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(seed * 31 + rank)
    for _ in range(steps):
        x, y = torch.randn(16, 32, generator=data).to(dev), torch.randn(16, 8, generator=data).to(dev)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()], calls[0]


def check_ddp(rank: int, n: int, seed: int) -> None:
    """DDP training with hal.dist.comm_hook matches DDP's own all-reduce (4 CPU ranks in CI)."""
    want, _ = _train(seed, rank, None)
    got, calls = _train(seed, rank, hd.comm_hook("native"))
    assert calls > 4, f"expected several buckets per step, the hook ran {calls} times in 4 steps"
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    lossy, _ = _train(seed, rank, hd.comm_hook("compressed_fp16"))
    for g, w in zip(lossy, want):
        torch.testing.assert_close(g, w, rtol=2e-3, atol=2e-4)
    auto, _ = _train(seed, rank, hd.comm_hook())
    for g, w in zip(auto, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


FOUR_RANK_CHECKS = {
    "async": check_async,
    "numpy_inputs": check_numpy_inputs,
    "explain_and_choice": check_explain_and_choice,
    "bad_arguments": check_bad_arguments,
    "debug_mismatch": check_debug_mismatch,
    "compressed_numerics": check_compressed_numerics,
    "ddp": check_ddp,
}


# --- checks on 8 ranks as 2 nodes x 4 --------------------------------------------------------------


def check_hierarchical(rank: int, n: int, seed: int) -> None:
    """hierarchical matches the reference for every op and odd sizes; auto takes it when the network is slow."""
    assert os.environ["LOCAL_WORLD_SIZE"] == "4"
    for size in (1, 7, 4099):
        for op in ("sum", "avg", "max", "min"):
            xs = inputs(seed, f"h{size}{op}", n, (size,))
            t = as_tensor(xs[rank], torch.float64)
            hd.all_reduce(t, op=op, algorithm="hierarchical")
            stack = np.stack(xs)
            want = {"sum": stack.sum(0), "avg": stack.mean(0), "max": stack.max(0), "min": stack.min(0)}[op]
            np.testing.assert_allclose(t.numpy(), want, rtol=1e-12, atol=1e-12, err_msg=f"{op} size {size}")
    ints = torch.arange(10, dtype=torch.int64) * (rank + 1)
    hd.all_reduce(ints, algorithm="hierarchical")
    assert ints.tolist() == [i * n * (n + 1) // 2 for i in range(10)]
    transposed = as_tensor(inputs(seed, "ht", n, (6, 5))[rank]).T
    hd.all_reduce(transposed, algorithm="hierarchical")
    np.testing.assert_allclose(transposed.numpy(), np.sum(inputs(seed, "ht", n, (6, 5)), 0).T, rtol=1e-5, atol=1e-5)

    t = torch.ones(1 << 20)
    text = str(hal.explain("all_reduce", t))
    assert "2 node(s) x 4 rank(s)" in text and ("ok gloo/hierarchical" in text or "-> gloo/hierarchical" in text), text
    try:
        hd.set_cost_model("gloo", gbps_inter=0.05, gbps_intra=10.0)  # a slow network between nodes
        assert hal.explain("all_reduce", t).kernel == "hierarchical"
        t = torch.full((1 << 12,), float(rank))
        hd.all_reduce(t)  # auto: hierarchical now
        assert torch.all(t == n * (n - 1) / 2)
    finally:
        hd.reset_cost_model()
    try:  # an explicit topology overrides LOCAL_WORLD_SIZE: 8 nodes of 1 rank has no inner stage
        hd.set_topology(ranks_per_node=1)
        assert "one rank per node" in str(hal.explain("all_reduce", t, algorithm="hierarchical"))
    finally:
        hd.set_topology(None)


EIGHT_RANK_CHECKS = {"hierarchical": check_hierarchical}


def run_checks(rank: int, n: int, seed: int, names: list[str]) -> dict[str, tuple[str, float]]:
    """Run the named checks in order: (error, seconds) each, error '' for a pass."""
    table = {**FOUR_RANK_CHECKS, **EIGHT_RANK_CHECKS}
    out = {}
    for name in names:
        started = time.monotonic()
        try:
            table[name](rank, n, seed)
            error = ""
        except Exception:  # each check reports its own failure; the next ones still run
            error = traceback.format_exc()
        out[name] = (error, time.monotonic() - started)
    return out


# --- faults ----------------------------------------------------------------------------------------


def rank_dies(rank: int, n: int, timeout_s: float) -> dict[str, Any]:
    """The last rank exits before the all-reduce; the others must get a HalError within the timeout."""
    hd.set_timeout(timeout_s)
    hd.all_reduce(torch.ones(4))  # everyone is up
    if rank == n - 1:
        os._exit(3)
    started = time.monotonic()
    try:
        hd.all_reduce(torch.ones(1 << 16))
        hd.all_reduce(torch.ones(1 << 16))  # the first may complete on buffered data
    except hal.HalError as exc:
        return {"error": type(exc).__name__, "seconds": time.monotonic() - started, "message": str(exc)}
    return {"error": None, "seconds": time.monotonic() - started, "message": ""}


def rank_stalls(rank: int, n: int, timeout_s: float) -> dict[str, Any]:
    """The last rank sleeps; the others' asynchronous compressed all-reduce must fail within the timeout."""
    hd.set_timeout(timeout_s)
    hd.all_reduce(torch.ones(4))
    if rank == n - 1:
        time.sleep(120)
    started = time.monotonic()
    try:
        hd.all_reduce(torch.ones(1 << 16), algorithm="compressed_fp16", async_op=True).wait()
    except hal.HalError as exc:
        return {"error": type(exc).__name__, "seconds": time.monotonic() - started, "message": str(exc)}
    return {"error": None, "seconds": time.monotonic() - started, "message": ""}


def describe_failures(results: list[RankResult]) -> str:
    return "\n".join(f"rank {r.rank}: {r.message}\n{r.traceback}" for r in results if not r.ok)
