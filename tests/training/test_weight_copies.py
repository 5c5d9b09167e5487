"""hal.nn.weight_copies: linears that read a half-precision copy of their weight compute autocast's
numbers, never read a stale copy, leave tied weights alone, compile without a graph break, and carry
hal.optimize's step at autocast's losses; hal.optim.AdamW writes the copies in its own step
(WeightCopies.hand_to) to the bit of the step followed by a separate copy.

On the CPU torch has no GEMM with a float32 output for bfloat16 operands, so the weight gradient is
the bfloat16 product widened, as autocast's is: outputs and the input's and weight's gradients are
compared bit for bit; the bias gradient is summed in float32 here (bfloat16 under autocast), so it
agrees to bfloat16 rounding.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hal
import hal.optim
from hal.nn import weight_copies
from hal.nn.weight_copies import CopyLinear, WeightCopies


def _autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _grads(layer: nn.Linear, x: torch.Tensor, gy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.detach().requires_grad_()
    layer.zero_grad(set_to_none=True)
    with _autocast():
        y = layer(x)
    y.backward(gy)
    return y.detach(), x.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(6, 24), (2, 5, 24)])
def test_linear_on_its_copy_computes_autocasts_numbers(bias: bool, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    plain = nn.Linear(24, 40, bias=bias)
    model = nn.Sequential(copy.deepcopy(plain))
    copies = WeightCopies(model, torch.bfloat16)
    assert len(copies) == 1 and type(model[0]) is CopyLinear
    x, gy = torch.randn(shape), torch.randn(*shape[:-1], 40)
    x[..., 3] = float("nan")  # NaN propagates as in autocast's linear
    want = _grads(plain, x, gy)
    with copies.active():
        got = _grads(model[0], x, gy)
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None
            continue
        assert g.dtype == w.dtype and g.shape == w.shape, i
        if i == 3:  # bias gradient: float32 sum against autocast's bfloat16 sum
            torch.testing.assert_close(g, w, rtol=1e-2, atol=1e-2, equal_nan=True)
        else:
            assert torch.equal(g.isnan(), w.isnan()), i
            assert torch.equal(g.nan_to_num(), w.nan_to_num()), i


def test_outside_the_step_it_is_nn_linear() -> None:
    torch.manual_seed(1)
    plain = nn.Linear(16, 8)
    model = nn.Sequential(copy.deepcopy(plain))
    copies = WeightCopies(model, torch.bfloat16)
    with torch.no_grad():
        copies._entries[0].copy.zero_()  # a copy that is wrong on purpose: must not be read outside active()
        copies._entries[0].version = model[0].weight._version
    x = torch.randn(4, 16)
    with _autocast():
        assert torch.equal(model[0](x), plain(x))
    assert torch.equal(model[0](x), plain(x))  # no autocast: float32
    with copies.active(), torch.autocast("cpu", dtype=torch.float16):  # autocast to another dtype than the copy's
        assert torch.equal(model[0](x), plain(x))


def test_a_weight_changed_outside_the_step_is_copied_again() -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(16, 8))
    copies = WeightCopies(model, torch.bfloat16)
    x = torch.randn(4, 16)
    with torch.no_grad():
        model[0].weight.mul_(-3.0)  # in place: the version counter moves
    with copies.active(), _autocast():
        got = model[0](x)
    with _autocast():
        want = F.linear(x, model[0].weight, model[0].bias)
    assert torch.equal(got, want)
    model.load_state_dict({"0.weight": torch.randn(8, 16), "0.bias": torch.randn(8)})  # loaded weights too
    assert copies.refresh() == 1
    assert torch.equal(copies._entries[0].copy, model[0].weight.detach().to(torch.bfloat16))
    assert copies.refresh() == 0


def test_tied_and_non_float32_weights_have_no_copy() -> None:
    emb = nn.Embedding(10, 8)
    head = nn.Linear(8, 10, bias=False)
    head.weight = emb.weight
    half = nn.Linear(8, 8).to(torch.bfloat16)
    frozen = nn.Linear(8, 8).requires_grad_(False)
    model = nn.ModuleDict({"emb": emb, "head": head, "low": half, "frozen": frozen, "free": nn.Linear(8, 8)})
    copies = WeightCopies(model, torch.bfloat16)
    assert len(copies) == 1
    assert [type(m) for m in (head, half, frozen)] == [nn.Linear] * 3 and type(model["free"]) is CopyLinear
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        WeightCopies(model, torch.float32)


def test_compiles_without_a_graph_break_and_matches_eager() -> None:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    copies = WeightCopies(model, torch.bfloat16)
    x = torch.randn(8, 16)

    def loss_of(m: nn.Module) -> torch.Tensor:
        with _autocast():
            return m(x).float().square().mean()

    compiled = torch.compile(loss_of, fullgraph=True)
    with copies.active():
        want = loss_of(model)
        want.backward()
        want_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        got = compiled(model)
        got.backward()
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)
    for g, w in zip((p.grad for p in model.parameters()), want_grads):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-3)


def _tiny_llama(seed: int) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True,
                                   initializer_range=0.3)  # logits far from uniform: the loss feels every weight
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def test_optimize_runs_hf_llama_on_copies_at_autocasts_losses() -> None:
    model = _tiny_llama(4)
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(4)
    batches = [torch.randint(0, 64, (2, 8), generator=gen) for _ in range(4)]
    step = hal.optimize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), amp=torch.bfloat16, compile=False, candidates=["hal eager"])
    losses = [float(step(ids, labels=ids)) for ids in batches[:2]]
    # 7 linears a layer (q, k, v, o, gate, up, down) x 2 layers, and the fused LM head's weight, tied to the embedding
    # (the head reads the copy; the embedding the float32 weight)
    assert "15 weights (14 nn.Linear, 1 _HalHead) read as bfloat16 copies" in step.explain()
    linears = [m for m in model.modules() if isinstance(m, CopyLinear)]
    assert len(linears) == 14 and not isinstance(model.lm_head, CopyLinear)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight_copy, model.lm_head.weight.detach().to(torch.bfloat16))
    assert "written by the optimizer's update kernel" in step.explain()  # hal.optim.AdamW replaced torch's
    for m in linears:  # written in each optimizer step: the weight as autocast would cast it
        assert torch.equal(m.weight_copy, m.weight.detach().to(torch.bfloat16))
    name = "model.layers.0.mlp.down_proj.weight"
    new_weight = 0.3 * torch.randn(32, 48, generator=gen)  # changed between steps, as loading weights would: the next step reads it
    with torch.no_grad():
        dict(model.named_parameters())[name].copy_(new_weight)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    want = []
    for i, ids in enumerate(batches):
        if i == 2:
            with torch.no_grad():
                dict(reference.named_parameters())[name].copy_(new_weight)
        ref_opt.zero_grad(set_to_none=True)
        with _autocast():
            loss = reference(ids, labels=ids).loss
        loss.backward()
        ref_opt.step()
        want.append(float(loss))
    losses += [float(step(ids, labels=ids)) for ids in batches[2:]]
    assert losses == pytest.approx(want, rel=2e-2)  # bfloat16 activations, hal's kernels: about 3 significant digits
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=5e-2, msg=name)  # 4 AdamW steps of lr 1e-2: a missed or wrong step moves by ~1e-2 each


class _ExactClasses(nn.Module):
    """A model that insists on its head being exactly nn.Linear (as code checking types does)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if type(self.head) is not nn.Linear:
            raise TypeError(f"head must be exactly nn.Linear, not {type(self.head).__name__}")
        return self.head(self.body(x))


