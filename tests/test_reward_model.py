"""Bradley-Terry reward-model loss: hand-derived numbers, the last-token read-out (padded == packed), margin,
centering, gradients to the value head, validation."""

from __future__ import annotations

import math

import pytest
import torch

from ludic_fast.data.pair_batching import PreferencePair, collate_pairs
from ludic_fast.losses import BradleyTerryLoss, sequence_rewards


def test_hand_derived_loss_and_stats():
    r = torch.tensor([2.0, 1.0, 0.0, 1.5])  # pairs: (2, 1) and (0, 1.5)
    loss, stats = BradleyTerryLoss()({}, rewards=r)
    expected = (math.log1p(math.exp(-1.0)) + math.log1p(math.exp(1.5))) / 2
    assert abs(float(loss) - expected) < 1e-6
    assert float(stats["rewards_accuracy"]) == 0.5
    assert abs(float(stats["rewards_margin"]) - (-0.25)) < 1e-6
    margin = {"margin": torch.tensor([1.0, 0.0])}
    loss_m, _ = BradleyTerryLoss(center_rewards_coefficient=0.1)(margin, rewards=r)
    expected_m = (math.log1p(math.exp(0.0)) + math.log1p(math.exp(1.5))) / 2 + 0.1 * (9.0 + 2.25) / 2
    assert abs(float(loss_m) - expected_m) < 1e-6


def test_last_token_readout_padded_equals_packed_and_grads():
    pairs = [PreferencePair([5, 6], [7, 8, 9], [3]), PreferencePair([1], [2, 2], [4, 4, 4, 4])]
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(10, 4, generator=g)
    head = torch.nn.Linear(4, 1)
    out = {}
    for layout in ("padded", "packed"):
        b = collate_pairs(pairs, layout=layout)
        r = sequence_rewards(b, emb[b["input_ids"]], head.weight, head.bias)
        out[layout] = r
    last_tokens = torch.tensor([9, 3, 2, 4])
    assert torch.allclose(out["padded"], (emb[last_tokens] @ head.weight.T + head.bias).squeeze(1).float())
    assert torch.allclose(out["padded"], out["packed"])
    b = collate_pairs(pairs)
    loss, _ = BradleyTerryLoss()(b, hidden=emb[b["input_ids"]], weight=head.weight, bias=head.bias)
    loss.backward()
    assert head.weight.grad is not None and head.weight.grad.abs().sum() > 0


def test_validation():
    with pytest.raises(ValueError, match="exactly one"):
        BradleyTerryLoss()({})
    with pytest.raises(ValueError, match="even"):
        BradleyTerryLoss()({}, rewards=torch.zeros(3))
    with pytest.raises(ValueError, match="center_rewards_coefficient"):
        BradleyTerryLoss(center_rewards_coefficient=-1.0)
    b = collate_pairs([PreferencePair([1], [2], [3])])
    with pytest.raises(ValueError, match="weight must hold"):
        sequence_rewards(b, torch.zeros(2, 2, 4), torch.zeros(3))


def test_pad_token_read_position_matches_transformers_rule():
    # pad = eos = 0 appended to every response (TRL's setup when the tokenizer has no pad token): with
    # pad_token_id=0 the reward is read at the token before the trailing eos, as transformers'
    # *ForSequenceClassification reads "the last non-pad token"; by default at the eos itself
    pairs = [PreferencePair([5, 6], [7, 8, 0], [3, 0]), PreferencePair([1], [2, 0], [4, 4, 9, 0])]
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(10, 4, generator=g)
    w = torch.randn(1, 4, generator=g)
    for layout in ("padded", "packed"):
        b = collate_pairs(pairs, layout=layout, pad_token_id=0)
        h = emb[b["input_ids"]]
        assert torch.equal(sequence_rewards(b, h, w, pad_token_id=0), (emb[torch.tensor([8, 3, 2, 9])] @ w.T)[:, 0])
        assert torch.equal(sequence_rewards(b, h, w), (emb[torch.tensor([0, 0, 0, 0])] @ w.T)[:, 0])
    b = collate_pairs([PreferencePair([0], [0], [3])], pad_token_id=0)
    with pytest.raises(ValueError, match="pad_token_id=0"):
        sequence_rewards(b, torch.zeros(2, 2, 4), torch.zeros(4), pad_token_id=0)
    with pytest.raises(ValueError, match="pad_token_id"):
        BradleyTerryLoss(pad_token_id=0)({}, rewards=torch.zeros(2))


def test_float64_rewards_and_loss():
    # float64 hidden states and head: rewards and loss stay float64, equal to the float64 formula to 1e-12
    pairs = [PreferencePair([5, 6], [7, 8, 9], [3]), PreferencePair([1], [2, 2], [4, 4, 4, 4])]
    b = collate_pairs(pairs)
    g = torch.Generator().manual_seed(2)
    h = torch.randn(*b["input_ids"].shape, 4, generator=g, dtype=torch.float64)
    w, c = torch.randn(1, 4, generator=g, dtype=torch.float64), torch.randn(1, generator=g, dtype=torch.float64)
    r = sequence_rewards(b, h, w, c)
    last = b["attention_mask"].sum(1) - 1
    expected = h[torch.arange(4), last] @ w[0] + c[0]
    assert r.dtype == torch.float64 and float((r - expected).abs().max()) <= 1e-12
    loss, _ = BradleyTerryLoss(center_rewards_coefficient=0.01)(b, hidden=h, weight=w, bias=c)
    d = expected[0::2] - expected[1::2]
    want = torch.log1p(torch.exp(-d)).mean() + 0.01 * (expected[0::2] + expected[1::2]).square().mean()
    assert loss.dtype == torch.float64 and abs(float(loss - want)) <= 1e-12
