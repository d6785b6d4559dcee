"""Shared fixtures of the loss tests (random Ludic batches, packed twins, the loss cases) and TokenBatch tests."""

from __future__ import annotations

import math

import pytest
import torch

from ludic_fast import losses as L
from ludic_fast import reference as R
from ludic_fast.token_batch import TokenBatch

B, T, D, V = 4, 9, 16, 37
LENGTHS = [9, 7, 5, 8]  # row b holds positions [0, LENGTHS[b]); right padding after
PROMPTS = [2, 3, 5, 1]  # row 2 has no action token (prompt fills it)
#: sequence advantages of both signs, so every A < 0 branch (dual clip, low clip) runs (test_losses_parity)
ADV_SIGNS = torch.tensor([1.0, -1.0, 1.0, -1.0])


def draw_rows(g: torch.Generator, lengths: list[int], prompts: list[int], dtype: torch.dtype):
    """Right-padded rows of T = max(lengths) positions: (hidden [B,T,D], weight [V,D], bias [V] leaves,
    input_ids, attention_mask, action_mask over [prompt, length), true token logprobs [B,T] (0 at t=0))."""
    n_rows, t = len(lengths), max(lengths)
    h = (torch.randn(n_rows, t, D, generator=g) * 0.7).to(dtype).requires_grad_(True)
    W = (torch.randn(V, D, generator=g) * 0.7).to(dtype).requires_grad_(True)
    b = (torch.randn(V, generator=g) * 0.3).to(dtype).requires_grad_(True)
    ids = torch.randint(0, V, (n_rows, t), generator=g)
    attn = torch.zeros(n_rows, t, dtype=torch.long)
    amask = torch.zeros(n_rows, t)
    for r, (n, p) in enumerate(zip(lengths, prompts)):
        attn[r, :n] = 1
        amask[r, p:n] = 1.0
    with torch.no_grad():
        lp_true = torch.zeros(n_rows, t)
        lp_true[:, 1:] = R.compute_token_logp(R.head_logits(h, W, b), ids)
    return h, W, b, ids, attn, amask, lp_true


def make_batch(seed: int = 0, dtype: torch.dtype = torch.float32, token_adv: bool = False):
    """(batch, hidden [B,T,D], weight [V,D], bias [V]) with ratios spread around 1 and every optional key."""
    g = torch.Generator().manual_seed(seed)
    h, W, b, ids, attn, amask, lp_true = draw_rows(g, LENGTHS, PROMPTS, dtype)
    actor = (lp_true + 0.4 * torch.randn(B, T, generator=g)) * amask
    batch = {
        "input_ids": ids,
        "attention_mask": attn,
        "action_mask": amask,
        "weight": torch.randn(B, generator=g).abs() * ADV_SIGNS,
        "actor_logps": actor,
        "old_logp_action": actor.sum(1),
        "ref_logps": (lp_true + 0.3 * torch.randn(B, T, generator=g)) * amask,
        "is_weights": torch.where(amask > 0, torch.exp(0.5 * torch.randn(B, T, generator=g)), torch.ones(B, T)),
        "group_id": torch.tensor([7, 7, 3, 3]),
        "zvp_direction": torch.tensor([1.0, 0.0, -1.0, -1.0]),
    }
    if token_adv:
        batch["advantages"] = torch.randn(B, T, generator=g) * amask
    return batch, h, W, b


def to_packed(batch: dict, *per_position):
    """The packed twin of a right-padded batch: rows concatenated over their attention_mask lengths,
    cu_seqlens [S+1]; each extra tensor [B, T, ...] is packed the same way (differentiably, so grads reach
    the padded leaf)."""
    lengths = batch["attention_mask"].sum(1).tolist()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])

    def pack(x):
        return torch.cat([x[r, :n] for r, n in enumerate(lengths)])[None]

    out = {k: pack(v) if v.ndim == 2 else v for k, v in batch.items()}
    out["cu_seqlens"] = cu
    return (out, *(pack(x) for x in per_position))


