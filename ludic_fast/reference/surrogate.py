"""Twins of the losses and options beyond Ludic: one token surrogate with every aggregation and ratio form
(RL-ZVP, ScaleRL, SAPO, dual clip, TIS/MIS weights, k1/k2/k3 KL) and GSPO's token variant."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ludic_fast.reference.tokens import (
    Batch,
    Stats,
    _aggregate,
    _LudicLoss,
    _masked_frac,
    _masked_mean_std,
    _pop_std,
    _Shifted,
    compute_token_entropy,
)


# Straightforward code on the shifted [B, T-1] tensors of materialised logits (padded layout only: a packed
# batch is checked against its padded twin). `ludic_fast.losses` must give the same numbers.
def _token_values(batch: Batch, key: str, owner: str) -> Tensor:
    if key not in batch:
        raise KeyError(f"{owner} requires batch[{key!r}]")
    return batch[key][:, 1:].float()


def _zvp_advantages(adv: Tensor, ent: Tensor, s: _Shifted, alpha: float) -> Tensor:
    """RL-ZVP: +1 rows A_t = α H_t; -1 rows A_t = -α (max_{k in response} H_k - H_t); 0 rows keep A."""
    adv = adv.clone()
    for b, direction in enumerate(s.batch["zvp_direction"].tolist()):
        if direction not in (-1, 0, 1):
            raise ValueError(f"zvp_direction must be -1, 0 or +1, got {direction} (sequence {b})")
        sel = s.mask[b] > 0
        if direction > 0:
            adv[b] = alpha * ent[b]
        elif direction < 0:
            h_max = ent[b][sel].max() if bool(sel.any()) else torch.zeros(())
            adv[b] = -alpha * (h_max - ent[b])
    return adv


@dataclass
class TokenSurrogateLoss(_LudicLoss):
    """The token-level surrogate family with every option (twin of ludic_fast.losses' token losses).

    policy 'ppo':   l = -min(r' A, clip(r', 1-ε_lo, 1+ε_hi) A), r' = min(r, ratio_clip); dual_clip c: for A < 0,
                    l = min(l, -c A)
    policy 'cispo': l = -sg(w) A ℓ, w = clip(r, 1-ε_lo, 1+ε_hi) (relative) or min(r, ε_hi) (absolute)
    policy 'sapo':  l = -(4/τ) σ(τ (r - 1)) A, τ = tau_pos if A > 0 else tau_neg
    term = l * IS weight * top-ρ entropy mask + β KL(ℓ, ref) (x r if kl_is_correct) - c_H H; loss = the
    aggregation of term * M. Options as `ludic_fast.losses.PolicyOptions`.
    """

    policy: str = "ppo"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.27
    length_normalize: bool = False
    ratio_clip: float | None = None
    dual_clip: float | None = None
    cispo_bound: str = "relative"
    tau_pos: float = 1.0
    tau_neg: float = 1.05
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

    def _compute(self, s: _Shifted, logits: Tensor) -> tuple[Tensor, Stats]:
        lp, M = s.token_logp, s.mask
        need_h = self.entropy_coeff != 0.0 or self.entropy_top_rho is not None or self.alpha_zvp is not None
        ent = compute_token_entropy(logits) if need_h else None
        token_adv = "advantages" in s.batch
        adv = _token_values(s.batch, "advantages", "") if token_adv else s.batch["weight"].float()[:, None]
        adv = adv.expand_as(lp)
        if self.alpha_zvp is not None:
            adv = _zvp_advantages(adv, ent.detach(), s, self.alpha_zvp)
        log_ratio = lp - s.actor_logps(type(self).__name__)
        r = log_ratio.exp()
        term, stat_ratio, stats = self._policy(lp, r, adv, M)
        weight = torch.ones_like(lp)
        if self.is_level is not None:
            rho = _token_values(s.batch, "is_weights", "is_level")
            if self.is_level == "sequence":
                rho = torch.exp(torch.where(M > 0, torch.log(rho), 0.0).sum(-1, keepdim=True)).expand_as(rho)
            lo, hi = self.is_bounds
            rho = rho.clamp(lo, hi) if self.is_mode == "truncate" else torch.where((rho >= lo) & (rho <= hi), rho, 0.0)
            weight = weight * rho
            stats["is_weight_mean"] = _masked_mean_std(rho, M)[0]
        if self.entropy_top_rho is not None:
            sel = M > 0
            keep = torch.zeros_like(lp)
            if bool(sel.any()):
                threshold = torch.quantile(ent.detach()[sel], 1.0 - self.entropy_top_rho)
                keep = (ent.detach() >= threshold).float()
            weight = weight * keep
            stats["entropy_keep_frac"] = _masked_mean_std(keep, M)[0]
        term = term * weight
        if self.kl_coeff != 0.0:
            d = lp - _token_values(s.batch, "ref_logps", "kl_coeff")
            kl = {"k1": d, "k2": 0.5 * d**2, "k3": torch.exp(-d) - 1 + d}[self.kl_estimator]
            term = term + self.kl_coeff * (kl * r if self.kl_is_correct else kl)
            stats["kl_ref_mean"] = _masked_mean_std(kl.detach(), M)[0]
        if self.entropy_coeff != 0.0:
            term = term - self.entropy_coeff * ent
        default = "seq_mean_token_mean" if self.length_normalize else "seq_mean_token_sum"
        loss = _aggregate(term * M, s, self.aggregation or default, self.normalizer, self.norm_length)
        r_mean, r_std = _masked_mean_std(stat_ratio.detach(), M)
        kl_ap, _ = _masked_mean_std((r - log_ratio - 1).detach(), M)
        if "weight" in s.batch and not token_adv:
            w = s.batch["weight"].float()
            adv_mean, adv_std = w.mean(), _pop_std(w)
        else:
            adv_mean, adv_std = _masked_mean_std(adv.detach(), M)
        stats.update(
            loss=loss, ratio_mean=r_mean, ratio_std=r_std, kl_actor_policy=kl_ap, adv_mean=adv_mean, adv_std=adv_std,
            logp_mean=s.logp_action(False).detach().mean(), avg_action_tokens=M.sum(-1).mean(),
        )
        if ent is not None:
            stats["entropy_mean"] = (ent * M).sum() / M.sum().clamp(min=1.0)
        if self.alpha_zvp is not None:
            zvp = (s.batch["zvp_direction"] != 0).float()
            stats["zvp_frac"] = zvp.mean()
            on = M * zvp[:, None]
            stats["zvp_adv_mean"] = (adv.detach() * on).sum() / on.sum().clamp(min=1.0)
        return loss, stats

    def _policy(self, lp: Tensor, r: Tensor, adv: Tensor, M: Tensor) -> tuple[Tensor, Tensor, Stats]:
        if self.policy == "sapo":
            tau = torch.where(adv > 0, torch.full_like(adv, self.tau_pos), torch.full_like(adv, self.tau_neg))
            return -(4.0 / tau) * torch.sigmoid(tau * (r - 1)) * adv, r, {}
        if self.policy == "cispo":
            rd = r.detach()
            if self.cispo_bound == "absolute":
                lo, hi, w = None, self.clip_eps_high, torch.clamp(rd, max=self.clip_eps_high)
            else:
                lo, hi = 1.0 - self.clip_eps_low, 1.0 + self.clip_eps_high
                w = torch.clamp(rd, lo, hi)
            return -(w * adv * lp), rd, self._clip_fracs(rd, lo, hi, M)
        rc = r if self.ratio_clip is None else torch.clamp(r, max=self.ratio_clip)
        lo, hi = 1.0 - self.clip_eps_low, 1.0 + self.clip_eps_high
        obj = torch.minimum(rc * adv, torch.clamp(rc, lo, hi) * adv)
        if self.dual_clip is not None:
            obj = torch.where(adv < 0, torch.maximum(obj, self.dual_clip * adv), obj)
        stats = self._clip_fracs(rc.detach(), lo, hi, M)
        stats["ratio_clip_frac"] = (
            _masked_frac(rc.detach() >= self.ratio_clip, M) if self.ratio_clip is not None else torch.zeros(())
        )
        return -obj, rc, stats

    @staticmethod
    def _clip_fracs(r: Tensor, lo: float | None, hi: float, M: Tensor) -> Stats:
        low = (r < lo) if lo is not None else torch.zeros_like(r, dtype=torch.bool)
        return {
            "clip_frac": _masked_frac(low | (r > hi), M),
            "clip_frac_low": _masked_frac(low, M),
            "clip_frac_high": _masked_frac(r > hi, M),
        }


def ZVPCISPOLoss(  # noqa: N802 (a class-like factory: the loss's public name)
    alpha_zvp: float = 0.1, clip_eps_low: float = 1e6, clip_eps_high: float = 0.2, length_normalize: bool = True,
    **options: Any,
) -> TokenSurrogateLoss:
    """RL-ZVP advantages for zvp_direction ±1 sequences inside CISPO; direction 0 is CISPOLoss exactly."""
    return TokenSurrogateLoss("cispo", clip_eps_low, clip_eps_high, length_normalize, alpha_zvp=alpha_zvp, **options)


def ScaleRLLoss(eps_max: float = 4.0, **options: Any) -> TokenSurrogateLoss:  # noqa: N802
    """CISPO with the absolute cap sg(min(r, eps_max)) and prompt-level aggregation by batch['group_id']."""
    options.setdefault("aggregation", "prompt_mean")
    return TokenSurrogateLoss("cispo", clip_eps_high=eps_max, cispo_bound="absolute", **options)


def SAPOLoss(tau_pos: float = 1.0, tau_neg: float = 1.05, length_normalize: bool = False, **options: Any):  # noqa: N802
    """SAPO soft gate: l = -(4/τ) σ(τ (r - 1)) A."""
    return TokenSurrogateLoss("sapo", length_normalize=length_normalize, tau_pos=tau_pos, tau_neg=tau_neg, **options)


@dataclass
class GSPOTokenLoss(_LudicLoss):
    """GSPO-token: s_t = sg(R_b) ℓ_t / sg(ℓ_t) in value R_b = exp(L_b - O_b), s' = min(s, ratio_clip);
    o_t = min(s' A_t, clip(s') A_t); loss = -mean_b sum_t M o_t / n_b. Stats as ClippedSurrogateLoss."""

    clip_eps_low: float = 3e-4
    clip_eps_high: float = 4e-4
    old_logp_key: str = "old_logp_action"
    length_normalize: bool = False
    ratio_clip: float | None = None

    def _compute(self, s: _Shifted, logits: Tensor) -> tuple[Tensor, Stats]:
        L = s.logp_action(self.length_normalize)
        log_ratio = L - s.old_logp(self.old_logp_key, self.length_normalize)
        adv = _token_values(s.batch, "advantages", "") if "advantages" in s.batch else s.batch["weight"][:, None]
        adv = adv.float().expand_as(s.token_logp)
        seq_ratio = []
        for b in range(L.shape[0]):  # per sequence: the detached sequence ratio times ℓ_t / sg(ℓ_t)
            seq_ratio.append(torch.exp(log_ratio[b].detach() + s.token_logp[b] - s.token_logp[b].detach()))
        ratio = torch.stack(seq_ratio)
        if self.ratio_clip is not None:
            ratio = torch.clamp(ratio, max=self.ratio_clip)
        lo, hi = 1.0 - self.clip_eps_low, 1.0 + self.clip_eps_high
        obj = torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv) * s.mask
        loss = -(obj.sum(-1) / s.counts).mean()
        r = log_ratio.detach().exp()
        r = r if self.ratio_clip is None else torch.clamp(r, max=self.ratio_clip)
        if "advantages" in s.batch:
            adv_mean, adv_std = _masked_mean_std(adv, s.mask)
        else:
            adv_mean, adv_std = adv[:, 0].mean(), _pop_std(adv[:, 0])
        return loss, {
            "loss": loss,
            "ratio_mean": r.mean(),
            "ratio_std": _pop_std(r),
            "clip_frac": ((r > hi) | (r < lo)).float().mean(),
            "ratio_clip_frac": (r >= self.ratio_clip).float().mean()
            if self.ratio_clip is not None
            else torch.zeros(()),
            "kl_actor_policy": (log_ratio.exp() - log_ratio - 1).detach().mean(),
            "adv_mean": adv_mean,
            "adv_std": adv_std,
            "logp_mean": L.detach().mean(),
        }
