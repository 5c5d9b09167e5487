"""NaN and infinities through one fused_adamw_ step, against torch.optim.AdamW itself (the for-loop
and foreach implementations users get by default), for the Triton kernel in the interpreter
(tests/cuda/interpreted/test_adamw_specials.py), the C++ kernel on CPU threads
(tests/cpp/test_emulated.py) and both on a CUDA device (tests/cuda/device/test_optim_copies.py).

Why torch.optim.AdamW and not torch's fused kernel: at special values torch's implementations do not
agree with each other. torch.optim.AdamW moves the first moment with ``exp_avg.lerp_(grad, w)``,
``w = 1 - beta1``, which at::native::lerp evaluates as ``m + w * (g - m)`` for ``|w| < 0.5`` and as
``g - (g - m) * (1 - w)`` otherwise. For ``w < 0.5`` that gives ``m = inf, g finite -> inf + w * -inf
= NaN`` and ``g = inf, m finite -> inf``. The sum ``beta1 * m + w * g`` (hal's kernels before
2026-12, torch's CUDA fused kernel before 2.11) gives ``inf`` for both, and the form of torch's CUDA
fused kernel from 2.11 on (pytorch PR 173224), ``fma(beta1, m, fma(-beta1, g, g))``, gives ``inf``
for the first and ``-inf + inf = NaN`` for the second (and likewise a NaN second moment for an
infinite gradient, where torch.optim.AdamW's ``v * beta2 + (1 - beta2) * g * g`` is ``inf``). The
masters are NaN in all of them (``inf / inf`` or a NaN moment), so only the moments part. The cases
below put every such combination into the lists, for both branches of lerp (beta1 0.9 and 0.3).

Left out on purpose: finite gradients whose square overflows float32 (|g| > 1.8e19). torch's
for-loop computes ``((1 - beta2) * g) * g`` (finite up to about 5.8e20 for beta2 = 0.999) and its
CUDA foreach ``(1 - beta2) * (g * g)`` (inf): torch itself is ambiguous there.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

INF, NAN = float("inf"), float("nan")
#: (what, {field: value}) poisoned at one random position each: states a step with an infinite or
#: NaN gradient leaves behind (infinite moments, infinite or NaN masters) meeting finite and infinite
#: gradients. "masters" means the float32 weights the update applies to (the params without masters).
CASES = [
    ("nan grad", {"grads": NAN}),
    ("inf grad", {"grads": INF}),
    ("-inf grad", {"grads": -INF}),
    ("inf exp_avg", {"exp_avgs": INF}),
    ("-inf exp_avg", {"exp_avgs": -INF}),
    ("inf exp_avg, inf grad", {"exp_avgs": INF, "grads": INF}),
    ("inf exp_avg, -inf grad", {"exp_avgs": INF, "grads": -INF}),
    ("-inf exp_avg, -inf grad", {"exp_avgs": -INF, "grads": -INF}),
    ("nan exp_avg", {"exp_avgs": NAN}),
    ("inf exp_avg_sq", {"exp_avg_sqs": INF}),
    ("inf exp_avg_sq, inf grad", {"exp_avg_sqs": INF, "grads": INF}),
    ("inf exp_avg_sq, inf exp_avg", {"exp_avg_sqs": INF, "exp_avgs": INF}),
    ("inf master", {"masters": INF}),
    ("-inf master", {"masters": -INF}),
    ("nan master", {"masters": NAN}),
]
#: (beta1, beta2): lerp's weight 1 - beta1 below 0.5 (the usual), and at or above it (the other branch)
BETAS = [(0.9, 0.999), (0.3, 0.5)]
LR, EPS, DECAY, STEP = 1e-2, 1e-8, 0.01, 3.0


def special_state(gen: torch.Generator, shapes: list[tuple[int, ...]], pdtype: torch.dtype, masters: bool,
                  device: Union[str, torch.device] = "cpu") -> dict[str, list[torch.Tensor]]:
    """Random params (with masters: half-precision copies poisoned with NaN beside float32 masters
    and float32 grads), moments and grads; every list with at least len(CASES) elements gets each
    case at its own random position, the others stay finite."""
    def r(shape: tuple[int, ...], std: float = 1.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    state = {
        "grads": [r(s) for s in shapes],
        "exp_avgs": [r(s, 0.1) for s in shapes],
        "exp_avg_sqs": [torch.rand(s, generator=gen) * 1e-2 for s in shapes],
        "masters": [r(s) for s in shapes],
    }
    for i, shape in enumerate(shapes):
        n = torch.Size(shape).numel()
        if n < len(CASES):
            continue
        where = torch.randperm(n, generator=gen)[: len(CASES)]
        for k, (_, values) in enumerate(CASES):
            for field, value in values.items():
                state[field][i].view(-1)[where[k]] = value
    if masters:
        state["params"] = [torch.full(s, NAN, dtype=pdtype) for s in shapes]
    else:
        state["params"] = [w.to(pdtype) for w in state.pop("masters")]
    return {k: [t.to(device) for t in ts] for k, ts in state.items()}


def target(state: dict[str, list[torch.Tensor]]) -> list[torch.Tensor]:
    """The tensors the update applies to: the masters, else the params."""
    return state["masters"] if "masters" in state else state["params"]


def clone(state: dict[str, list[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
    return {k: [t.clone() for t in ts] for k, ts in state.items()}


def run(fn, state: dict[str, list[torch.Tensor]], betas: tuple[float, float], inv_scale: Optional[torch.Tensor] = None,
        step: Union[float, torch.Tensor] = STEP) -> None:
    """``fn`` (a fused_adamw_ kernel, called positionally as the dispatcher calls it) on ``state``."""
    fn(state["params"], state["grads"], state["exp_avgs"], state["exp_avg_sqs"], LR, betas[0], betas[1], EPS, DECAY, step,
       state.get("masters"), inv_scale, None)


def torch_adamw(state: dict[str, list[torch.Tensor]], betas: tuple[float, float], inv_scale: Optional[float], foreach: bool) -> dict[str, list[torch.Tensor]]:
    """The state after torch.optim.AdamW's step STEP (its state loaded with step STEP - 1 and the
    moments) on copies of the weights (float32, the masters where there are any), their grads
    multiplied by inv_scale in float32 as GradScaler's unscale does; the params of a state with
    masters are the masters rounded."""
    out = clone(state)
    weights = target(out)
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = torch.optim.AdamW(params, lr=LR, betas=betas, eps=EPS, weight_decay=DECAY, foreach=foreach)
    for p, g, m, v in zip(params, out["grads"], out["exp_avgs"], out["exp_avg_sqs"]):
        p.grad = g.float() if inv_scale is None else g.float() * torch.tensor(inv_scale, dtype=torch.float32)
        opt.state[p] = {"step": torch.tensor(STEP - 1.0), "exp_avg": m, "exp_avg_sq": v}  # the moments themselves: updated in place
    opt.step()
    for w, p in zip(weights, params):
        w.copy_(p.detach())
    if "masters" in out:
        out["params"] = [w.to(p.dtype) for w, p in zip(out["masters"], out["params"])]
    return out


def _rounded(p: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """Where ``p`` is ``master`` rounded to p's dtype: to nearest even or, in bfloat16, truncated (the
    Triton interpreter converts float32 to bfloat16 by truncation); NaN where the master is NaN."""
    ok = (p == master.to(p.dtype)) | (p.isnan() & master.isnan())
    if p.dtype == torch.bfloat16:
        ok |= p == (master.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
    return ok


def assert_as_torch(got: dict[str, list[torch.Tensor]], want: dict[str, list[torch.Tensor]], grads: list[torch.Tensor],
                    rtol: float = 1e-5) -> None:
    """NaN exactly where torch has NaN, the same infinities, finite values to float32 rounding (masters
    to a few roundings of an update); with masters every copy its master rounded; grads untouched.
    The second moments' rtol is wider: the kernels take 1 - beta2 in float32 from the float32 beta2
    (as torch's fused CUDA kernel does), torch.optim.AdamW rounds the double 1 - beta2; for beta2 =
    0.999 the two coefficients differ by 1.3e-5 relative (float32(0.999) is 0.99900001)."""
    for i in range(len(grads)):
        what = f"tensor {i}"
        torch.testing.assert_close(target(got)[i], target(want)[i], rtol=10 * rtol, atol=1e-5, equal_nan=True, msg=lambda m: f"{what} weights: {m}")
        torch.testing.assert_close(got["exp_avgs"][i], want["exp_avgs"][i], rtol=rtol, atol=1e-7, equal_nan=True, msg=lambda m: f"{what} exp_avgs: {m}")
        torch.testing.assert_close(got["exp_avg_sqs"][i], want["exp_avg_sqs"][i], rtol=3 * rtol, atol=1e-9, equal_nan=True, msg=lambda m: f"{what} exp_avg_sqs: {m}")
        if "masters" in got:
            assert bool(_rounded(got["params"][i], got["masters"][i]).all()), f"copy {i} is not its master rounded"
        assert torch.equal(got["grads"][i].isnan(), grads[i].isnan()) and torch.equal(got["grads"][i].nan_to_num(), grads[i].nan_to_num()), f"grads[{i}] written"


def special_positions(state: dict[str, list[torch.Tensor]]) -> int:
    """How many elements of the state hold a special value (a check that the cases are there)."""
    return sum(int((~t.isfinite()).sum()) for k in ("grads", "exp_avgs", "exp_avg_sqs") for t in state[k])