def test_optimize_measures_hal_again_without_copies_where_they_fail() -> None:
    torch.manual_seed(5)
    model = _ExactClasses()
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    step = hal.optimize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=F.cross_entropy, amp=torch.bfloat16,
                        rewrite="patch", compile=False, candidates=["torch eager", "hal eager"])
    step(x, y)
    r = step.report
    assert "every 'hal' candidate failed with them (TypeError: head must be exactly nn.Linear, not CopyLinear)" in r.weights
    assert {t.name: t.median_ms is not None for t in r.trials} == {"torch eager": True, "hal eager": True}
    assert not any(isinstance(m, CopyLinear) for m in [*model.modules(), *step.model.modules()])


class _TwoLinears(nn.Module):
    """Nothing hal.nn.patch knows (no Sequential, no transformers module): hal's variant is your
    model with hal's optimizer, and its linears are yours."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.softsign(self.fc1(x)))


def test_your_linears_get_no_copies_where_nothing_was_patched() -> None:
    torch.manual_seed(6)
    model = _TwoLinears()
    step = hal.optimize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=F.cross_entropy, amp=torch.bfloat16,
                        rewrite="patch", compile=False)
    assert "hal.nn.patch found no module it knows" in step.report.rewrite.reason
    assert step.report.weights.startswith("as they are")
    step(torch.randn(4, 8), torch.randint(0, 3, (4,)))
    assert type(model.fc1) is nn.Linear and type(model.fc2) is nn.Linear


# --- copies written by hal.optim.AdamW in its step (WeightCopies.hand_to) ------------------------------


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8))


def _train_step(model: nn.Module, copies: WeightCopies, opt: torch.optim.Optimizer, x: torch.Tensor,
                found_inf: Optional[torch.Tensor] = None) -> None:
    """hal.optimize's step: forward and backward on the copies, the optimizer step, then write()."""
    with copies.active():
        with _autocast():
            loss = model(x).float().square().mean()
        loss.backward()
        if found_inf is None:
            opt.step()
        else:
            opt.step(found_inf=found_inf)
        copies.write()
    opt.zero_grad(set_to_none=True)


