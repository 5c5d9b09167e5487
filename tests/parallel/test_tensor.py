"""hal.parallel.tensor on real gloo groups: each tensor/sequence-parallel layer against one process.

Every rank builds the whole layer from the seed with torch's own modules and ops (``nn.Linear``,
``F.gelu``, ``F.rms_norm``, ``F.scaled_dot_product_attention``, ...), computes the single-process
loss, gradients and three optimizer steps, and compares its own share: its part of the output
(the sequence under sequence parallelism), the input's gradient, its shards of the parameters'
gradients and of the parameters after the steps. float64 to rounding; float32 within its
tolerance; bfloat16 autocast within bfloat16's (a norm-wise relative error). The cost model's
arithmetic is checked without processes.
"""

from __future__ import annotations

import copy
import math
import traceback
from typing import Any, Callable, Optional, Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hal.dist.launch import launch

pytestmark = pytest.mark.timeout(240)

TOL = {torch.float64: dict(rtol=1e-9, atol=1e-11), torch.float32: dict(rtol=1e-4, atol=1e-5)}
#: under bfloat16 autocast the parallel result may be at most 3 times as far from the float32 truth
#: as the single-process bfloat16 runs are (the farthest of BF16_RUNS of them), plus one rounding of
#: bfloat16 (norm-wise): its partial sums are rounded to bfloat16 on every rank before they are
#: added, where one GEMM rounds once.
#:
#: Several single-process runs, not one: a gradient that bfloat16 computes badly (layer 0's q_proj
#: of a Llama, whose gradient comes through attention's dS = P (dP - rowsum(dP P)), a difference of
#: near-equal terms) is 2 to 10 times bfloat16's rounding away from float32, and *which* roundings
#: land decides how far: torch's own single-process run of the same model with its weights scaled
#: by 1 + 10^-3 N(0, 1) (the float32 truth taken from the same weights) lands 0.030 to 0.095 from
#: float32 at step 1 over 15 such runs where the unscaled one lands 0.034 (HAL_TEST_SEED=366844190,
#: docs/parallel.md). One run's distance is one draw of that spread: 3 times a low draw failed a
#: parallel run that is as good as torch's (hal's attention backward is the more exact one: 0.0017
#: from float64 for q's gradient against torch's flash kernel's 0.0057, on the same bf16 inputs).
#: The runs beside the reference take its weights scaled by 1 + BF16_JITTER N(0, 1), each with its
#: own float32 truth: the spread of bfloat16's error at this point, which the bound scales with.
BF16_FACTOR, BF16_MARGIN = 3.0, 2.0**-8
BF16_RUNS, BF16_JITTER = 4, 2.0**-10