# (id, ours, reference twin): every loss and option combination checked against its twin
CASES = [
    ("reinforce", L.ReinforceLoss(), R.ReinforceLoss()),
    ("reinforce_ln", L.ReinforceLoss(length_normalize=True), R.ReinforceLoss(length_normalize=True)),
    ("reinforce_baseline", L.ReinforceBaselineLoss(normalize=True), R.ReinforceBaselineLoss(normalize=True)),
    ("sft", L.MaskedCausalLMCrossEntropyLoss(), R.MaskedCausalLMCrossEntropyLoss()),
    ("sft_sum", L.MaskedCausalLMCrossEntropyLoss(False), R.MaskedCausalLMCrossEntropyLoss(False)),
    ("gspo", L.ClippedSurrogateLoss(0.1, 0.1, length_normalize=True, ratio_clip=1.3),
     R.ClippedSurrogateLoss(0.1, 0.1, length_normalize=True, ratio_clip=1.3)),
    ("gspo_token", L.ClippedSurrogateLoss(0.1, 0.1, length_normalize=True, ratio_level="token"),
     R.GSPOTokenLoss(0.1, 0.1, length_normalize=True)),
    ("token_clipped", L.TokenClippedSurrogateLoss(), R.TokenClippedSurrogateLoss()),
    ("token_clipped_ln_delta", L.TokenClippedSurrogateLoss(0.1, 0.1, True, ratio_clip=1.5),
     R.TokenClippedSurrogateLoss(0.1, 0.1, True, ratio_clip=1.5)),
    ("cispo", L.CISPOLoss(), R.CISPOLoss()),
    ("cispo_sum_lowclip", L.CISPOLoss(0.2, 0.1, False), R.CISPOLoss(0.2, 0.1, False)),
    ("token_kl", L.TokenKLLoss(), R.TokenKLLoss()),
    ("kl", L.KLLoss(length_normalize=True), R.KLLoss(length_normalize=True)),
    ("entropy_bonus", L.EntropyBonus(0.1), R.EntropyBonus(0.1)),
    ("zvp_cispo", L.ZVPCISPOLoss(), R.ZVPCISPOLoss()),
    ("scalerl", L.ScaleRLLoss(eps_max=1.2), R.ScaleRLLoss(eps_max=1.2)),
    ("sapo", L.SAPOLoss(), R.SAPOLoss()),
    ("ppo_token_mean_dual_k3is", L.TokenClippedSurrogateLoss(aggregation="token_mean", dual_clip=1.5, kl_coeff=0.05,
                                                             kl_is_correct=True),
     R.TokenSurrogateLoss("ppo", aggregation="token_mean", dual_clip=1.5, kl_coeff=0.05, kl_is_correct=True)),
    ("ppo_drgrpo_tis_k2", L.TokenClippedSurrogateLoss(aggregation="seq_mean_token_sum_norm", norm_length=9,
                                                      is_level="token", is_bounds=(0.5, 1.5), kl_coeff=0.1,
                                                      kl_estimator="k2"),
     R.TokenSurrogateLoss("ppo", aggregation="seq_mean_token_sum_norm", norm_length=9, is_level="token",
                          is_bounds=(0.5, 1.5), kl_coeff=0.1, kl_estimator="k2")),
    ("ppo_prompt_mis_seq_entropy", L.TokenClippedSurrogateLoss(aggregation="prompt_mean", is_level="sequence",
                                                               is_mode="mask", is_bounds=(0.2, 3.0),
                                                               entropy_coeff=0.02),
     R.TokenSurrogateLoss("ppo", aggregation="prompt_mean", is_level="sequence", is_mode="mask",
                          is_bounds=(0.2, 3.0), entropy_coeff=0.02)),
    ("ppo_zvp_toprho", L.TokenClippedSurrogateLoss(length_normalize=True, alpha_zvp=0.2, entropy_top_rho=0.5),
     R.TokenSurrogateLoss("ppo", length_normalize=True, alpha_zvp=0.2, entropy_top_rho=0.5)),
    ("cispo_abs_normalizer_k1", L.CISPOLoss(clip_eps_high=1.1, cispo_bound="absolute", aggregation="token_mean",
                                            normalizer=7.0, kl_coeff=0.1, kl_estimator="k1"),
     R.TokenSurrogateLoss("cispo", clip_eps_high=1.1, cispo_bound="absolute", aggregation="token_mean",
                          normalizer=7.0, kl_coeff=0.1, kl_estimator="k1")),
    ("cispo_seqnorm_tis_seq", L.CISPOLoss(normalizer=3.0, is_level="sequence", is_bounds=(0.0, 1.5)),
     R.TokenSurrogateLoss("cispo", 1e6, 0.2, True, normalizer=3.0, is_level="sequence", is_bounds=(0.0, 1.5))),
    ("sapo_token_mean_entropy", L.SAPOLoss(aggregation="token_mean", entropy_coeff=0.01),
     R.SAPOLoss(aggregation="token_mean", entropy_coeff=0.01)),
    ("composite", L.CompositeLoss([L.LossTerm("pg", L.CISPOLoss()), L.LossTerm("kl", L.TokenKLLoss(), 0.5),
                                   L.LossTerm("ent", L.EntropyBonus(), 2.0)]),
     R.CompositeLoss([R.LossTerm("pg", R.CISPOLoss()), R.LossTerm("kl", R.TokenKLLoss(), 0.5),
                      R.LossTerm("ent", R.EntropyBonus(), 2.0)])),
    ("composite_coupled", L.CompositeLoss([L.LossTerm("zvp", L.ZVPCISPOLoss()), L.LossTerm("sft",
                                           L.MaskedCausalLMCrossEntropyLoss(), 0.1)]),
     R.CompositeLoss([R.LossTerm("zvp", R.ZVPCISPOLoss()), R.LossTerm("sft", R.MaskedCausalLMCrossEntropyLoss(),
                                                                         0.1)])),
]
CASE_IDS = [c[0] for c in CASES]
TOKEN_ADV_CASES = [
    ("ppo_token_adv", L.TokenClippedSurrogateLoss(length_normalize=True),
     R.TokenSurrogateLoss("ppo", length_normalize=True)),
    ("gspo_token_adv", L.ClippedSurrogateLoss(0.1, 0.1, length_normalize=True, ratio_level="token"),
     R.GSPOTokenLoss(0.1, 0.1, length_normalize=True)),
]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(max |b|, 1e-6)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-6)) if b.numel() else 0.0


