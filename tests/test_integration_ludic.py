"""Ludic drop-in: ludic_fast.losses take Ludic master's constructor arguments (names, order, defaults) and the
batch dict of Ludic's `collate_saw_items`; `integrations.ludic.compute_loss(model, loss, batch)` equals the
reference (Ludic master's numbers) on the model's own logits — loss, stats and gradients."""

from __future__ import annotations

import inspect

import pytest
import torch

from ludic_fast import losses, reference
from ludic_fast.integrations.ludic import compute_loss

transformers = pytest.importorskip("transformers", reason="transformers not installed")

# Ludic master's signatures (joanvelja/ludic @ 321e8d7): positional order and defaults.
LUDIC_SIGNATURES = {
    "ReinforceLoss": [("length_normalize", False), ("old_logp_key", "old_logp_action")],
    "ReinforceBaselineLoss": [("normalize", False), ("length_normalize", False), ("old_logp_key", "old_logp_action")],
    "MaskedCausalLMCrossEntropyLoss": [("length_normalize", True)],
    "ClippedSurrogateLoss": [("clip_eps_low", 3e-4), ("clip_eps_high", 4e-4), ("old_logp_key", "old_logp_action"),
                             ("length_normalize", False), ("ratio_clip", None)],
    "TokenClippedSurrogateLoss": [("clip_eps_low", 0.2), ("clip_eps_high", 0.27), ("length_normalize", False),
                                  ("ratio_clip", None)],
    "CISPOLoss": [("clip_eps_low", 1e6), ("clip_eps_high", 0.2), ("length_normalize", True)],
    "TokenKLLoss": [("coeff", 0.01), ("length_normalize", True)],
    "KLLoss": [("coeff", 1.0), ("old_logp_key", "old_logp_action"), ("length_normalize", False)],
    "EntropyBonus": [("coeff", 0.01)],
    "LossTerm": [("name", inspect.Parameter.empty), ("loss", inspect.Parameter.empty), ("weight", 1.0)],
}


@pytest.mark.parametrize("name", sorted(LUDIC_SIGNATURES))
def test_constructor_arguments_are_ludics(name):
    params = list(inspect.signature(getattr(losses, name)).parameters.values())
    positional = [(p.name, p.default) for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional[: len(LUDIC_SIGNATURES[name])] == LUDIC_SIGNATURES[name]


def ludic_batch(vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A batch exactly as Ludic's collate_saw_items builds it: right padding, float32 action_mask and weight,
    actor_logps zero-filled off the action tokens, old_logp_action = their sum."""
    g = torch.Generator().manual_seed(seed)
    lengths, prompt = [9, 7, 9, 5], [3, 2, 4, 2]
    B, T = len(lengths), max(lengths)
    input_ids = torch.zeros(B, T, dtype=torch.long)
    attention_mask = torch.zeros(B, T, dtype=torch.long)
    action_mask = torch.zeros(B, T, dtype=torch.float32)
    for b, (n, p) in enumerate(zip(lengths, prompt)):
        input_ids[b, :n] = torch.randint(1, vocab, (n,), generator=g)
        attention_mask[b, :n] = 1
        action_mask[b, p:n] = 1.0
    actor_logps = torch.where(action_mask > 0, -2.0 + 0.5 * torch.randn(B, T, generator=g), torch.zeros(B, T))
    return {
        "input_ids": input_ids, "attention_mask": attention_mask, "action_mask": action_mask,
        "weight": torch.tensor([1.0, -0.5, 0.25, -1.5]),
        "actor_logps": actor_logps, "old_logp_action": actor_logps.sum(-1),
    }


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=89, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    m = transformers.AutoModelForCausalLM.from_config(cfg).float().train()
    with torch.no_grad():
        m.get_output_embeddings().weight.mul_(5.0)
    return m


CASES = {
    "reinforce": ("ReinforceLoss", dict(length_normalize=True)),
    "reinforce_baseline": ("ReinforceBaselineLoss", dict(normalize=True)),
    "sft": ("MaskedCausalLMCrossEntropyLoss", dict()),
    "gspo": ("ClippedSurrogateLoss", dict(clip_eps_low=0.01, clip_eps_high=0.02, length_normalize=True)),
    "token_clip": ("TokenClippedSurrogateLoss", dict(clip_eps_low=0.2, clip_eps_high=0.27, ratio_clip=3.0)),
    "cispo": ("CISPOLoss", dict(clip_eps_high=0.1)),
    "token_kl": ("TokenKLLoss", dict(coeff=0.05)),
    "kl": ("KLLoss", dict(coeff=0.5, length_normalize=True)),
    "entropy": ("EntropyBonus", dict(coeff=0.1)),
}


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check(model, ours, ref, batch):
    model.zero_grad(set_to_none=True)
    loss, stats = compute_loss(model, ours, batch)
    loss.backward()
    fused = _grads(model)
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    ref_loss, ref_stats = ref(batch, logits=logits)
    ref_loss.backward()
    expected = _grads(model)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert set(ref_stats) <= set(stats)
    for key, value in ref_stats.items():
        torch.testing.assert_close(torch.as_tensor(stats[key]).float(), torch.as_tensor(value).float(),
                                   rtol=1e-4, atol=1e-6, msg=key)
    assert fused.keys() == expected.keys()
    for name, g in expected.items():
        torch.testing.assert_close(fused[name], g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("case", sorted(CASES))
def test_ludic_batch_and_arguments_unchanged(model, case):
    name, kwargs = CASES[case]
    batch = ludic_batch(model.config.vocab_size)
    _check(model, getattr(losses, name)(**kwargs), getattr(reference, name)(**kwargs), batch)


def test_composite_loss_of_ludic_terms_one_head_pass(model):
    """Ludic master's CompositeLoss cannot hold SFT or EntropyBonus terms (`shared=`); ours can."""
    batch = ludic_batch(model.config.vocab_size, seed=1)

    def terms(mod):
        return [mod.LossTerm("cispo", mod.CISPOLoss(), 1.0), mod.LossTerm("kl", mod.TokenKLLoss(coeff=0.1), 0.5),
                mod.LossTerm("sft", mod.MaskedCausalLMCrossEntropyLoss(), 0.2),
                mod.LossTerm("ent", mod.EntropyBonus(coeff=0.05), 1.0)]

    _check(model, losses.CompositeLoss(terms(losses)), reference.CompositeLoss(terms(reference)), batch)


def test_entropy_bonus_differs_from_ludic_master_by_one_position(model):
    """The documented difference: Ludic master reads H one position late (reference shifted=False)."""
    batch = ludic_batch(model.config.vocab_size, seed=2)
    with torch.no_grad():
        ours, _ = compute_loss(model, losses.EntropyBonus(coeff=1.0), batch)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        master, _ = reference.EntropyBonus(coeff=1.0, shifted=False)(batch, logits=logits)
    assert abs(float(ours) - float(master)) > 1e-3
