"""The PPO clipped surrogate, CISPO's weight, SAPO's gate and the KL estimators (`ludic_fast.losses.policy_terms`,
the one home the losses and the TRL / verl integrations share) on hand-derived numbers."""

from __future__ import annotations

import math

import pytest
import torch

from ludic_fast.losses.policy_terms import cispo_weight, kl_estimate, ppo_clip_loss, sapo_gate


def test_ppo_clip_loss_by_hand():
    # bounds [0.8, 1.2]; (r, A): above / below the range, positive / negative advantage
    r = torch.tensor([1.5, 0.5, 1.5, 0.5], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    loss = ppo_clip_loss(r, adv, 0.8, 1.2)
    assert loss.tolist() == pytest.approx([-1.2, -0.5, 1.5, 0.8], rel=1e-15)  # -min(rA, clip(r)A)
    (grad,) = torch.autograd.grad(loss.sum(), r)
    assert grad.tolist() == [0.0, -1.0, 1.0, 0.0]  # -A where the unclipped term is the minimum, else 0
    # dual clip c = 1.3 caps the A < 0 loss at -cA = 1.3 (the r = 1.5 token), the rest unchanged
    assert ppo_clip_loss(r, adv, 0.8, 1.2, dual_clip=1.3).tolist() == pytest.approx([-1.2, -0.5, 1.3, 0.8], rel=1e-15)
    # ratio_cap 1.4 caps the unclipped term only: -min(min(r, 1.4) A, clip(r) A)
    assert ppo_clip_loss(r, adv, 0.8, 1.2, ratio_cap=1.4).tolist() == pytest.approx([-1.2, -0.5, 1.4, 0.8], rel=1e-15)


def test_cispo_weight_clips_and_detaches():
    r = torch.tensor([0.5, 1.0, 2.0], requires_grad=True)
    w = cispo_weight(r, 0.8, 1.2)
    assert w.tolist() == pytest.approx([0.8, 1.0, 1.2]) and not w.requires_grad
    assert cispo_weight(r, None, 1.5).tolist() == pytest.approx([0.5, 1.0, 1.5])  # TRL's absolute cap


def test_sapo_gate_value_and_slope_at_ratio_one():
    r = torch.ones(2, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    g = sapo_gate(r, adv, 1.0, 1.05)
    assert g.dtype == torch.float64
    assert g.tolist() == [2.0, 2.0 / 1.05]  # (4/τ) σ(0), τ exact in float64
    (grad,) = torch.autograd.grad(g.sum(), r)
    assert grad.tolist() == pytest.approx([1.0, 1.0], rel=1e-15)  # (4/τ) τ σ'(0) = 1


def test_kl_estimators():
    d = torch.tensor([math.log(2.0)], dtype=torch.float64)
    assert kl_estimate(d, "k1").item() == pytest.approx(math.log(2.0), rel=1e-15)
    assert kl_estimate(d, "k2").item() == pytest.approx(math.log(2.0) ** 2 / 2, rel=1e-15)
    assert kl_estimate(d).item() == pytest.approx(0.5 - 1.0 + math.log(2.0), rel=1e-15)  # k3 = e^{-d} - 1 + d
    with pytest.raises(ValueError, match="estimator must be one of"):
        kl_estimate(d, "k4")
