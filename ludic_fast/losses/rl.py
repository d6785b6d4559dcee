"""Ludic's RL losses on the fused LM head that are not token-level surrogates: REINFORCE (with and without a
baseline) under the sequence IS weight, GSPO (`ClippedSurrogateLoss`), SFT cross-entropy, k1 KL terms and the
entropy bonus. Calling conventions and notation: `ludic_fast.losses.base`.

Notation as Ludic's losses (github.com/joanvelja/ludic): S the number of sequences, O_b =
batch[old_logp_key] (/ n_b when length_normalize), A from batch['weight'] [S] (or per token from
batch['advantages']). `mean_b` averages over all S sequences. The sequence-level IS ratio couples a
sequence's tokens: the fused mode keeps sequences whole in its chunks and runs one pass (6NDV) when the batch's
collation gave their starts (`TokenBatch.sequence_starts`), else two passes (8NDV; 6NDV in one chunk); the
others are token-local (one pass, 6NDV).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ludic_fast.losses.base import (
    HeadLoss,
    Stats,
    check_eps,
    frac,
    mean_std,
    old_seq_logps,
    seq_logps,
    zero,
)
from ludic_fast.losses.policy_terms import ppo_clip_loss
from ludic_fast.token_batch import TokenBatch


def _sequence_is_stats(adv: Tensor, L: Tensor, ratio: Tensor, log_ratio: Tensor) -> Stats:
    adv_mean, adv_std = mean_std(adv)
    r_mean, r_std = mean_std(ratio)
    return {
        "adv_mean": adv_mean,
        "adv_std": adv_std,
        "logp_mean": L.mean(),
        "ratio_mean": r_mean,
        "ratio_std": r_std,
        "kl_actor_policy": (ratio - log_ratio - 1).mean(),
    }


class _SequenceISLoss(HeadLoss):
    """loss = -mean_b sg(R_b) A_b L_b, R_b = exp(L_b - O_b): unclipped sequence IS (coupled within a sequence)."""

    length_normalize: bool
    old_logp_key: str
    coupled = True

    def coupling_groups(self, tb: TokenBatch) -> list[int] | None:
        return tb.sequence_starts()  # R_b couples sequence b's tokens only

    def _advantage(self, tb: TokenBatch) -> tuple[Tensor, Stats]:
        return tb.per_seq("weight", type(self).__name__), {}

    def objective(self, lp, H, tb, with_stats):
        name = type(self).__name__
        old = old_seq_logps(tb, self.old_logp_key, self.length_normalize, name)
        adv, extra = self._advantage(tb)
        L = seq_logps(lp, tb, self.length_normalize)
        log_ratio = (L - old).detach()
        ratio = log_ratio.exp()
        loss = -(ratio * adv * L).mean()
        if not with_stats:
            return loss, {}
        return loss, {"loss": loss, **_sequence_is_stats(adv, L, ratio, log_ratio), **extra}


@dataclass
class ReinforceLoss(_SequenceISLoss):
    """REINFORCE with the sequence IS weight: loss = -mean_b sg(exp(L_b - O_b)) A_b L_b."""

    length_normalize: bool = False
    old_logp_key: str = "old_logp_action"


@dataclass
class ReinforceBaselineLoss(_SequenceISLoss):
    """ReinforceLoss with A = w - mean_b w (micro-batch baseline), / (std + 1e-8) when normalize."""

    normalize: bool = False
    length_normalize: bool = False
    old_logp_key: str = "old_logp_action"

    def _advantage(self, tb: TokenBatch) -> tuple[Tensor, Stats]:
        raw = tb.per_seq("weight", type(self).__name__)
        baseline = raw.mean()
        adv = raw - baseline
        if self.normalize:
            adv = adv / (mean_std(adv)[1] + 1e-8)
        return adv, {"baseline": baseline}


@dataclass
class MaskedCausalLMCrossEntropyLoss(HeadLoss):
    """SFT: nll_b = -L_b; loss = mean_b nll_b w_b (w = batch['weight'] when present). Token-local."""

    length_normalize: bool = True

    def objective(self, lp, H, tb, with_stats):
        nll = -seq_logps(lp, tb, self.length_normalize)
        w = tb.seqs.get("weight")
        loss = (nll * w).mean() if w is not None else nll.mean()
        if not with_stats:
            return loss, {}
        return loss, {
            "loss": loss,
            "logp_mean": -nll.mean(),
            "nll_mean": nll.mean(),
            "avg_action_tokens": tb.seqs["raw_counts"].mean(),
        }



@dataclass
class ClippedSurrogateLoss(HeadLoss):
    """GSPO. ratio_level='sequence' (Ludic): obj_b = min(R'_b A_b, clip(R'_b, 1-ε_lo, 1+ε_hi) A_b),
    R_b = exp(L_b - O_b), R' = min(R, ratio_clip); loss = -mean_b obj_b.
    ratio_level='token' (GSPO-token): s_t = sg(R_b) exp(lp_t - sg(lp_t)) with per-token advantages,
    o_t = min(s'_t A_t, clip(s'_t) A_t); loss = -mean_b sum_t M o_t / n_b. Both couple a sequence's tokens only:
    one fused pass over whole sequences (6NDV) when the batch's collation gave their starts, else two (8NDV)."""

    clip_eps_low: float = 3e-4
    clip_eps_high: float = 4e-4
    old_logp_key: str = "old_logp_action"
    length_normalize: bool = False
    ratio_clip: float | None = None
    ratio_level: str = field(default="sequence", kw_only=True)
    coupled = True

    def __post_init__(self) -> None:
        check_eps(self.clip_eps_low, self.clip_eps_high, self.ratio_clip)
        if self.ratio_level not in ("sequence", "token"):
            raise ValueError(f"ratio_level must be 'sequence' or 'token', got {self.ratio_level!r}")

    def coupling_groups(self, tb: TokenBatch) -> list[int] | None:
        return tb.sequence_starts()  # R_b couples sequence b's tokens only

    def objective(self, lp, H, tb, with_stats):
        name = type(self).__name__
        old = old_seq_logps(tb, self.old_logp_key, self.length_normalize, name)
        L = seq_logps(lp, tb, self.length_normalize)
        log_ratio = L - old
        lo, hi = 1.0 - self.clip_eps_low, 1.0 + self.clip_eps_high
        if self.ratio_level == "sequence":
            adv = tb.per_seq("weight", name)
            ratio = self._cap(log_ratio.exp())
        else:
            adv = tb.advantages(name)
            ratio = self._cap(torch.exp(lp - lp.detach() + log_ratio.detach()[tb.seq]))
        per = ppo_clip_loss(ratio, adv, lo, hi)
        if self.ratio_level == "sequence":
            loss = per.mean()
        else:
            loss = (per * tb.mask * tb.agg_coef("seq_mean_token_mean")).sum()
        if not with_stats:
            return loss, {}
        r = self._cap(log_ratio.detach().exp())
        r_mean, r_std = mean_std(r)
        adv_mean, adv_std = mean_std(tb.per_seq("weight", name) if "advantages" not in tb.tokens else adv)
        return loss, {
            "loss": loss,
            "ratio_mean": r_mean,
            "ratio_std": r_std,
            "clip_frac": frac((r > hi) | (r < lo)),
            "ratio_clip_frac": frac(r >= self.ratio_clip) if self.ratio_clip is not None else zero(r),
            "kl_actor_policy": (log_ratio.exp() - log_ratio - 1).detach().mean(),
            "adv_mean": adv_mean,
            "adv_std": adv_std,
            "logp_mean": L.detach().mean(),
        }

    def _cap(self, ratio: Tensor) -> Tensor:
        return ratio if self.ratio_clip is None else torch.clamp(ratio, max=self.ratio_clip)


