"""Calls whose work or memory is far beyond their arguments' size, under an address-space limit.

Run by test_memory.py in a subprocess: ``python -m tests.reliability.memory_worker HEADROOM_MIB
EXAMPLES SEED``. It limits its own address space (``RLIMIT_AS``) to what it uses after start-up
plus HEADROOM_MIB, then draws calls with hypothesis: convolutions with huge padding, dilation and
stride (a padded input would need up to terabytes), int8_linear and softmax on expanded views,
matmul gradients over broadcast batches, attention over long sequences of few features. Each call
must either return what torch returns (when torch itself can compute it under the limit) or raise a
``hal.HalError``; never a raw exception (MemoryError, ValueError, OverflowError ...). It prints one
JSON line: the counts and every mismatch or raw exception, with the call that caused it.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import traceback
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import hal

REPORT: dict[str, Any] = {"calls": 0, "results": 0, "hal_errors": 0, "compared": 0, "mismatches": [], "raw": []}
HUGE = [10**3, 10**5, 10**6, 2**40, 2**62, 2**70]


def limit_address_space(headroom_mib: int) -> bool:
    """Cap the address space at its current size plus the headroom; True when the cap holds (an
    allocation of twice the headroom fails)."""
    with open("/proc/self/statm") as f:
        used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = used + headroom_mib * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    try:
        torch.empty(2 * headroom_mib * 2**20, dtype=torch.uint8)
    except RuntimeError:
        return True
    return False


def reference(fn: Callable[[], Any]) -> Optional[Any]:
    """torch's result, or None where torch cannot compute it under the limit either."""
    try:
        return fn()
    except (RuntimeError, MemoryError, ValueError, OverflowError, TypeError):
        return None


def run(what: str, call: Callable[[], Any], want: Callable[[], Any]) -> None:
    REPORT["calls"] += 1
    try:
        got = call()
    except hal.HalError:
        REPORT["hal_errors"] += 1
        return
    except BaseException as exc:  # noqa: BLE001 - any other exception is the bug this looks for
        REPORT["raw"].append(f"{what}: {type(exc).__name__}: {exc} | {traceback.format_exc(limit=-3)}")
        return
    REPORT["results"] += 1
    expected = reference(want)
    if expected is None:  # torch cannot compute it under the limit either, or is not trusted there
        return
    REPORT["compared"] += 1
    got_t, want_t = (got, expected) if isinstance(got, tuple) else ((got,), (expected,))
    for g, w in zip(got_t, want_t):
        if tuple(g.shape) != tuple(w.shape) or not _close(g, w):
            REPORT["mismatches"].append(f"{what}: got shape {tuple(g.shape)}, torch {tuple(w.shape)}")
            return


#: elements compared at a time: the comparison must fit under the limit beside the results (an
#: expanded reference is a view; converting the whole of it to float64 would not)
COMPARE_BLOCK = 1 << 22


def _close(g: torch.Tensor, w: torch.Tensor) -> bool:
    """torch.allclose in float64 (rtol = atol = 1e-5), over blocks of leading rows."""
    if g.ndim == 0 or g.numel() == 0:
        return torch.allclose(g.double(), w.double(), rtol=1e-5, atol=1e-5)
    step = max(1, COMPARE_BLOCK // max(1, g[0].numel()))
    return all(torch.allclose(g[i : i + step].double(), w[i : i + step].double(), rtol=1e-5, atol=1e-5) for i in range(0, g.shape[0], step))


@st.composite
def conv_calls(draw: st.DrawFn) -> dict[str, Any]:
    n, c, o = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 4))
    h, w, kh, kw = (draw(st.integers(1, 6)) for _ in range(4))
    big = st.sampled_from(HUGE)
    return {
        "x": torch.randn(n, c, h, w, dtype=torch.float64),
        "weight": torch.randn(o, c, kh, kw, dtype=torch.float64),
        "padding": draw(st.one_of(st.integers(0, 3), big)),
        "dilation": draw(st.one_of(st.integers(1, 3), big)),
        "stride": draw(st.one_of(st.integers(1, 3), big)),
    }


#: torch 2.13 computes convolution output sizes wrongly from about 2**34 on (F.conv2d of a 4x4 input,
#: 4x4 kernel, padding = stride = 2**34 gives one output row where the formula gives two; an
#: overflow in its size arithmetic): beyond this, results are not compared with torch.
TORCH_SIZES_EXACT = 2**31


def conv_case(a: dict[str, Any]) -> None:
    x, w, p, d, s = a["x"], a["weight"], a["padding"], a["dilation"], a["stride"]
    what = f"conv2d x{tuple(x.shape)} w{tuple(w.shape)} padding={p} dilation={d} stride={s}"
    trusted = max(p, d, s) < TORCH_SIZES_EXACT
    run(what, lambda: hal.ops.conv2d(x, w, None, s, p, d), lambda: F.conv2d(x, w, None, s, p, d) if trusted else None)

    def torch_grads() -> Optional[tuple]:
        if not trusted:
            return None
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = F.conv2d(xl, wl, None, s, p, d)
        return torch.autograd.grad(y, (xl, wl), torch.ones_like(y))

    def hal_grads() -> tuple:
        y = hal.ops.conv2d(x, w, None, s, p, d)
        return hal.ops.conv2d_backward(torch.ones_like(y), x, w, s, p, d)[:2]

    run("backward of " + what, hal_grads, torch_grads)