def _twins(seed: int) -> tuple[list[nn.Module], list[WeightCopies], list[hal.optim.AdamW]]:
    """Two equal models with copies and hal's AdamW: the first's copies handed to its optimizer."""
    models = [_mlp(seed), _mlp(seed)]
    copies = [WeightCopies(m, torch.bfloat16) for m in models]
    opts = [hal.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    assert copies[0].hand_to(opts[0]) == 3 and copies[0].by_optimizer == 3 and copies[1].by_optimizer == 0
    return models, copies, opts


def _assert_same(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    for m, n in zip(a.modules(), b.modules()):
        if isinstance(m, CopyLinear):
            assert torch.equal(m.weight_copy, n.weight_copy)
            assert torch.equal(m.weight_copy, m.weight.detach().to(torch.bfloat16))


def test_adamw_writes_the_copies_in_its_step_to_the_bit_of_a_separate_copy(seed: int) -> None:
    """Weights, copies and optimizer state to the bit of the step followed by write()'s multi-tensor
    copy; the copies are written by opt.step() itself, and write() then leaves them alone."""
    models, copies, opts = _twins(seed)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(3):
        x = torch.randn(4, 16, generator=gen)
        _train_step(models[1], copies[1], opts[1], x)
        with copies[0].active():
            with _autocast():
                loss = models[0](x).float().square().mean()
            loss.backward()
            opts[0].step()
            linears = [m for m in models[0].modules() if isinstance(m, CopyLinear)]
            assert all(torch.equal(m.weight_copy, m.weight.detach().to(torch.bfloat16)) for m in linears)  # written in the step
            versions = [m.weight_copy._version for m in linears]
            copies[0].write()
            assert [m.weight_copy._version for m in linears] == versions  # nothing left for write() to copy
        opts[0].zero_grad(set_to_none=True)
        _assert_same(*models)
        assert copies[0].refresh() == 0  # the versions noted: fresh
    for a, b in zip(opts[0].state_dict()["state"].values(), opts[1].state_dict()["state"].values()):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_skipped_step_leaves_the_copies_valid(seed: int) -> None:
    """found_inf as a tensor (the kernel skips on the device) or a number (nothing runs): weights,
    copies and step counts unchanged, nothing stale; then a real step as the twin's."""
    models, copies, opts = _twins(seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 16, generator=gen)
    for m, c, o in zip(models, copies, opts):
        _train_step(m, c, o, x)
    before = [t.clone() for t in models[0].parameters()]
    for found in (torch.tensor(1.0), 1.0):
        _train_step(models[0], copies[0], opts[0], torch.randn(4, 16, generator=gen), found_inf=found)
        assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), before))
        assert copies[0].refresh() == 0
        _assert_same(*models)
    x = torch.randn(4, 16, generator=gen)
    for m, c, o in zip(models, copies, opts):
        _train_step(m, c, o, x, found_inf=torch.tensor(0.0))
    _assert_same(*models)
    assert float(opts[0].state[models[0][0].weight]["step"]) == 2.0


def test_weights_changed_outside_the_step_are_still_copied_again(seed: int) -> None:
    models, copies, opts = _twins(seed)
    x = torch.randn(4, 16)
    _train_step(models[0], copies[0], opts[0], x)
    with torch.no_grad():
        models[0][2].weight.mul_(-0.5)
    assert copies[0].refresh() == 1
    models[0].load_state_dict(models[1].state_dict())
    assert copies[0].refresh() == 3
    for m in models[0].modules():
        if isinstance(m, CopyLinear):
            assert torch.equal(m.weight_copy, m.weight.detach().to(torch.bfloat16))