@dataclass
class TokenKLLoss(HeadLoss):
    """k1 on behaviour samples: loss = coeff mean_b sum_t M (lp - actor_logp) (/ n_b when LN). Token-local."""

    coeff: float = 0.01
    length_normalize: bool = True

    def objective(self, lp, H, tb, with_stats):
        delta = lp - tb.token("actor_logps", type(self).__name__)
        loss = self.coeff * seq_logps(delta, tb, self.length_normalize).mean()
        if not with_stats:
            return loss, {}
        kl_mean, kl_std = mean_std(delta)
        r_mean, r_std = mean_std(delta.exp())
        return loss, {
            "loss": loss,
            "kl_mean": kl_mean,
            "kl_std": kl_std,
            "ratio_mean": r_mean,
            "ratio_std": r_std,
            "avg_action_tokens": tb.seqs["raw_counts"].mean(),
        }


@dataclass
class KLLoss(HeadLoss):
    """Sequence k1: loss = coeff mean_b (L_b - O_b) (both / n_b when LN). Token-local (linear in lp)."""

    coeff: float = 1.0
    old_logp_key: str = "old_logp_action"
    length_normalize: bool = False

    def objective(self, lp, H, tb, with_stats):
        old = old_seq_logps(tb, self.old_logp_key, self.length_normalize, type(self).__name__)
        kl = seq_logps(lp, tb, self.length_normalize) - old
        loss = self.coeff * kl.mean()
        if not with_stats:
            return loss, {}
        return loss, {"loss": loss, "kl_mean": kl.mean(), "kl_std": mean_std(kl)[1]}


@dataclass
class EntropyBonus(HeadLoss):
    """loss = -coeff sum_t M_t H_t / max(1, sum_t M_t) over the micro-batch (over the step with the trainer's
    macro-batch totals: TokenBatch.agg_coef('token_mean')). Token-local.

    H_t is the entropy at position t, the position that scores the action token t+1 (the positions every
    other loss uses). Ludic master takes H at t under the unshifted action_mask[t], one position late;
    `ludic_fast.reference.EntropyBonus(shifted=False)` reproduces that on logits."""

    coeff: float = 0.01
    needs_entropy = True

    def objective(self, lp, H, tb, with_stats):
        mean_h = (tb.agg_coef("token_mean") * tb.mask * H).sum()
        loss = -self.coeff * mean_h
        return loss, ({"loss": loss, "entropy_mean": mean_h} if with_stats else {})
