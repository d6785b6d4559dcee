"""Ludic master's RL losses (joanvelja/ludic @ 321e8d7) on materialised logits, exactly: REINFORCE (with
baseline), masked causal-LM cross-entropy, GSPO's sequence-clipped surrogate, the token-clipped surrogate, CISPO,
KL terms, the entropy bonus and the composite of terms."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ludic_fast.reference.head import token_entropy
from ludic_fast.reference.tokens import (
    Batch,
    Stats,
    _aggregate,
    _check_eps,
    _detach,
    _LudicLoss,
    _masked_frac,
    _masked_mean_std,
    _pop_std,
    _Shifted,
    compute_token_entropy,
)


@dataclass
class ReinforceLoss(_LudicLoss):
    """loss = -mean_b sg(R_b) A_b L_b with R_b = exp(L_b - O_b) (unclipped sequence IS weight)."""

    length_normalize: bool = False
    old_logp_key: str = "old_logp_action"

    def _compute(self, s: _Shifted, logits: Tensor) -> tuple[Tensor, Stats]:
        if self.old_logp_key not in s.batch:
            raise KeyError(f"ReinforceLoss requires batch[{self.old_logp_key!r}]")
        adv = s.batch["weight"].to(s.token_logp.dtype)
        L = s.logp_action(self.length_normalize)
        log_ratio = L - s.old_logp(self.old_logp_key, self.length_normalize)
        ratio = log_ratio.detach().exp()
        loss = -(ratio * adv * L).mean()
        return loss, _sequence_is_stats(loss, adv, L, ratio, log_ratio)


def _sequence_is_stats(loss: Tensor, adv: Tensor, L: Tensor, ratio: Tensor, log_ratio: Tensor) -> Stats:
    return {
        "loss": loss,
        "adv_mean": adv.mean(),
        "adv_std": _pop_std(adv),
        "logp_mean": L.mean(),
        "ratio_mean": ratio.mean(),
        "ratio_std": _pop_std(ratio),
        "kl_actor_policy": (ratio - log_ratio.detach() - 1).mean(),
    }


@dataclass
class ReinforceBaselineLoss(_LudicLoss):
    """REINFORCE with the micro-batch mean advantage as baseline (optionally std-normalised)."""

    normalize: bool = False
    length_normalize: bool = False
    old_logp_key: str = "old_logp_action"

    def _compute(self, s: _Shifted, logits: Tensor) -> tuple[Tensor, Stats]:
        if self.old_logp_key not in s.batch:
            raise KeyError(f"ReinforceBaselineLoss requires batch[{self.old_logp_key!r}]")
        raw = s.batch["weight"].to(s.token_logp.dtype)
        baseline = raw.mean()
        adv = raw - baseline
        if self.normalize:
            adv = adv / (_pop_std(adv) + 1e-8)
        L = s.logp_action(self.length_normalize)
        log_ratio = L - s.old_logp(self.old_logp_key, self.length_normalize)
        ratio = log_ratio.detach().exp()
        loss = -(ratio * adv * L).mean()
        stats = _sequence_is_stats(loss, adv, L, ratio, log_ratio)
        stats["baseline"] = baseline
        return loss, stats


@dataclass
class MaskedCausalLMCrossEntropyLoss(_LudicLoss):
    """SFT: nll_b = sum_j M ℓ-NLL (/ n_b if LN); loss = mean_b(nll_b * w_b) (w optional)."""

    length_normalize: bool = True

    def _compute(self, s: _Shifted, logits: Tensor) -> tuple[Tensor, Stats]:
        nll = -s.logp_action(self.length_normalize)
        weight = s.batch.get("weight")
        loss = (nll * weight.to(nll.dtype)).mean() if weight is not None else nll.mean()
        return loss, {
            "loss": loss,
            "logp_mean": -nll.mean(),
            "nll_mean": nll.mean(),
            "avg_action_tokens": s.mask.sum(-1).mean(),
        }


@dataclass
class ClippedSurrogateLoss(_LudicLoss):
    """GSPO / sequence PPO: obj_b = min(R'_b A_b, clip(R'_b, 1-ε_lo, 1+ε_hi) A_b); loss = -mean_b obj_b.

    R_b = exp(L_b - O_b) (geometric-mean ratio when length_normalize), R' = min(R, ratio_clip)."""

    clip_eps_low: float = 3e-4
    clip_eps_high: float = 4e-4
    old_logp_key: str = "old_logp_action"
    length_normalize: bool = False
    ratio_clip: float | None = None

    def __post_init__(self) -> None:
        _check_eps(self.clip_eps_low, self.clip_eps_high, self.ratio_clip)

    def _compute(self, s: _Shifted, logits: Tensor) -> tuple[Tensor, Stats]:
        if self.old_logp_key not in s.batch:
            raise KeyError(f"ClippedSurrogateLoss requires batch[{self.old_logp_key!r}]")
        adv = s.batch["weight"].to(s.token_logp.dtype)
        L = s.logp_action(self.length_normalize)
        log_ratio = L - s.old_logp(self.old_logp_key, self.length_normalize)
        ratio_raw = log_ratio.exp()
        ratio = ratio_raw if self.ratio_clip is None else torch.clamp(ratio_raw, max=self.ratio_clip)
        lo, hi = 1.0 - self.clip_eps_low, 1.0 + self.clip_eps_high
        obj = torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv)
        loss = -obj.mean()
        r = ratio.detach()
        return loss, {
            "loss": loss,
            "ratio_mean": r.mean(),
            "ratio_std": _pop_std(r),
            "clip_frac": ((r > hi) | (r < lo)).float().mean(),
            "ratio_clip_frac": (r >= self.ratio_clip).float().mean()
            if self.ratio_clip is not None
            else torch.zeros((), device=r.device),
            "kl_actor_policy": (ratio_raw.detach() - log_ratio.detach() - 1).mean(),
            "adv_mean": adv.mean(),
            "adv_std": _pop_std(adv),
            "logp_mean": L.detach().mean(),
        }


