"""Reference-free preference losses on the fused head: CPO (TRL's CPOTrainer types, AlphaPO), SimPO, ORPO.

L̄ = L / n is the length-normalised sequence log-prob; NLL = -Σ_{chosen tokens} M lp / Σ_{chosen} M, the
SFT term on the chosen responses (token mean over the batch). Values are float64 for float64 inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from ludic_fast.losses.base import Stats, seq_logps
from ludic_fast.losses.preference.common import (
    PairLoss,
    check_beta,
    check_pairs,
    chosen_nll,
    log1mexp,
    pair_stats,
    policy_stats,
    smoothed_sigmoid_loss,
)
from ludic_fast.token_batch import TokenBatch

CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")


def _cpo_objective(lp: Tensor, H: Tensor | None, tb: TokenBatch, with_stats: bool, *, loss_type: str, beta: float,
                   eps: float, gamma: float, alpha: float, nll_coeff: float, owner: str) -> tuple[Tensor, Stats]:
    """mean_pairs ℓ(Δ) + nll_coeff · NLL with ρ = L (L̄ for ipo / simpo) or (1 - e^{-α L})/α, Δ = ρ_w - ρ_l."""
    check_pairs(tb, owner)
    L = seq_logps(lp, tb, loss_type in ("ipo", "simpo"))
    rho = L if alpha == 0.0 else -torch.expm1(-alpha * L) / alpha
    delta = rho[0::2] - rho[1::2]
    if loss_type == "hinge":
        per_pair = torch.relu(1.0 - beta * delta)
    elif loss_type == "ipo":
        per_pair = (delta - 1.0 / (2.0 * beta)).square()
    else:
        per_pair = smoothed_sigmoid_loss(beta * delta - (gamma if loss_type == "simpo" else 0.0), eps)
    nll = chosen_nll(lp, tb) if nll_coeff or with_stats else None
    loss = per_pair.mean() + (nll_coeff * nll if nll_coeff else 0.0)
    if not with_stats:
        return loss, {}
    stats = pair_stats(loss, beta * rho[0::2], beta * rho[1::2], L[0::2], L[1::2])
    stats.update(policy_stats(lp, H, tb, with_reference=False), nll=nll.detach())
    return loss, stats


@dataclass
class CPOLoss(PairLoss):
    """CPO (Xu et al., arXiv 2401.08417) as TRL 1.16's `CPOTrainer`, no reference model: with the policy
    reward ρ = L (L̄ for "ipo" and "simpo"), or the AlphaPO reward ρ = (1 - p^{-α})/α = (1 - e^{-α L})/α
    for `alpha` ≠ 0 (arXiv 2501.03884), and Δ = ρ_w - ρ_l, per pair
      sigmoid  -(1-ε) log σ(βΔ) - ε log σ(-βΔ)
      simpo    -(1-ε) log σ(βΔ - γ) - ε log σ(γ - βΔ)      (γ = simpo_gamma, default 0.5)
      hinge    relu(1 - βΔ)
      ipo      (Δ - 1/(2β))²
    loss = mean_pairs ℓ + cpo_alpha · NLL (NLL on the chosen responses). TRL's "alphapo" is
    loss_type="simpo" with cpo_alpha = 0 and alpha ≠ 0. Defaults as TRL: β 0.1, cpo_alpha 1. Rewards β ρ."""

    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    simpo_gamma: float | None = None
    alpha: float = 0.0
    cpo_alpha: float = 1.0
    entropy_stats: bool = False
    length_normalize: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        check_beta(self.beta, self.label_smoothing)
        if self.loss_type not in CPO_LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {CPO_LOSS_TYPES}, got {self.loss_type!r}")
        if self.label_smoothing and self.loss_type in ("hinge", "ipo"):
            raise ValueError(f"label_smoothing is not read by loss_type {self.loss_type!r} (only sigmoid, simpo)")
        if self.simpo_gamma is not None and self.loss_type != "simpo":
            raise ValueError("simpo_gamma is read only by loss_type 'simpo'")
        if self.cpo_alpha < 0:
            raise ValueError(f"cpo_alpha must be >= 0, got {self.cpo_alpha}")

    def objective(self, lp, H, tb, with_stats):
        gamma = 0.5 if self.simpo_gamma is None else self.simpo_gamma
        return _cpo_objective(lp, H, tb, with_stats, loss_type=self.loss_type, beta=self.beta,
                              eps=self.label_smoothing, gamma=gamma, alpha=self.alpha, nll_coeff=self.cpo_alpha,
                              owner="CPOLoss")


@dataclass
class SimPOLoss(PairLoss):
    """SimPO (Meng et al., arXiv 2405.14734, eq. 6), no reference model: u = β L̄_w - β L̄_l - γ,
    loss = mean_pairs [-(1 - ε) log σ(u) - ε log σ(-u)] + nll_coeff · NLL (Liger's `compute_nll_loss` with
    its `alpha`; 0 is the paper's loss). Defaults β = 2.0, γ = 1.0 (the paper's range β ∈ [2, 2.5] with
    γ/β = 0.5; TRL and Liger default to β 0.1, γ 0.5). Rewards β L̄."""

    beta: float = 2.0
    gamma: float = 1.0
    label_smoothing: float = 0.0
    nll_coeff: float = 0.0
    entropy_stats: bool = False
    length_normalize: bool = field(default=True, init=False, repr=False)

    def __post_init__(self) -> None:
        check_beta(self.beta, self.label_smoothing)
        if self.nll_coeff < 0:
            raise ValueError(f"nll_coeff must be >= 0, got {self.nll_coeff}")

    def objective(self, lp, H, tb, with_stats):
        return _cpo_objective(lp, H, tb, with_stats, loss_type="simpo", beta=self.beta, eps=self.label_smoothing,
                              gamma=self.gamma, alpha=0.0, nll_coeff=self.nll_coeff, owner="SimPOLoss")


@dataclass
class ORPOLoss(PairLoss):
    """ORPO (Hong et al., arXiv 2403.07691, eqs. 6-7), no reference model: with L̄ = L / n,
    log odds(y) = L̄ - log(1 - e^L̄), ℓ = log odds(y_w) - log odds(y_l),
    loss = nll_coeff · NLL + beta · mean_pairs(-log σ(ℓ)), NLL on the chosen responses (TRL's covers the
    prompt too: docs/preference.md). Paper λ = beta = 0.1. Rewards β L̄ (as TRL)."""

    beta: float = 0.1
    nll_coeff: float = 1.0
    entropy_stats: bool = False
    length_normalize: bool = field(default=True, init=False, repr=False)

    def __post_init__(self) -> None:
        check_beta(self.beta)
        if self.nll_coeff < 0:
            raise ValueError(f"nll_coeff must be >= 0, got {self.nll_coeff}")

    def objective(self, lp, H, tb, with_stats):
        lw, ll = self.pair_logps(lp, tb)
        log_odds = (lw - ll) - (log1mexp(lw) - log1mexp(ll))
        ratio = F.logsigmoid(log_odds)
        nll = chosen_nll(lp, tb)
        loss = self.nll_coeff * nll - self.beta * ratio.mean()
        if not with_stats:
            return loss, {}
        stats = pair_stats(loss, self.beta * lw, self.beta * ll, lw, ll)
        stats.update(policy_stats(lp, H, tb, with_reference=False))
        stats.update(nll=nll, log_odds_ratio=ratio.mean(), log_odds_chosen=log_odds.mean())
        return loss, stats
