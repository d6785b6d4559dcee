"""The token-level policy losses: PPO / GRPO / DAPO / Dr. GRPO (`TokenClippedSurrogateLoss`), CISPO, RL-ZVP
inside CISPO, ScaleRL and SAPO, with the options they share (`PolicyOptions`: aggregation, IS correction, KL
penalty, entropy bonus and masking, RL-ZVP advantages). Calling conventions: `ludic_fast.losses.base`.

r_t = exp(lp_t - actor_logp_t) per action token, A_t the advantage (batch['weight'] [S] broadcast, or
batch['advantages'] per token). Token-local unless top-ρ entropy masking or RL-ZVP is on (coupled: RL-ZVP within
a response, so one pass over chunks of whole responses when the batch's collation gave their starts; top-ρ
across the batch, 8NDV, 6NDV in one chunk).
The PPO clipped surrogate, CISPO's weight, SAPO's gate and the KL estimators are written once, in
`ludic_fast.losses.policy_terms`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ludic_fast.losses.base import HeadLoss, Stats, check_at_least, check_eps, common_stats, frac, mean_std, zero
from ludic_fast.losses.policy_terms import KL_ESTIMATORS, cispo_weight, kl_estimate, ppo_clip_loss, sapo_gate
from ludic_fast.token_batch import AGGREGATIONS, TokenBatch


@dataclass(kw_only=True)
class PolicyOptions:
    """Options of the token-level surrogate losses (keyword-only; defaults keep Ludic's behaviour).

    aggregation     None (Ludic: seq_mean_token_mean when length_normalize else seq_mean_token_sum) or one
                    of token_mean, seq_mean_token_mean, seq_mean_token_sum, seq_mean_token_sum_norm,
                    prompt_mean (per prompt batch['group_id']: sum over its responses / their tokens; then
                    the mean over prompts) — see TokenBatch.agg_coef.
    normalizer      caller-supplied global count replacing the outer denominator (tokens for token_mean,
                    sequences for seq_mean_*, prompts for prompt_mean), e.g. for gradient accumulation.
    norm_length     the constant of seq_mean_token_sum_norm (Dr. GRPO: max response length).
    is_level        None | 'token' | 'sequence': train/inference mismatch weight from batch['is_weights']
                    (ρ_t = π_old/π_infer per token; sequence: ρ_b = prod_t ρ_t), detached, multiplies the
                    policy term; is_mode 'truncate' clamps to is_bounds, 'mask' zeroes outside them.
    kl_coeff        β of a KL penalty against batch['ref_logps'] added per token: d = lp - ref,
                    k1 = d, k2 = d²/2, k3 = e^{-d} - 1 + d; × r_t (differentiable) when kl_is_correct.
    entropy_coeff   c of an entropy bonus -c H_t per token, with the loss's aggregation.
    entropy_top_rho ρ: the policy term only on tokens with H_t >= the (1-ρ) quantile of the batch (coupled).
    alpha_zvp       RL-ZVP: for batch['zvp_direction'] = +1 sequences A_t = α sg(H_t), for -1
                    A_t = -α (max_response sg(H) - sg(H_t)); 0 keeps A (coupled). Any other direction
                    makes its sequence's advantages NaN, so the loss is NaN (checked without a host sync).
    """

    aggregation: str | None = None
    normalizer: float | None = None
    norm_length: float | None = None
    is_level: str | None = None
    is_mode: str = "truncate"
    is_bounds: tuple[float, float] = (0.0, 2.0)
    kl_coeff: float = 0.0
    kl_estimator: str = "k3"
    kl_is_correct: bool = False
    entropy_coeff: float = 0.0
    entropy_top_rho: float | None = None
    alpha_zvp: float | None = None

    def _check_options(self) -> None:
        if self.aggregation is not None and self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS} or None, got {self.aggregation!r}")
        if self.is_level not in (None, "token", "sequence"):
            raise ValueError(f"is_level must be None, 'token' or 'sequence', got {self.is_level!r}")
        if self.is_mode not in ("truncate", "mask"):
            raise ValueError(f"is_mode must be 'truncate' or 'mask', got {self.is_mode!r}")
        if len(self.is_bounds) != 2 or not 0 <= self.is_bounds[0] <= self.is_bounds[1]:
            raise ValueError(f"is_bounds must be (low, high) with 0 <= low <= high, got {self.is_bounds!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.entropy_top_rho is not None and not 0 < self.entropy_top_rho <= 1:
            raise ValueError(f"entropy_top_rho must lie in (0, 1], got {self.entropy_top_rho}")
        if self.alpha_zvp is not None:
            check_at_least("alpha_zvp", self.alpha_zvp, 0.0)


class _TokenPolicyLoss(HeadLoss, PolicyOptions):
    """loss = sum_t c_t M_t [ w_t l_t + β kl_t - c_H H_t ], l_t the policy term of the subclass,
    w_t = IS weight x top-ρ mask (detached), c_t the aggregation coefficient."""

    length_normalize: bool

    @property
    def coupled(self) -> bool:  # type: ignore[override]
        return self.entropy_top_rho is not None or self.alpha_zvp is not None

    def coupling_groups(self, tb: TokenBatch) -> list[int] | None:
        """RL-ZVP couples a response's tokens only (its max entropy); top-ρ the whole batch (a quantile)."""
        return tb.sequence_starts() if self.entropy_top_rho is None else None

    @property
    def needs_entropy(self) -> bool:  # type: ignore[override]
        return self.coupled or self.entropy_coeff != 0.0

    def _default_aggregation(self) -> str:
        return "seq_mean_token_mean" if self.length_normalize else "seq_mean_token_sum"

    def _policy(self, lp: Tensor, ratio: Tensor, adv: Tensor) -> tuple[Tensor, Tensor, Stats]:
        """(per-token policy loss l_t, the ratio its stats describe, extra stats on that ratio)."""
        raise NotImplementedError

    def _advantages(self, H: Tensor | None, tb: TokenBatch) -> Tensor:
        adv = tb.advantages(type(self).__name__)
        if self.alpha_zvp is None:
            return adv
        direction = tb.per_seq("zvp_direction", f"{type(self).__name__}(alpha_zvp)")[tb.seq]
        h = H.detach()
        pos = self.alpha_zvp * h
        neg = -self.alpha_zvp * (tb.seq_max(h)[tb.seq] - h)
        zvp = torch.where(direction > 0, pos, torch.where(direction < 0, neg, adv))
        return torch.where((direction == 0) | (direction.abs() == 1), zvp, math.nan)  # no silent sign reading

    def _is_weights(self, tb: TokenBatch) -> Tensor:
        rho = tb.token("is_weights", f"{type(self).__name__}(is_level)")
        if self.is_level == "sequence":
            whole = tb.whole
            rho = torch.exp(whole.seq_sum(torch.log(whole.tokens["is_weights"])))[tb.seq]
        lo, hi = self.is_bounds
        return rho.clamp(lo, hi) if self.is_mode == "truncate" else rho * ((rho >= lo) & (rho <= hi))

    def _top_rho_keep(self, h: Tensor, tb: TokenBatch) -> Tensor:
        if tb.n == 0:
            return h
        return (h >= torch.quantile(h, 1.0 - self.entropy_top_rho)).to(h.dtype)

    def _weights(self, H: Tensor | None, tb: TokenBatch) -> Tensor | None:
        """Detached per-token multipliers of the policy term: IS weight x top-rho entropy mask."""
        w = self._is_weights(tb) if self.is_level is not None else None
        if self.entropy_top_rho is not None:
            keep = self._top_rho_keep(H.detach(), tb)
            w = keep if w is None else w * keep
        return w

    def objective(self, lp, H, tb, with_stats):
        name = type(self).__name__
        log_ratio = lp - tb.token("actor_logps", name)
        ratio = log_ratio.exp()
        adv = self._advantages(H, tb)
        term, stat_ratio, pstats = self._policy(lp, ratio, adv)
        w = self._weights(H, tb)
        if w is not None:
            term = term * w
        if self.kl_coeff != 0.0:
            kl = self._kl(lp, tb)
            term = term + self.kl_coeff * (kl * ratio if self.kl_is_correct else kl)
        if self.entropy_coeff != 0.0:
            term = term - self.entropy_coeff * H
        coef = tb.agg_coef(self.aggregation or self._default_aggregation(), self.normalizer, self.norm_length)
        loss = (term * tb.mask * coef).sum()
        if not with_stats:
            return loss, {}
        return loss, self._stats(loss, lp, H, tb, log_ratio.detach(), stat_ratio.detach(), adv, pstats)

    def _kl(self, lp: Tensor, tb: TokenBatch) -> Tensor:
        return kl_estimate(lp - tb.token("ref_logps", f"{type(self).__name__}(kl_coeff)"), self.kl_estimator)

    def _stats(self, loss, lp, H, tb, log_ratio, ratio, adv, pstats) -> Stats:
        r_mean, r_std = mean_std(ratio)
        if "weight" in tb.seqs and "advantages" not in tb.tokens:
            adv_mean, adv_std = mean_std(tb.seqs["weight"])
        else:
            adv_mean, adv_std = mean_std(adv.detach())
        stats: Stats = {
            "loss": loss,
            "ratio_mean": r_mean,
            "ratio_std": r_std,
            **pstats,
            "kl_actor_policy": mean_std(log_ratio.exp() - log_ratio - 1)[0],
            "adv_mean": adv_mean,
            "adv_std": adv_std,
            **common_stats(lp.detach(), H.detach() if self.needs_entropy else None, tb),
        }
        if self.alpha_zvp is not None:
            zvp = (tb.per_seq("zvp_direction", "alpha_zvp") != 0).float()
            stats["zvp_frac"] = zvp.mean()
            on = zvp[tb.seq]
            stats["zvp_adv_mean"] = (adv.detach() * on).sum() / on.sum().clamp(min=1.0)
        if self.kl_coeff != 0.0:
            stats["kl_ref_mean"] = mean_std(self._kl(lp.detach(), tb))[0]
        if self.is_level is not None:
            stats["is_weight_mean"] = mean_std(self._is_weights(tb))[0]
        if self.entropy_top_rho is not None:
            stats["entropy_keep_frac"] = mean_std(self._top_rho_keep(H.detach(), tb))[0]
        return stats


def _clip_stats(r: Tensor, lo: float | None, hi: float) -> Stats:
    low = r < lo if lo is not None else torch.zeros_like(r, dtype=torch.bool)
    high = r > hi
    return {"clip_frac": frac(low | high), "clip_frac_low": frac(low), "clip_frac_high": frac(high)}


@dataclass
class TokenClippedSurrogateLoss(_TokenPolicyLoss):
    """Token PPO (GRPO / DAPO / Dr. GRPO by options): l_t = -min(r'A, clip(r', 1-ε_lo, 1+ε_hi) A),
    r' = min(r, ratio_clip) (INTELLECT-2 δ); `dual_clip` c > 1: for A < 0, l_t = min(l_t, -c A) (verl)."""

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.27
    length_normalize: bool = False
    ratio_clip: float | None = None
    dual_clip: float | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        check_eps(self.clip_eps_low, self.clip_eps_high, self.ratio_clip)
        if self.dual_clip is not None:
            check_at_least("dual_clip", self.dual_clip, 1.0, strict=True)
        self._check_options()

    def _policy(self, lp, ratio, adv):
        r = ratio if self.ratio_clip is None else torch.clamp(ratio, max=self.ratio_clip)
        lo, hi = 1.0 - self.clip_eps_low, 1.0 + self.clip_eps_high
        loss = ppo_clip_loss(r, adv, lo, hi, dual_clip=self.dual_clip)
        rd = r.detach()
        stats = _clip_stats(rd, lo, hi)
        stats["ratio_clip_frac"] = frac(rd >= self.ratio_clip) if self.ratio_clip is not None else zero(rd)
        return loss, r, stats


@dataclass
class CISPOLoss(_TokenPolicyLoss):
    """CISPO: l_t = -sg(w_t) A_t lp_t, w = clip(r, 1-ε_lo, 1+ε_hi) (cispo_bound='relative', Ludic/verl) or
    w = min(r, clip_eps_high) (cispo_bound='absolute', TRL/ScaleRL). Token-local."""

    clip_eps_low: float = 1e6
    clip_eps_high: float = 0.2
    length_normalize: bool = True
    cispo_bound: str = field(default="relative", kw_only=True)

    def __post_init__(self) -> None:
        check_eps(self.clip_eps_low, self.clip_eps_high, None)
        if self.cispo_bound not in ("relative", "absolute"):
            raise ValueError(f"cispo_bound must be 'relative' or 'absolute', got {self.cispo_bound!r}")
        self._check_options()

    def _policy(self, lp, ratio, adv):
        if self.cispo_bound == "absolute":
            return _cispo_term(lp, ratio, adv, None, self.clip_eps_high)
        return _cispo_term(lp, ratio, adv, 1.0 - self.clip_eps_low, 1.0 + self.clip_eps_high)


def _cispo_term(lp: Tensor, ratio: Tensor, adv: Tensor, lo: float | None, hi: float) -> tuple[Tensor, Tensor, Stats]:
    r = ratio.detach()
    return -(cispo_weight(r, lo, hi) * adv * lp), r, _clip_stats(r, lo, hi)


@dataclass
class ZVPCISPOLoss(CISPOLoss):
    """RL-ZVP (arXiv 2509.21880) inside CISPO: zvp_direction +1 sequences get A_t = α sg(H_t), -1 get
    A_t = -α (max over the response of sg(H) - sg(H_t)), 0 are CISPOLoss exactly. Coupled within a response:
    one fused pass over whole responses (6NDV) when the batch's collation gave their starts, else 8NDV."""

    alpha_zvp: float | None = field(default=0.1, kw_only=False)

    def __post_init__(self) -> None:
        if self.alpha_zvp is None:
            raise ValueError("ZVPCISPOLoss needs alpha_zvp (a float >= 0)")
        super().__post_init__()


@dataclass
class ScaleRLLoss(_TokenPolicyLoss):
    """ScaleRL (arXiv 2510.13786): l_t = -sg(min(r_t, eps_max)) A_t lp_t with prompt-level aggregation
    (per batch['group_id'] prompt: sum of its responses' token terms / their action tokens; then the mean
    over prompts). Token-local."""

    eps_max: float = 4.0
    length_normalize: bool = field(default=True, init=False, repr=False)

    def __post_init__(self) -> None:
        check_at_least("eps_max", self.eps_max, 0.0, strict=True)
        self._check_options()

    def _default_aggregation(self) -> str:
        return "prompt_mean"

    def _policy(self, lp, ratio, adv):
        return _cispo_term(lp, ratio, adv, None, self.eps_max)


@dataclass
class SAPOLoss(_TokenPolicyLoss):
    """SAPO (arXiv 2511.20347): l_t = -(4/τ) σ(τ (r_t - 1)) A_t, τ = tau_pos if A_t > 0 else tau_neg."""

    tau_pos: float = 1.0
    tau_neg: float = 1.05
    length_normalize: bool = False

    def __post_init__(self) -> None:
        check_at_least("tau_pos", self.tau_pos, 0.0, strict=True)
        check_at_least("tau_neg", self.tau_neg, 0.0, strict=True)
        self._check_options()

    def _policy(self, lp, ratio, adv):
        return -sapo_gate(ratio, adv, self.tau_pos, self.tau_neg) * adv, ratio, {}
