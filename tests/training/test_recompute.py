"""hal.nn.recompute and hal.optimize(recompute=...): a model's repeated blocks recompute their
activations in the backward. The gradients are those of the model without recomputation (the same
ops on the same inputs), eagerly and under torch.compile; a compiled step saves fewer bytes for its
backward (selective fewer than none, full fewer than selective); a block that would write a
key/value cache does not; hal.optimize recomputes in its 'hal' variant only, your model untouched
until that variant wins, and says so in explain(). Peak device memory and time are measured on the
device (benchmarks/levers40.py --parts memory); these run on the CPU.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hal
import hal.nn
from hal.nn.recompute import blocks, policy_of, recompute

transformers = pytest.importorskip("transformers")


def _tiny_llama(seed: int, layers: int = 3) -> nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32, initializer_range=0.3)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def _loss_and_grads(model: nn.Module, ids: torch.Tensor, compiled: bool = False) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """The loss, every parameter's gradient, and the bytes the (compiled) forward saved for the backward."""
    model.zero_grad(set_to_none=True)
    run = torch.compile(model) if compiled else model
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], saved[0]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_blocks_are_the_repeated_children_of_module_lists() -> None:
    model = _tiny_llama(1)
    found = blocks(model)
    assert found == list(model.model.layers)
    inner = nn.Sequential(nn.ModuleList([nn.Linear(4, 4), nn.ReLU()]), nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]))
    assert blocks(inner) == list(inner[1])  # a list of two different classes holds no repeated block
    with pytest.raises(ValueError, match="policy must be one of 'selective', 'full'"):
        recompute(model, "some")


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_gradients_are_those_without_recompute_eager_and_compiled(policy: str) -> None:
    model = hal.nn.patch(_tiny_llama(2))
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    want_loss, want, _ = _loss_and_grads(model, ids)
    _, _, held = _loss_and_grads(model, ids, compiled=True)
    state = copy.deepcopy(model.state_dict())
    assert recompute(model, policy) == 3 and policy_of(model) == policy
    assert list(model.state_dict()) == list(state) and all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    loss, got, _ = _loss_and_grads(model, ids)
    assert torch.equal(loss, want_loss)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    torch._dynamo.reset()
    loss, got, saved = _loss_and_grads(model, ids, compiled=True)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    assert saved < held, f"a compiled step recomputing ({policy}) saved {saved} bytes for its backward, holding all {held}"
    assert recompute(model, None) == 3 and policy_of(model) is None
    assert type(model.model.layers[0]) is transformers.models.llama.modeling_llama.LlamaDecoderLayer


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_kernel_choices_measured_inside_a_recomputed_block(policy: str, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """HAL_TUNE=on with an empty cache: hal measures its kernel choices on the first forward, inside
    the checkpointed block. What the measurement runs is no part of the block: before the fix its
    saved tensors reached checkpointing's hooks (32 saved in the forward, 28 in the recomputation:
    CheckpointError) and its ops selective checkpointing's cache."""
    from hal import dispatch

    model = hal.nn.patch(_tiny_llama(6))
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(6))
    want_loss, want, _ = _loss_and_grads(model, ids)
    monkeypatch.setenv("HAL_TUNE", "on")
    monkeypatch.setenv("HAL_TUNE_CACHE", str(tmp_path / "tune"))
    dispatch.reset()
    try:
        recompute(model, policy)
        loss, got, _ = _loss_and_grads(model, ids)
        assert any((tmp_path / "tune").rglob("*.json")), "nothing was measured"
    finally:
        dispatch.reset()
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_full_recompute_saves_less_than_selective_under_compile() -> None:
    model = hal.nn.patch(_tiny_llama(3))
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    saved = {}
    for policy in ("selective", "full"):
        recompute(model, policy)
        torch._dynamo.reset()
        saved[policy] = _loss_and_grads(model, ids, compiled=True)[2]
    assert saved["full"] < saved["selective"], saved


def test_a_recomputed_block_writes_no_cache_and_generation_still_does() -> None:
    model = hal.nn.patch(_tiny_llama(4))
    recompute(model, "full")
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(4))
    out = model(input_ids=ids, labels=ids, use_cache=True)
    out.loss.backward()  # recomputed once: a second cache write would change the keys' length and fail the backward
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    cache = out.past_key_values
    assert cache is None or cache.get_seq_length() == 0
    model.eval()
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=3, do_sample=False)
    recompute(model, None)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False), want)


def test_optimize_recomputes_in_hal_variant_only_until_it_wins() -> None:
    model = _tiny_llama(5)
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 64, (2, 8), generator=gen) for _ in range(3)]
    step = hal.optimize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), compile=False, recompute="selective",
                        candidates=["torch eager", "hal eager"], margin=0.99)  # the margin keeps torch's: yours untouched
    assert "recompute  selective: 3 blocks (LlamaDecoderLayer x3)" in step.explain()
    assert step.report.chosen is None and policy_of(model) is None
    losses = [float(step(ids, labels=ids)) for ids in batches]
    assert step.report.chosen == "torch eager" and policy_of(model) is None
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for ids, got in zip(batches, losses):
        loss = reference(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert got == pytest.approx(float(loss), rel=1e-5)

    model = _tiny_llama(5)
    step = hal.optimize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), compile=False, recompute="full", candidates=["hal eager"])
    for ids, want in zip(batches, losses):
        assert float(step(ids, labels=ids)) == pytest.approx(want, rel=1e-4)
    assert step.report.chosen == "hal eager" and policy_of(model) == "full"  # the winner runs on your model, recomputing


def test_optimize_refuses_an_unknown_policy_and_says_when_nothing_repeats() -> None:
    with pytest.raises(ValueError, match="recompute must be None or one of 'selective', 'full'"):
        hal.optimize(_tiny_llama(6), recompute="all")
    mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    step = hal.optimize(mlp, recompute="selective", compile=False)
    assert "no repeated blocks" in step.explain()