#: the ranks check each collective's arguments across the group (HAL_DIST_CHECK): a check that fails on
#: one rank only then fails its peers' next collective with InvalidArgumentError, where gloo would abort
CHECKED = {"HAL_DIST_CHECK": "1"}


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """got == want element-wise within the tolerance of ``dtype`` (float64 or float32)."""
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    torch.testing.assert_close(got, want, **TOL[dtype], msg=lambda m: f"{what}: {m}")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def agree(got: torch.Tensor, want: torch.Tensor, truth: Optional[torch.Tensor], dtype: torch.dtype, what: str,
          runs: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> None:
    """The parallel result ``got`` equals the single-process ``want``: within ``dtype``'s tolerance,
    or under bfloat16 autocast about as close to ``truth`` (the single process in float32) as the
    single-process bfloat16 runs are to theirs: ``want`` and ``runs``' (bfloat16, float32) pairs
    (see BF16_FACTOR, BF16_MARGIN, BF16_RUNS)."""
    if dtype != torch.bfloat16:
        close(got, want, dtype, what)
        return
    assert truth is not None and got.shape == want.shape == truth.shape, f"{what}: shapes {got.shape} {want.shape}"
    e_got, e_ref = _rel(got, truth), _rel(want, truth)
    e_runs = [_rel(b, f) for b, f in runs]
    e_max = max([e_ref] + e_runs)
    assert e_got <= BF16_FACTOR * e_max + BF16_MARGIN, (
        f"{what}: {e_got:.3g} from float32, the single-process bfloat16 run {e_ref:.3g}"
        + (f" (and {len(e_runs)} runs from jittered weights: {', '.join(f'{e:.3g}' for e in e_runs)})" if e_runs else ""))


def local_tensor_of(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    from hal.parallel.tensor import local_tensor

    return local_tensor(t)


def shard(t: Optional[torch.Tensor], dim: Optional[int], n: int, rank: int) -> Optional[torch.Tensor]:
    return t if t is None or dim is None else t.chunk(n, dim)[rank]


def shard_map(module: nn.Module) -> dict[str, Optional[int]]:
    """{parameter name: split dimension or None} of a module holding parallel layers."""
    from hal.parallel.state import _shards

    return {k: dim for k, (dim, _) in _shards(module).items()}


def optimizer(params: Any, dtype: torch.dtype) -> torch.optim.Optimizer:
    """AdamW in float64; SGD with momentum in float32 and under bfloat16 autocast (Adam's first
    steps are about sign(g) · lr: a gradient near zero that rounding changes moves its weight by
    up to 2 lr, which would test Adam's sensitivity rather than the layer)."""
    if dtype != torch.float64:
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-6, weight_decay=0.01)


Outputs = dict[str, torch.Tensor]


def _jittered(ref: nn.Module, run: int) -> nn.Module:
    """A copy of ``ref`` with every floating-point parameter scaled by 1 + BF16_JITTER N(0, 1)
    (from a generator of its own: the same on every rank and every call)."""
    gen = torch.Generator().manual_seed(0x5EED + run)
    m = copy.deepcopy(ref)
    with torch.no_grad():
        for p in m.parameters():
            if p.is_floating_point():
                p.mul_(1 + BF16_JITTER * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype))
    return m


