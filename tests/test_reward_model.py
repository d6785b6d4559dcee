"""Bradley-Terry reward-model loss: hand-derived numbers, the last-token read-out (padded == packed), margin,
centering, gradients to the value head, validation."""

from __future__ import annotations

import math

import pytest
import torch

from ludic_fast.pair_batching import PreferencePair, collate_pairs
from ludic_fast.reward_model import BradleyTerryLoss, sequence_rewards


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