def _token_ratio_stats(s: _Shifted, ratio: Tensor, log_ratio: Tensor, adv: Tensor) -> Stats:
    """Token statistics over masked tokens shared by the token-level surrogate losses."""
    r_mean, r_std = _masked_mean_std(ratio.detach(), s.mask)
    kl, _ = _masked_mean_std((log_ratio.exp() - log_ratio - 1).detach(), s.mask)
    return {
        "ratio_mean": r_mean,
        "ratio_std": r_std,
        "kl_actor_policy": kl,
        "adv_mean": adv.mean(),
        "adv_std": _pop_std(adv),
        "logp_mean": s.logp_action(False).detach().mean(),
        "avg_action_tokens": s.mask.sum(-1).mean(),
    }


@dataclass
class TokenClippedSurrogateLoss(_LudicLoss):
    """Token PPO (GRPO/DAPO): o = min(r' A, clip(r', 1-ε_lo, 1+ε_hi) A) M; loss = -mean_b sum_j o (/ n_b)."""

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.27
    length_normalize: bool = False
    ratio_clip: float | None = None

    def __post_init__(self) -> None:
        _check_eps(self.clip_eps_low, self.clip_eps_high, self.ratio_clip)

    def _compute(self, s: _Shifted, logits: Tensor) -> tuple[Tensor, Stats]:
        actor = s.actor_logps("TokenClippedSurrogateLoss")
        adv = s.batch["weight"].to(s.token_logp.dtype)
        log_ratio = s.token_logp - actor
        ratio_raw = log_ratio.exp()
        ratio = ratio_raw if self.ratio_clip is None else torch.clamp(ratio_raw, max=self.ratio_clip)
        lo, hi = 1.0 - self.clip_eps_low, 1.0 + self.clip_eps_high
        a = adv[:, None]
        obj = torch.minimum(ratio * a, torch.clamp(ratio, lo, hi) * a) * s.mask
        per_seq = obj.sum(-1)
        if self.length_normalize:
            per_seq = per_seq / s.counts
        loss = -per_seq.mean()
        r = ratio.detach()
        stats = {"loss": loss, **_token_ratio_stats(s, r, log_ratio, adv)}
        stats["clip_frac"] = _masked_frac((r > hi) | (r < lo), s.mask)
        stats["ratio_clip_frac"] = (
            _masked_frac(r >= self.ratio_clip, s.mask)
            if self.ratio_clip is not None
            else torch.zeros((), device=r.device)
        )
        return loss, stats


@dataclass
class CISPOLoss(_LudicLoss):
    """CISPO: q = sg(clip(r, 1-ε_lo, 1+ε_hi)) A ℓ M; loss = -mean_b sum_j q (/ n_b when LN)."""

    clip_eps_low: float = 1e6
    clip_eps_high: float = 0.2
    length_normalize: bool = True

    def __post_init__(self) -> None:
        if self.clip_eps_high < 0:
            raise ValueError(f"clip_eps_high must be >= 0, got {self.clip_eps_high}")

    def _compute(self, s: _Shifted, logits: Tensor) -> tuple[Tensor, Stats]:
        actor = s.actor_logps("CISPOLoss")
        adv = s.batch["weight"].to(s.token_logp.dtype)
        log_ratio = (s.token_logp - actor).detach()
        ratio = log_ratio.exp()
        lo, hi = 1.0 - self.clip_eps_low, 1.0 + self.clip_eps_high
        is_weight = torch.clamp(ratio, lo, hi)
        per_seq = (is_weight * adv[:, None] * s.token_logp * s.mask).sum(-1)
        if self.length_normalize:
            per_seq = per_seq / s.counts
        loss = -per_seq.mean()
        stats = {"loss": loss, **_token_ratio_stats(s, ratio, log_ratio, adv)}
        stats["clip_frac"] = _masked_frac((ratio > hi) | (ratio < lo), s.mask)
        return loss, stats


