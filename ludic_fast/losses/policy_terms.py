"""Per-token terms of the policy losses, written once: the library's losses and the TRL and verl integrations
all call these (their float64 twins in `ludic_fast.reference` stay independent: they are the spec).

    ppo_clip_loss  l_t = -min(r_t A_t, clip(r_t, low, high) A_t),  PPO (arXiv 1707.06347); dual clip c > 1:
                   l_t = min(l_t, -c A_t) where A_t < 0           (Ye et al., arXiv 1912.09729)
    cispo_weight   w_t = sg(clip(r_t, low, high))            CISPO (MiniMax-M1, arXiv 2506.13585): l_t = -w_t A_t lp_t
    sapo_gate      g_t = (4 / τ_t) σ(τ_t (r_t - 1)),         SAPO (arXiv 2511.20347): l_t = -g_t A_t
                   τ_t = tau_pos if A_t > 0 else tau_neg
    kl_estimate    k1 = d, k2 = d²/2, k3 = e^{-d} - 1 + d,   d = lp_t - ref_lp_t (Schulman, "Approximating KL
                                                             Divergence", 2020): per-token KL(π ‖ π_ref) on π's samples

CISPO's bounds: relative (1 - ε_lo, 1 + ε_hi) in Ludic and verl, an absolute cap (None, ε_max) in TRL and
ScaleRL. r_t = exp(lp_t - old_lp_t) is the importance ratio (token or, broadcast, sequence level).
"""

from __future__ import annotations

import torch
from torch import Tensor

KL_ESTIMATORS = ("k1", "k2", "k3")


def ppo_clip_loss(ratio: Tensor, adv: Tensor, low: float, high: float, *, ratio_cap: float | None = None,
                  dual_clip: float | None = None) -> Tensor:
    """The PPO clipped surrogate per token, the one definition in the library (no kernel computes it):
    l = -min(r' A, clip(r, low, high) A), r' = min(r, ratio_cap)
    (r' = r when ratio_cap is None; TRL's δ caps the unclipped term only), and with `dual_clip` c > 1,
    l = min(l, -c A) where A < 0. `low`, `high` are the ratio bounds 1 - ε_low, 1 + ε_high."""
    unclipped = ratio if ratio_cap is None else torch.clamp(ratio, max=ratio_cap)
    loss = -torch.minimum(unclipped * adv, torch.clamp(ratio, low, high) * adv)
    if dual_clip is None:
        return loss
    return torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)


def cispo_weight(ratio: Tensor, low: float | None, high: float | None) -> Tensor:
    """sg(clip(r, low, high)): the ratio clipped to [low, high] (a None bound is open) and detached."""
    return torch.clamp(ratio.detach(), min=low, max=high)


def sapo_gate(ratio: Tensor, adv: Tensor, tau_pos: float, tau_neg: float) -> Tensor:
    """(4 / τ) σ(τ (r - 1)) per token, τ = tau_pos where adv > 0 else tau_neg (in the ratio's dtype);
    differentiable in r (its derivative at r = 1 is 1, the on-policy gradient of the ratio)."""
    tau = torch.where(adv > 0, ratio.new_tensor(tau_pos), ratio.new_tensor(tau_neg))
    return (4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0))


def kl_estimate(log_ratio: Tensor, estimator: str = "k3") -> Tensor:
    """The per-token estimator `estimator` (k1, k2 or k3) of KL(π ‖ π_ref) at d = log π - log π_ref."""
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio * log_ratio
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1.0 + log_ratio
    raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


__all__ = ["KL_ESTIMATORS", "cispo_weight", "kl_estimate", "ppo_clip_loss", "sapo_gate"]