# ----------------------------------------------------------------------------------------- tests
def test_token_batch_padded_selects_shifted_action_positions():
    ids = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]])
    amask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    batch = {"input_ids": ids, "action_mask": amask, "actor_logps": torch.arange(8.0).reshape(2, 4),
             "weight": torch.tensor([1.0, 2.0])}
    tb = TokenBatch.from_batch(batch)
    assert tb.rows.tolist() == [0, 1, 6]  # position j scores token j+1
    assert tb.targets.tolist() == [6, 7, 4]
    assert tb.seq.tolist() == [0, 0, 1]
    assert tb.token("actor_logps", "t").tolist() == [1.0, 2.0, 7.0]
    assert tb.seqs["counts"].tolist() == [2.0, 1.0]
    assert tb.advantages("t").tolist() == [1.0, 1.0, 2.0]


def test_token_batch_packed_shift_never_crosses_a_boundary():
    # sequences [5 6 7] [8 9] [3]: every token after the first of a sequence is an action
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 3]]), "action_mask": torch.tensor([[0, 1, 1, 1, 1, 1.0]]),
             "cu_seqlens": torch.tensor([0, 3, 5, 6]), "group_id": torch.tensor([4, 9, 4])}
    tb = TokenBatch.from_batch(batch)
    assert tb.rows.tolist() == [0, 1, 3]  # position 2 would score token 8 of the next sequence
    assert tb.targets.tolist() == [6, 7, 9]
    assert tb.seq.tolist() == [0, 0, 1]
    assert tb.seqs["raw_counts"].tolist() == [2.0, 1.0, 0.0]
    assert tb.seqs["prompt"].tolist() == [0, 1, 0] and int(tb.seqs["n_prompts"]) == 2
    coef = tb.agg_coef("prompt_mean")  # prompt 4 has 2 tokens, prompt 9 has 1; 2 prompts
    assert torch.allclose(coef, torch.tensor([1 / 4, 1 / 4, 1 / 2]))


def test_agg_coef_formulas():
    batch, *_ = make_batch()
    tb = TokenBatch.from_batch(batch)
    counts = tb.seqs["counts"][tb.seq]
    total = float(batch["action_mask"][:, 1:].sum())
    assert torch.allclose(tb.agg_coef("token_mean"), torch.full_like(counts, 1 / total))
    assert torch.allclose(tb.agg_coef("seq_mean_token_mean"), 1 / (counts * B))
    assert torch.allclose(tb.agg_coef("seq_mean_token_sum", normalizer=10.0), torch.full_like(counts, 0.1))
    assert torch.allclose(tb.agg_coef("seq_mean_token_sum_norm", norm_length=8), torch.full_like(counts, 1 / 32))
    with pytest.raises(ValueError, match="norm_length"):
        tb.agg_coef("seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="aggregation"):
        tb.agg_coef("token_sum")
    assert math.isclose(float(tb.total_mask), total)


def test_bad_batches_name_the_argument():
    batch, h, W, _ = make_batch()
    with pytest.raises(ValueError, match="action_mask"):
        TokenBatch.from_batch({"input_ids": batch["input_ids"], "action_mask": batch["action_mask"][:, 1:]})
    with pytest.raises(ValueError, match="actor_logps"):
        TokenBatch.from_batch({**batch, "actor_logps": batch["actor_logps"][:, 1:]})
    with pytest.raises(ValueError, match="weight"):
        TokenBatch.from_batch({**batch, "weight": batch["weight"][:2]})
    with pytest.raises(KeyError, match="actor_logps"):
        L.CISPOLoss()({k: v for k, v in batch.items() if k != "actor_logps"}, hidden=h, weight=W)
    with pytest.raises(ValueError, match="exactly one"):
        L.CISPOLoss()(batch)
    with pytest.raises(ValueError, match="hidden"):
        L.CISPOLoss()(batch, hidden=h[:, 1:], weight=W)
    with pytest.raises(ValueError, match="aggregation"):
        L.CISPOLoss(aggregation="sum")
    with pytest.raises(KeyError, match="group_id"):
        L.ScaleRLLoss()({k: v for k, v in batch.items() if k != "group_id"}, hidden=h, weight=W)
    with pytest.raises(KeyError, match="zvp_direction"):
        L.ZVPCISPOLoss()({k: v for k, v in batch.items() if k != "zvp_direction"}, hidden=h, weight=W)
    with pytest.raises(ValueError, match="dual_clip"):
        L.TokenClippedSurrogateLoss(dual_clip=0.5)