def test_copies_the_optimizer_does_not_step_are_written_after_it(seed: int) -> None:
    """hal's AdamW steps the first linear only (its copy written in the step); torch's SGD steps
    the others, whose copies write() writes."""
    model = _mlp(seed)
    copies = WeightCopies(model, torch.bfloat16)
    first = list(model[0].parameters())
    hal_opt = hal.optim.AdamW(first, lr=1e-2)
    sgd = torch.optim.SGD([p for p in model.parameters() if all(p is not q for q in first)], lr=1e-1)
    assert copies.hand_to(hal_opt) == 1
    for _ in range(2):
        with copies.active():
            with _autocast():
                loss = model(torch.randn(4, 16)).float().square().mean()
            loss.backward()
            hal_opt.step()
            sgd.step()
            copies.write()
        model.zero_grad(set_to_none=True)
        for m in model.modules():
            if isinstance(m, CopyLinear):
                assert torch.equal(m.weight_copy, m.weight.detach().to(torch.bfloat16))
    assert copies.hand_to(sgd) == 0  # torch's optimizer writes none: taken back from hal's
    assert copies.by_optimizer == 0 and hal_opt.write_copies(()) == []


def test_copies_handed_over_after_steps_and_state_dicts_round_trip(seed: int) -> None:
    """Copies handed to an optimizer that has stepped (its weights and biases shared one step count:
    each launch then counts on its own), a state_dict saved and loaded into a new hal AdamW that is
    handed the copies, and into torch's AdamW: steps as the twin's that never had copies."""
    models, copies, opts = _twins(seed)
    copies[0].hand_to(torch.optim.SGD(models[0].parameters(), lr=0.0))  # taken back from opts[0] for now
    gen = torch.Generator().manual_seed(seed)
    batches = [torch.randn(4, 16, generator=gen) for _ in range(6)]
    for x in batches[:2]:
        for m, c, o in zip(models, copies, opts):
            _train_step(m, c, o, x)
    assert copies[0].hand_to(opts[0]) == 3
    for x in batches[2:4]:
        for m, c, o in zip(models, copies, opts):
            _train_step(m, c, o, x)
    _assert_same(*models)
    saved = copy.deepcopy(opts[0].state_dict())
    assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in saved["state"].values())  # nothing of the copies
    again = hal.optim.AdamW(models[0].parameters(), lr=1e-2)
    again.load_state_dict(saved)
    assert copies[0].hand_to(again) == 3
    for x in batches[4:]:
        for m, c, o in zip(models, copies, (again, opts[1])):
            _train_step(m, c, o, x)
    _assert_same(*models)
    assert float(again.state[models[0][0].weight]["step"]) == 6.0
    theirs = torch.optim.AdamW(models[0].parameters(), lr=1e-2)
    theirs.load_state_dict(again.state_dict())
    assert float(theirs.state[models[0][4].bias]["step"]) == 6.0


def test_the_fused_lm_head_reads_its_tied_weights_copy_with_autocasts_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """hal.nn.patch's LM head reads its weight through weight_in: inside active() the copy (no cast
    in the step), outside it the weight cast; the loss and the tied weight's float32 gradient (the
    embedding's and the head's summed) are those of autocast's cast."""
    model = hal.nn.patch(_tiny_llama(6))
    head, embedding = model.lm_head, model.model.embed_tokens
    assert head.weight is embedding.weight and type(head).reads_weight_copy
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(6))

    def loss_and_grad(copies: Optional[WeightCopies]) -> tuple[torch.Tensor, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with copies.active() if copies is not None else contextlib.nullcontext(), _autocast():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), head.weight.grad.clone()

    want_loss, want_grad = loss_and_grad(None)
    copies = WeightCopies(model, torch.bfloat16)
    assert copies.readers == {"nn.Linear": 14, "_HalHead": 1}
    reads = []
    original = weight_copies._ReadCopy.apply
    monkeypatch.setattr(weight_copies._ReadCopy, "apply", lambda w, c: reads.append(c) or original(w, c))  # a spy: it still runs
    loss, grad = loss_and_grad(copies)
    assert len(reads) == 1 and reads[0] is head.weight_copy  # the head read its copy, not a cast
    reads.clear()
    loss_and_grad(None)
    assert not reads  # outside the step: the weight cast, as nn.Linear under autocast
    assert grad.dtype == torch.float32
    torch.testing.assert_close(loss, want_loss, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(grad, want_grad, rtol=2e-2, atol=2e-3)
    copies.detach(model)
    assert "weight_copy" not in head.__dict__