@dataclass
class TokenKLLoss(_LudicLoss):
    """k1 estimator on behaviour samples: loss = coeff * mean_b sum_j (ℓ - ℓ_actor) M (/ n_b when LN)."""

    coeff: float = 0.01
    length_normalize: bool = True

    def _compute(self, s: _Shifted, logits: Tensor) -> tuple[Tensor, Stats]:
        actor = s.actor_logps("TokenKLLoss")
        delta = s.token_logp - actor
        per_seq = (delta * s.mask).sum(-1)
        if self.length_normalize:
            per_seq = per_seq / s.counts
        loss = self.coeff * per_seq.mean()
        kl_mean, kl_std = _masked_mean_std(delta.detach(), s.mask)
        r_mean, r_std = _masked_mean_std(delta.detach().exp(), s.mask)
        return loss, {
            "loss": loss,
            "kl_mean": kl_mean,
            "kl_std": kl_std,
            "ratio_mean": r_mean,
            "ratio_std": r_std,
            "avg_action_tokens": s.mask.sum(-1).mean(),
        }


@dataclass
class KLLoss(_LudicLoss):
    """Sequence-level k1: loss = coeff * mean_b (L_b - O_b) (both / n_b when LN)."""

    coeff: float = 1.0
    old_logp_key: str = "old_logp_action"
    length_normalize: bool = False

    def _compute(self, s: _Shifted, logits: Tensor) -> tuple[Tensor, Stats]:
        kl = s.logp_action(self.length_normalize) - s.old_logp(self.old_logp_key, self.length_normalize)
        loss = self.coeff * kl.mean()
        return loss, {"loss": loss, "kl_mean": kl.detach().mean(), "kl_std": _pop_std(kl.detach())}


@dataclass
class EntropyBonus(_LudicLoss):
    """loss = -coeff * (sum H M / sum M) over the micro-batch (0 when nothing is masked in); with the trainer's
    macro-batch totals in the batch (shifted only) sum M is the step's, as for aggregation='token_mean'.

    `shifted=True` (ours, default) takes H at position j, which scores token j+1, under M[b,j] =
    action_mask[b,j+1] — the positions every other loss uses. Ludic master takes H at every position t
    under the unshifted action_mask[b,t] (one position late); `shifted=False` reproduces that.
    """

    coeff: float = 0.01
    shifted: bool = True

    def compute(self, logits: Tensor, batch: Batch) -> tuple[Tensor, Stats]:
        if self.shifted:
            ent = compute_token_entropy(logits)
            mask = batch["action_mask"][:, 1:].to(ent.dtype)
        else:
            ent = token_entropy(logits)
            mask = batch["action_mask"].to(ent.dtype)
        if self.shifted:
            mean_h = _aggregate(ent * mask, _Shifted(logits, batch), "token_mean", None, None)
        else:
            mean_h = (ent * mask).sum() / mask.sum().clamp(min=1.0)
        loss = -self.coeff * mean_h
        return loss, _detach({"loss": loss, "entropy_mean": mean_h})


@dataclass
class LossTerm:
    """One named, weighted term of a CompositeLoss."""

    name: str
    loss: Any
    weight: float = 1.0


@dataclass
class CompositeLoss(_LudicLoss):
    """total = sum_i weight_i * loss_i; stats '{name}/{k}' per term, '{name}/weight', and 'loss'."""

    terms: list[LossTerm] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.terms:
            raise ValueError("CompositeLoss needs at least one LossTerm")

    def compute(self, logits: Tensor, batch: Batch) -> tuple[Tensor, Stats]:
        total: Tensor | float = 0.0
        stats: Stats = {}
        for term in self.terms:
            loss, child = term.loss.compute(logits, batch)
            total = total + term.weight * loss
            stats[f"{term.name}/loss"] = loss.detach() if isinstance(loss, Tensor) else loss
            stats[f"{term.name}/weight"] = float(term.weight)
            for k, v in child.items():
                if k != "loss":
                    stats[f"{term.name}/{k}"] = v
        stats["loss"] = total.detach() if isinstance(total, Tensor) else total
        return total, stats