@st.composite
def expanded_calls(draw: st.DrawFn) -> dict[str, Any]:
    return {"m": draw(st.integers(1, 2**14)), "k": draw(st.integers(1, 2**13)), "n": draw(st.integers(1, 4)), "op": draw(st.sampled_from(["int8_linear", "softmax"]))}


def expanded_case(a: dict[str, Any]) -> None:
    m, k, n = a["m"], a["k"], a["n"]
    if a["op"] == "int8_linear":  # one row of x_q viewed m times: k bytes held, m * k seen
        row = torch.randint(-127, 128, (1, k), dtype=torch.int8)
        wq = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        want = (row.long() @ wq.long().t()).double() * 0.5 * 0.25
        run(f"int8_linear x_q (1, {k}) expanded to ({m}, {k}), N={n}",
            lambda: hal.ops.int8_linear(row.expand(m, k), wq, 0.5, 0.25, None, "float32"), lambda: want.expand(m, n))
    else:
        row = torch.randn(1, k, dtype=torch.float64)
        run(f"softmax of (1, {k}) expanded to ({m}, {k})", lambda: hal.ops.softmax(row.expand(m, k), -1), lambda: F.softmax(row, -1).expand(m, k))


@st.composite
def broadcast_calls(draw: st.DrawFn) -> dict[str, Any]:
    return {"b": draw(st.integers(1, 2**10)), "m": draw(st.integers(1, 2**9)), "k": draw(st.integers(1, 2**9))}


def matmul_broadcast_case(a: dict[str, Any]) -> None:
    """a (M, K) broadcast against b (B, K, 1): grad_a sums B products of M x K (B * M * K if held)."""
    b_, m, k = a["b"], a["m"], a["k"]
    x, y = torch.randn(m, k, dtype=torch.float64), torch.randn(b_, k, 1, dtype=torch.float64)
    g = torch.randn(b_, m, 1, dtype=torch.float64)
    want = lambda: (torch.einsum("bmn,bkn->mk", g, y), torch.einsum("bmn,mk->bkn", g, x))  # noqa: E731
    run(f"matmul_backward a{(m, k)} b{(b_, k, 1)}", lambda: hal.ops.matmul_backward(g, x, y), want)


@st.composite
def attention_calls(draw: st.DrawFn) -> dict[str, Any]:
    return {"l": draw(st.integers(1, 2**13)), "s": draw(st.integers(1, 2**13)), "e": draw(st.integers(1, 2)), "causal": draw(st.booleans())}


def attention_case(a: dict[str, Any]) -> None:
    """Scores of L x S held whole would be far beyond q, k, v of few features."""
    q = torch.randn(1, a["l"], a["e"], dtype=torch.float64)
    k = torch.randn(1, a["s"], a["e"], dtype=torch.float64)
    v = torch.randn(1, a["s"], 2, dtype=torch.float64)
    c = a["causal"]
    run(f"sdpa L={a['l']} S={a['s']} E={a['e']} causal={c}", lambda: hal.ops.scaled_dot_product_attention(q, k, v, is_causal=c),
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=c))


def issue_examples() -> None:
    """The issue's examples: valid convolutions with a 1x1 output whose padded float64 input would
    take 60 to 900 GiB (torch computes each in milliseconds), then padding=2**70 (an error)."""
    x, w = torch.randn(1, 3, 5, 5, dtype=torch.float64), torch.randn(2, 3, 3, 3, dtype=torch.float64)
    for p, d, s in [(10**5 - 2, 10**5, 1), (5 * 10**4 - 2, 5 * 10**4, 1), (10**5, 1, 10**6)]:
        conv_case({"x": x, "weight": w, "padding": p, "dilation": d, "stride": s})
    conv_case({"x": x, "weight": w, "padding": 2**70, "dilation": 1, "stride": 1})


def main() -> None:
    headroom, examples, run_seed = (int(v) for v in sys.argv[1:4])
    torch.manual_seed(run_seed)
    hal.backends()  # load the plugins before the limit: only the calls are measured
    REPORT["limit_active"] = limit_address_space(headroom)
    issue_examples()
    REPORT["issue_examples"] = {"results": REPORT["results"], "hal_errors": REPORT["hal_errors"]}
    for strategy, case, share in ((conv_calls(), conv_case, 4), (expanded_calls(), expanded_case, 2),
                                  (broadcast_calls(), matmul_broadcast_case, 1), (attention_calls(), attention_case, 1)):
        test = settings(max_examples=max(1, examples * share // 8), deadline=None, database=None,
                        suppress_health_check=list(HealthCheck))(given(strategy)(case))
        seed(run_seed)(test)()  # the parent's seed replays the same calls
    print(json.dumps(REPORT))


if __name__ == "__main__":
    main()