def raise_together(failures: list[str], what: str) -> None:
    """Every rank raises when any rank has ``failures`` (one all-reduce over the default group, which
    every rank of these tests calls this from): a comparison that fails on one rank must not leave
    its peers in collectives it never joins (the next check's collectives would pair with them)."""
    import torch.distributed as dist

    flag = torch.tensor([1 if failures else 0], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if failures:
        shown = failures[:8] + ([f"... and {len(failures) - 8} more"] if len(failures) > 8 else [])
        raise AssertionError(f"{what}: {len(failures)} comparison(s) failed on this rank:\n" + "\n".join(shown))
    if int(flag):
        raise AssertionError(f"{what}: a comparison failed on another rank (its report says which); this rank's passed")


def train_compare(ref: nn.Module, par: nn.Module, ref_loss: Callable[[nn.Module], tuple[torch.Tensor, Outputs]],
                  par_loss: Callable[[], tuple[torch.Tensor, Outputs]], n: int, rank: int, dtype: torch.dtype, *,
                  local: Callable[[torch.Tensor], torch.Tensor] = (lambda t: t), steps: int = 3,
                  grad_sync: Optional[Callable[[nn.Module], None]] = None) -> None:
    """Train the reference ``ref`` and the parallel ``par`` for ``steps`` steps (under bfloat16
    autocast for ``dtype`` bfloat16, beside a float32 copy of the reference: the truth, and
    BF16_RUNS - 1 more single-process bfloat16 runs from jittered weights, each beside its own
    float32 truth); compare each step's outputs (a leaf that requires grad: its gradient; ``local``
    takes this rank's part of a reference tensor) and every parameter's gradient (this rank's
    shard), and the parameters after the last step. ``par_loss`` returns this rank's loss term (the
    ranks' terms add up to the reference's loss, or each equals it); ``grad_sync`` runs after its
    backward (data parallelism). Every step runs whatever the comparisons say (the collectives stay
    in step on every rank); then every rank raises if a comparison failed on any (:func:`raise_together`)."""
    from hal.parallel import param_groups

    dims = shard_map(par)
    half = dtype == torch.bfloat16
    truth = copy.deepcopy(ref) if half else None
    # (bfloat16 run, its float32 truth) from jittered weights: the spread of bfloat16's error (BF16_RUNS)
    extra = [(j, copy.deepcopy(j)) for j in (_jittered(ref, r) for r in range(1, BF16_RUNS))] if half else []
    named = [dict(m.named_parameters()) if m is not None else None for m in (ref, par, truth)]
    named_extra = [(dict(b.named_parameters()), dict(f.named_parameters())) for b, f in extra]
    assert set(named[0]) == set(named[1]), f"parameter names differ: {set(named[0]) ^ set(named[1])}"
    opts = [optimizer(ref.parameters(), dtype), optimizer(param_groups(par), dtype)]
    if truth is not None:
        opts.append(optimizer(truth.parameters(), dtype))
    for b, f in extra:
        opts += [optimizer(b.parameters(), dtype), optimizer(f.parameters(), dtype)]
    failures: list[str] = []

    def check(*args: Any, **kwargs: Any) -> None:
        try:
            agree(*args, **kwargs)
        except AssertionError as exc:
            failures.append(str(exc))

    def value(t: torch.Tensor) -> torch.Tensor:
        return t.grad if t.is_leaf and t.requires_grad else t

    for step in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=half):
            loss_r, outs_r = ref_loss(ref)
        loss_r.backward()
        outs_t: Outputs = {}
        if truth is not None:
            loss_t, outs_t = ref_loss(truth)
            loss_t.backward()
        outs_extra = []
        for b, f in extra:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss_b, outs_b = ref_loss(b)
            loss_b.backward()
            loss_f, outs_f = ref_loss(f)
            loss_f.backward()
            outs_extra.append((outs_b, outs_f))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=half):
            loss_p, outs_p = par_loss()
        loss_p.backward()
        if grad_sync is not None:
            grad_sync(par)
        for key, t in outs_p.items():
            truth_value = local(value(outs_t[key])) if truth is not None else None
            runs = [(local(value(ob[key])), local(value(of[key]))) for ob, of in outs_extra]
            check(value(t), local(value(outs_r[key])), truth_value, dtype, f"step {step} {key}", runs)
        for name, p in named[1].items():
            dim = dims.get(name)
            truth_grad = shard(named[2][name].grad, dim, n, rank) if truth is not None else None
            runs = [(shard(nb[name].grad, dim, n, rank), shard(nf[name].grad, dim, n, rank)) for nb, nf in named_extra]
            check(local_tensor_of(p.grad), shard(named[0][name].grad, dim, n, rank), truth_grad, dtype, f"step {step} grad {name}",
                  runs)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for name, p in named[1].items():
        dim = dims.get(name)
        truth_p = shard(named[2][name].detach(), dim, n, rank) if truth is not None else None
        runs = [(shard(nb[name].detach(), dim, n, rank), shard(nf[name].detach(), dim, n, rank)) for nb, nf in named_extra]
        check(local_tensor_of(p.detach()), shard(named[0][name].detach(), dim, n, rank), truth_p, dtype, f"parameter {name}", runs)
    raise_together(failures, "train_compare")


def run_checks(checks: list[tuple[str, Callable[[], None]]], timeout_s: float = 120.0) -> dict[str, str]:
    """Run the checks in order on every rank: {check name: traceback} of those that failed here.

    After each check the ranks tell each other how it went, on a process group of their own (its
    collectives cannot pair with a check's). A check that failed on any rank ends the run on every
    rank: a rank that left a check early leaves its peers in collectives it never joined, and the
    next check's collectives would pair with theirs (a second, misleading failure: a mismatched
    scatter, a closed connection). The failing ranks report the failure and the checks not run;
    the others report nothing more. ``timeout_s`` bounds the wait for a peer (longer than the
    process group's timeout, after which a peer stuck in a collective fails its check)."""
    import datetime

    import torch.distributed as dist

    side = None
    if dist.is_initialized() and dist.get_world_size() > 1:
        side = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    failures: dict[str, str] = {}
    for index, (name, fn) in enumerate(checks):
        try:
            fn()
        except Exception:  # reported per check
            failures[name] = traceback.format_exc()
        if side is None:
            continue
        mine = torch.tensor([index, 1 if name in failures else 0], dtype=torch.int64)
        rows = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        try:
            dist.all_gather(rows, mine, group=side)
        except Exception:  # a peer died or never came: nothing later can be trusted
            failures[f"{name} (outcome)"] = ("the ranks could not agree on this check's outcome; not run: "
                                             + ", ".join(c for c, _ in checks[index + 1:]) + "\n" + traceback.format_exc())
            break
        failed = [r for r, row in enumerate(rows) if int(row[1])]
        if failed:
            rest = [c for c, _ in checks[index + 1:]]
            if name in failures and rest:
                failures["(not run)"] = (f"{name!r} failed on rank(s) {failed}: every rank stops after it, the ranks may be out "
                                         f"of step; not run: {', '.join(rest)}")
            break
    return failures


def _mesh(n: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))


def _checks(rank: int, n: int, seed: int) -> dict[str, str]:
    from hal.parallel import (ColumnParallelLinear, ParallelAttention, ParallelLayerNorm, ParallelMLP, ParallelRMSNorm,
                              RowParallelLinear)

    mesh = _mesh(n)
    B, T, D, FF = 2, 4 * n, 8, 12 if n <= 2 else 16
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, dtype: torch.dtype = torch.float64, scale: float = 1.0) -> torch.Tensor:
        return ((torch.randn(shape, generator=gen, dtype=torch.float64) + 0.1) * scale).to(dtype)

    def linear(k: int, m: int, bias: bool, dtype: torch.dtype) -> nn.Linear:
        lin = nn.Linear(k, m, bias=bias, dtype=torch.float64)
        with torch.no_grad():
            lin.weight.copy_(randn(m, k, scale=1 / math.sqrt(k)))
            if bias:
                lin.bias.copy_(randn(m, scale=0.2))
        return lin.to(dtype)

    def local_seq(t: torch.Tensor, sp: bool) -> torch.Tensor:
        return t.chunk(n, 1)[rank] if sp else t

    def param_dtype(dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if dtype == torch.bfloat16 else dtype

    def compare(ref: nn.Module, par: nn.Module, ref_fwd: Callable[[nn.Module, torch.Tensor], torch.Tensor],
                par_fwd: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, sp: bool, dtype: torch.dtype) -> None:
        """Train both on ``sum(f(x) * w)``; compare outputs and the input's gradient too (this rank's
        part of the sequence under sequence parallelism)."""
        w = randn(*x.shape)

        def ref_loss(m: nn.Module) -> tuple[torch.Tensor, Any]:
            xr = x.clone().requires_grad_(True)
            y = ref_fwd(m, xr)
            return (y.double() * w).sum(), {"output": y, "input gradient": xr}

        def par_loss() -> tuple[torch.Tensor, Any]:
            xp = local_seq(x, sp).clone().requires_grad_(True)
            y = par_fwd(xp)
            return (y.double() * local_seq(w, sp)).sum(), {"output": y, "input gradient": xp}

        train_compare(ref, par, ref_loss, par_loss, n, rank, dtype, local=lambda t: local_seq(t, sp))

    def column_row(dtype: torch.dtype, sp: bool, overlap: bool = False, chunks: int = 2, act: str = "gelu",
                   dtensor: bool = False, input_parallel: bool = True) -> Callable[[], None]:
        """column (bias, fused act) -> row (bias) against nn.Linear -> act -> nn.Linear."""

        def check() -> None:
            pd = param_dtype(dtype)
            ref = nn.ModuleDict({"up": linear(D, FF, True, pd), "down": linear(FF, D, True, pd)})
            opts = dict(mesh=mesh, sequence_parallel=sp, dtensor=dtensor)
            par = nn.ModuleDict({"up": ColumnParallelLinear.from_linear(ref["up"], act, overlap=overlap, chunks=chunks,
                                                                        gather_output=not input_parallel, **opts),
                                 "down": RowParallelLinear.from_linear(ref["down"], input_is_parallel=input_parallel, **opts)})
            act_fn = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu, "none": (lambda v: v)}[act]
            compare(ref, par, lambda m, x: m["down"](act_fn(m["up"](x))), lambda x: par["down"](par["up"](x)),
                    randn(B, T, D, dtype=pd), sp, dtype)
            if dtensor:
                from torch.distributed.tensor import DTensor, Replicate, Shard

                assert isinstance(par["up"].weight, DTensor) and par["up"].weight.placements == (Shard(0),)
                assert par["down"].weight.placements == (Shard(1),) and par["down"].bias.placements == (Replicate(),)
                assert tuple(par["up"].weight.shape) == (FF, D)  # the global shape

        return check

    def norms(dtype: torch.dtype, kind: str, sp: bool = True) -> Callable[[], None]:
        """Parallel RMSNorm / LayerNorm on the local sequence against nn.RMSNorm / nn.LayerNorm."""

        def check() -> None:
            pd = param_dtype(dtype)
            base = nn.RMSNorm(D, eps=1e-5, dtype=pd) if kind == "rms" else nn.LayerNorm(D, eps=1e-5, dtype=pd)
            with torch.no_grad():
                for p in base.parameters():
                    p.copy_(randn(*p.shape, dtype=pd, scale=0.5) + 1)
            ref = nn.ModuleDict({"norm": base})
            cls = ParallelRMSNorm if kind == "rms" else ParallelLayerNorm
            par = nn.ModuleDict({"norm": cls.from_module(base, mesh=mesh, sequence_parallel=sp)})
            compare(ref, par, lambda m, x: m["norm"](x), par["norm"], randn(B, T, D, dtype=pd) * 2, sp, dtype)

        return check

    class RefAttention(nn.Module):
        """Causal self-attention with rotary embeddings and grouped key/value heads, in torch ops."""

        def __init__(self, heads: int, kv: int, pd: torch.dtype) -> None:
            super().__init__()
            hd = D // heads
            self.heads, self.kv, self.hd = heads, kv, hd
            self.q_proj, self.k_proj = linear(D, heads * hd, False, pd), linear(D, kv * hd, False, pd)
            self.v_proj, self.o_proj = linear(D, kv * hd, False, pd), linear(heads * hd, D, False, pd)

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
            b, t, _ = x.shape

            def rope(v: torch.Tensor) -> torch.Tensor:  # in float32 (float64), rounded once: as hal's op
                wide = torch.float64 if v.dtype == torch.float64 else torch.float32
                v1, v2 = v.to(wide).chunk(2, -1)
                c, s = cos.to(wide), sin.to(wide)
                return torch.cat((v1 * c - v2 * s, v2 * c + v1 * s), -1).to(v.dtype)

            q = rope(self.q_proj(x).view(b, t, self.heads, self.hd).transpose(1, 2))
            k = rope(self.k_proj(x).view(b, t, self.kv, self.hd).transpose(1, 2))
            v = self.v_proj(x).view(b, t, self.kv, self.hd).transpose(1, 2)
            rep = self.heads // self.kv
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
            return self.o_proj(a.transpose(1, 2).reshape(b, t, -1))

    def attention(dtype: torch.dtype, sp: bool, overlap: bool = False, masked: bool = False) -> Callable[[], None]:
        """ParallelAttention (heads split, GQA, rotary) against RefAttention."""

        def check() -> None:
            pd = param_dtype(dtype)
            heads, kv = 4, 2 if n == 2 else 4
            ref_att = RefAttention(heads, kv, pd)
            ref = nn.ModuleDict({"att": ref_att})
            par = nn.ModuleDict({"att": ParallelAttention.from_projections(
                ref_att.q_proj, ref_att.k_proj, ref_att.v_proj, ref_att.o_proj, heads, kv, D // heads, mesh=mesh,
                sequence_parallel=sp, overlap=overlap, chunks=3)})
            angles = randn(T, D // heads // 2) * 2
            cos, sin = angles.cos().to(pd), angles.sin().to(pd)
            mask = None
            if masked:  # a padding mask per batch row, with causality, as a boolean (B, 1, T, T)
                keep = torch.ones(B, T, dtype=torch.bool)
                keep[1, :2] = False
                mask = torch.tril(torch.ones(T, T, dtype=torch.bool)) & keep[:, None, None, :]
                mask[:, :, :, 0] = True  # every query row sees something
            compare(ref, par, lambda m, x: m["att"](x, cos, sin, mask), lambda x: par["att"](x, cos, sin, mask, is_causal=mask is None),
                    randn(B, T, D, dtype=pd), sp, dtype)

        return check

    def mlp(dtype: torch.dtype, sp: bool, act: str, overlap: bool = False) -> Callable[[], None]:
        """ParallelMLP (SwiGLU, or the activation fused into the gate's epilogue) against torch."""

        def check() -> None:
            pd = param_dtype(dtype)
            ref = nn.ModuleDict({"gate_proj": linear(D, FF, False, pd), "up_proj": linear(D, FF, False, pd),
                                 "down_proj": linear(FF, D, False, pd)})
            fn = {"silu": F.silu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}[act]
            par = ParallelMLP.from_projections(ref["gate_proj"], ref["up_proj"], ref["down_proj"], act, mesh=mesh,
                                               sequence_parallel=sp, overlap=overlap)
            assert par.gate_proj.act == ("none" if act == "silu" else act)
            compare(ref, par, lambda m, x: m["down_proj"](fn(m["gate_proj"](x)) * m["up_proj"](x)), par,
                    randn(B, T, D, dtype=pd), sp, dtype)

        return check

    def overlap_goes_through_hal_dist() -> None:
        """The overlapped layer issues its chunked all-gathers and the reduce-scatter through hal.dist
        (asynchronously), after its agreement check (also through hal.dist)."""
        up = linear(D, FF, False, torch.float64)
        layer = ColumnParallelLinear.from_linear(up, mesh=mesh, sequence_parallel=True, overlap=True, chunks=4)
        calls: list[str] = []
        import hal.dist as hd

        originals = {name: getattr(hd, name) for name in ("all_gather", "reduce_scatter")}

        def spy(name: str) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                calls.append(f"{name}:{kwargs.get('async_op', False)}")
                return originals[name](*args, **kwargs)
            return call

        try:
            for name in originals:
                setattr(hd, name, spy(name))
            x = randn(B, T // n, D).requires_grad_(True)
            layer(x).sum().backward()
        finally:
            for name, fn in originals.items():
                setattr(hd, name, fn)
        # first the agreement check's one small synchronous all-gather (hal.parallel.checks), then the pieces
        assert calls == ["all_gather:False"] + ["all_gather:True"] * 4 + ["reduce_scatter:True"], calls

    def bad_arguments() -> None:
        from hal.errors import InvalidArgumentError

        def expect(fn: Callable[[], Any], *fragments: str) -> None:
            try:
                fn()
            except InvalidArgumentError as exc:
                assert all(f in str(exc) for f in fragments), str(exc)
                return
            raise AssertionError("InvalidArgumentError not raised")

        expect(lambda: ColumnParallelLinear(8, 4 * n + 1, mesh=mesh), "out_features", f"{n} ranks")
        expect(lambda: RowParallelLinear(4 * n + 1, 8, mesh=mesh), "in_features")
        expect(lambda: ColumnParallelLinear(8, 4 * n, mesh=mesh, overlap=True), "overlap", "sequence_parallel")
        expect(lambda: ColumnParallelLinear(8, 4 * n, act="swish", mesh=mesh), "act", "gelu")
        expect(lambda: ColumnParallelLinear(8, 4 * n, dtensor=True), "DeviceMesh")
        expect(lambda: ParallelAttention(16, 3, head_dim=2 * n, mesh=mesh), "num_heads")

    checks: list[tuple[str, Callable[[], None]]] = []
    f64, f32, bf16 = torch.float64, torch.float32, torch.bfloat16
    for dtype in (f64, f32, bf16):
        for sp in (False, True):
            short = {f64: "f64", f32: "f32", bf16: "bf16"}[dtype]
            checks.append((f"column_row {short} sp={sp}", column_row(dtype, sp)))
    checks += [
        ("column_row f64 sp overlap chunks=3", column_row(f64, True, overlap=True, chunks=3)),
        ("column_row f64 sp overlap chunks=1 act=none", column_row(f64, True, overlap=True, chunks=1, act="none")),
        ("column_row f32 sp overlap act=none", column_row(f32, True, overlap=True, act="none")),
        ("column_row bf16 sp overlap", column_row(bf16, True, overlap=True, chunks=3)),
        ("column_row f64 dtensor", column_row(f64, False, dtensor=True)),
        ("column_row f64 sp overlap dtensor", column_row(f64, True, overlap=True, dtensor=True)),
        ("column gather_output -> row scatter", column_row(f64, False, act="relu", input_parallel=False)),
        ("rms_norm f64 sp", norms(f64, "rms")), ("layer_norm f64 sp", norms(f64, "layer")),
        ("rms_norm f32 sp", norms(f32, "rms")), ("layer_norm bf16 sp", norms(bf16, "layer")),
        ("rms_norm f64 replicated", norms(f64, "rms", sp=False)),
        ("attention f64", attention(f64, False)), ("attention f64 sp overlap", attention(f64, True, overlap=True)),
        ("attention f64 masked sp", attention(f64, True, masked=True)), ("attention f32 sp", attention(f32, True)),
        ("attention bf16", attention(bf16, False)),
        ("mlp swiglu f64 sp", mlp(f64, True, "silu")), ("mlp gelu epilogue f64", mlp(f64, False, "gelu_tanh")),
        ("mlp swiglu bf16 sp overlap", mlp(bf16, True, "silu", overlap=True)),
        ("overlap goes through hal.dist", overlap_goes_through_hal_dist),
        ("bad arguments", bad_arguments),
    ]
    if n > 2:  # the larger group: the float64 checks and one bfloat16 one (start-up is what costs here)
        checks = [(name, fn) for name, fn in checks if "32" not in name and ("bf16" not in name or "overlap" in name)]
    return run_checks(checks)


@pytest.mark.parametrize("n", [2, 4])
def test_layers_match_one_process(n: int, seed: int) -> None:
    results = launch(_checks, n, (seed,), timeout_s=200, env=CHECKED)
    bad = [f"rank {r.rank}: {r.message}\n{r.traceback}" for r in results if not r.ok]
    assert not bad, "\n".join(bad)
    failures = {f"rank {r.rank} {k}": v for r in results for k, v in r.value.items()}
    assert not failures, f"HAL_TEST_SEED={seed}\n" + "\n".join(f"{k}:\n{v}" for k, v in list(failures.items())[:6])


# --- the cost model (no processes) ---------------------------------------------------------------------


def test_cost_model_counts_and_overlap() -> None:
    from hal.parallel import cost

    kw = dict(batch=2, seq=1024, hidden=4096, tp=8, in_features=4096, out_features=16384)
    tp = cost.layer_costs("column", strategy="tp", **kw)
    sp = cost.layer_costs("column", strategy="tp+sp", **kw)
    ov = cost.layer_costs("column", strategy="tp+sp+overlap", chunks=4, **kw)
    m, k, nn_, p = 2 * 1024, 4096, 16384, 8
    assert tp.forward_flops == 2 * m * k * nn_ / p and tp.backward_flops == 2 * tp.forward_flops
    x_bytes = m * k * 2
    assert tp.bytes_sent == pytest.approx(2 * (p - 1) / p * x_bytes)  # one all-reduce of the input's gradient
    assert sp.bytes_sent == pytest.approx(2 * (p - 1) / p * x_bytes)  # all-gather + reduce-scatter: the same bytes
    link = cost.INFINIBAND
    c = sp.comms[0].seconds(link)
    assert c == pytest.approx((p - 1) * 5e-6 + (p - 1) / p * x_bytes / 50e9)
    # overlapped: less exposed than not, never less than the best the strategy allows
    assert ov.exposed_seconds(link) < sp.exposed_seconds(link) == sp.comm_seconds(link)
    assert ov.exposed_seconds(link) >= ov.exposed_seconds(link, allowed=True) - 1e-15
    # NVLink is faster than InfiniBand; one rank moves nothing
    assert sp.comm_seconds(cost.NVLINK_H200) < sp.comm_seconds(link)
    assert cost.layer_costs("block", batch=1, seq=8, hidden=64, heads=4, ffn=128, tp=1).bytes_sent == 0
    rows = cost.costs(batch=4, seq=1024, hidden=1024, heads=16, ffn=2816, tp=8)
    assert {r["strategy"] for r in rows} == set(cost.STRATEGIES) and len(rows) == 6 * 3
    table = cost.format_table(rows)
    assert "block" in table and "tp+sp+overlap" in table and "exposed NVLink" in table and "InfiniBand" in table
    with pytest.raises(Exception, match="strategy"):
        cost.layer_costs("column", strategy="fsdp", **kw)
