"""Preference losses on the fused LM head: DPO (with cDPO label smoothing), IPO, SimPO, ORPO and KTO.

Same calling conventions as every `ludic_fast.losses` loss (`loss_fn(batch, hidden=, weight=, bias=)`,
`loss_fn(batch, logits=)`, `loss_fn.compute(logits, batch)`); position t scores token t+1, only action
tokens (the response) enter the head, no [N, V] tensor is formed.

Pair layout (`ludic_fast.pair_batching.collate_pairs`, padded or packed): sequence 2i is the chosen
response y_w of prompt i and sequence 2i+1 the rejected y_l, so a pair is contiguous in the token order and
chosen and rejected share one forward. KTO reads unpaired examples (`batch['kto_label']`, below).

Notation: L_b = Σ_t M_t lp_t of sequence b (÷ n_b = max(1, Σ_t M_t) when length-normalised); the reference
model's R_b from the batch, computed once by the same head under no_grad: `ref_logps` [B, T] per token (as
the RL losses read it) or `ref_seq_logps` [S] (Σ over the action tokens); R_b is normalised like L_b.
σ is the logistic function; every loss is a mean over pairs (KTO: over its labelled examples).

A pair couples its tokens (the loss is a function of two sequence sums), not the batch: the fused mode
keeps each pair whole inside one row chunk and forms the gradient in the forward (6NDV); a pair longer than
a chunk falls back to the two-pass mode (8NDV). KTO with in-batch KL samples couples the batch (8NDV).

Stats (detached): rewards_chosen / rewards_rejected (mean implicit reward), rewards_margin (mean of their
difference), rewards_accuracy (fraction of pairs with chosen reward > rejected), logps_chosen / _rejected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from ludic_fast.losses import HeadLoss, Stats
from ludic_fast.reward_model import pair_reward_stats
from ludic_fast.token_batch import TokenBatch


# ------------------------------------------------------------------------------------------ helpers
def log1mexp(x: Tensor) -> Tensor:
    """log(1 - e^x) for x <= 0, stable on both sides of -ln 2; x is capped at -1e-12 (finite at x = 0)."""
    x = x.clamp(max=-1e-12)
    near = torch.log(-torch.expm1(x.clamp(min=-math.log(2.0))))
    far = torch.log1p(-torch.exp(x.clamp(max=-math.log(2.0))))
    return torch.where(x > -math.log(2.0), near, far)


def _group_starts(group: Tensor) -> list[int]:
    """Offsets in the flat token order where the (non-decreasing) group id changes (one host sync)."""
    return (torch.nonzero(group[1:] != group[:-1]).squeeze(1) + 1).tolist()


def _seq_logps(lp: Tensor, tb: TokenBatch, length_normalize: bool) -> Tensor:
    total = tb.seq_sum(tb.mask * lp)
    return total / tb.seqs["counts"] if length_normalize else total


def _ref_seq_logps(tb: TokenBatch, length_normalize: bool, owner: str) -> Tensor:
    """R_b from batch['ref_seq_logps'] [S] or the per-token batch['ref_logps'] [B, T]."""
    if "ref_seq_logps" in tb.batch:
        ref = tb.batch["ref_seq_logps"]
        if not isinstance(ref, Tensor) or tuple(ref.shape) != (tb.n_seq,):
            raise ValueError(f"batch['ref_seq_logps'] must have shape [{tb.n_seq}] (one sum per sequence)")
        ref = ref.float()
    elif "ref_logps" in tb.tokens:
        ref = tb.seq_sum(tb.mask * tb.tokens["ref_logps"])
    else:
        raise KeyError(f"{owner} requires the reference model's log-probs: batch['ref_logps'] [B, T] or "
                       "batch['ref_seq_logps'] [S]")
    return ref / tb.seqs["counts"] if length_normalize else ref


def _check_pairs(tb: TokenBatch, owner: str) -> None:
    if tb.n_seq == 0 or tb.n_seq % 2:
        raise ValueError(f"{owner} needs a pair batch: an even number of sequences (2i chosen, 2i+1 rejected), "
                         f"got {tb.n_seq}")


def _check_beta(beta: float, label_smoothing: float = 0.0) -> None:
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must lie in [0, 0.5), got {label_smoothing}")


def _smoothed_sigmoid_loss(logits: Tensor, eps: float) -> Tensor:
    """-(1 - ε) log σ(x) - ε log σ(-x) per pair (cDPO; ε = 0 is the plain logistic loss)."""
    loss = -F.logsigmoid(logits)
    return loss if eps == 0.0 else (1.0 - eps) * loss - eps * F.logsigmoid(-logits)


def _pair_stats(loss: Tensor, rw: Tensor, rl: Tensor, lw: Tensor, ll: Tensor) -> Stats:
    return {
        "loss": loss,
        **pair_reward_stats(rw, rl),
        "logps_chosen": lw.detach().mean(),
        "logps_rejected": ll.detach().mean(),
    }


class _PairLoss(HeadLoss):
    """A loss of the pair sums (L_w, L_l) [P]: coupled within pairs only."""

    coupled = True
    length_normalize: bool

    def coupling_groups(self, tb: TokenBatch) -> list[int] | None:
        return _group_starts(torch.div(tb.seq, 2, rounding_mode="floor"))

    def _pair_logps(self, lp: Tensor, tb: TokenBatch) -> tuple[Tensor, Tensor]:
        _check_pairs(tb, type(self).__name__)
        L = _seq_logps(lp, tb, self.length_normalize)
        return L[0::2], L[1::2]

    def _pair_ref(self, tb: TokenBatch) -> tuple[Tensor, Tensor]:
        R = _ref_seq_logps(tb, self.length_normalize, type(self).__name__)
        return R[0::2], R[1::2]


# ------------------------------------------------------------------------------------------- losses
@dataclass
class DPOLoss(_PairLoss):
    """DPO (Rafailov et al., arXiv 2305.18290, eq. 7): with u = β[(L_w - R_w) - (L_l - R_l)],
    loss = mean_pairs [-(1 - ε) log σ(u) - ε log σ(-u)]; ε = label_smoothing > 0 is conservative DPO
    (cDPO, Mitchell 2023, "A note on DPO with noisy preferences"). Rewards β (L - R). Paper default β = 0.1."""

    beta: float = 0.1
    label_smoothing: float = 0.0
    length_normalize: bool = False

    def __post_init__(self) -> None:
        _check_beta(self.beta, self.label_smoothing)

    def objective(self, lp, H, tb, with_stats):
        lw, ll = self._pair_logps(lp, tb)
        ref_w, ref_l = self._pair_ref(tb)
        rw, rl = self.beta * (lw - ref_w), self.beta * (ll - ref_l)
        loss = _smoothed_sigmoid_loss(rw - rl, self.label_smoothing).mean()
        return loss, (_pair_stats(loss, rw, rl, lw, ll) if with_stats else {})


@dataclass
class IPOLoss(_PairLoss):
    """IPO (Azar et al., arXiv 2310.12036, eq. 17): with h = (L_w - R_w) - (L_l - R_l),
    loss = mean_pairs (h - 1/(2τ))², τ = beta (default 0.1). Sequence log-probs are length-normalised by
    default, as TRL's IPO. Rewards β (L - R)."""

    beta: float = 0.1
    length_normalize: bool = True

    def __post_init__(self) -> None:
        _check_beta(self.beta)

    def objective(self, lp, H, tb, with_stats):
        lw, ll = self._pair_logps(lp, tb)
        ref_w, ref_l = self._pair_ref(tb)
        h = (lw - ref_w) - (ll - ref_l)
        loss = (h - 1.0 / (2.0 * self.beta)).square().mean()
        if not with_stats:
            return loss, {}
        return loss, _pair_stats(loss, self.beta * (lw - ref_w), self.beta * (ll - ref_l), lw, ll)


@dataclass
class SimPOLoss(_PairLoss):
    """SimPO (Meng et al., arXiv 2405.14734, eq. 6), no reference model: with the length-normalised
    L̄ = L / n, u = β L̄_w - β L̄_l - γ, loss = mean_pairs [-(1 - ε) log σ(u) - ε log σ(-u)].
    Defaults β = 2.0, γ = 1.0 (the paper's range β ∈ [2, 2.5] with γ/β = 0.5). Rewards β L̄."""

    beta: float = 2.0
    gamma: float = 1.0
    label_smoothing: float = 0.0
    length_normalize: bool = field(default=True, init=False, repr=False)

    def __post_init__(self) -> None:
        _check_beta(self.beta, self.label_smoothing)

    def objective(self, lp, H, tb, with_stats):
        lw, ll = self._pair_logps(lp, tb)
        rw, rl = self.beta * lw, self.beta * ll
        loss = _smoothed_sigmoid_loss(rw - rl - self.gamma, self.label_smoothing).mean()
        return loss, (_pair_stats(loss, rw, rl, lw, ll) if with_stats else {})


@dataclass
class ORPOLoss(_PairLoss):
    """ORPO (Hong et al., arXiv 2403.07691, eqs. 6-7), no reference model: with L̄ = L / n,
    log odds(y) = L̄ - log(1 - e^L̄), ℓ = log odds(y_w) - log odds(y_l),
    loss = nll_coeff · NLL + beta · mean_pairs(-log σ(ℓ)), NLL = -Σ_{chosen tokens} M lp / Σ_{chosen} M
    (the SFT term on the chosen responses, token mean). Paper λ = beta = 0.1. Rewards β L̄ (as TRL)."""

    beta: float = 0.1
    nll_coeff: float = 1.0
    length_normalize: bool = field(default=True, init=False, repr=False)

    def __post_init__(self) -> None:
        _check_beta(self.beta)
        if self.nll_coeff < 0:
            raise ValueError(f"nll_coeff must be >= 0, got {self.nll_coeff}")

    def objective(self, lp, H, tb, with_stats):
        lw, ll = self._pair_logps(lp, tb)
        log_odds = (lw - ll) - (log1mexp(lw) - log1mexp(ll))
        ratio = F.logsigmoid(log_odds)
        chosen_sum = tb.seq_sum(tb.mask * lp)[0::2].sum()
        nll = -chosen_sum / tb.seqs["raw_counts"][0::2].sum().clamp(min=1.0)
        loss = self.nll_coeff * nll - self.beta * ratio.mean()
        if not with_stats:
            return loss, {}
        stats = _pair_stats(loss, self.beta * lw, self.beta * ll, lw, ll)
        stats.update(nll=nll, log_odds_ratio=ratio.mean(), log_odds_chosen=log_odds.mean())
        return loss, stats


@dataclass
class KTOLoss(HeadLoss):
    """KTO (Ethayarajh et al., arXiv 2402.01306, eq. 8) on unpaired examples: batch['kto_label'] [S] is 1
    (desirable), 0 (undesirable) or -1 (a KL sample: a completion paired with another prompt, used only for
    the reference point). With r_b = L_b - R_b and z_0 = max(0, mean_{KL samples} r_b), detached,
    loss_b = λ_D (1 - σ(β (r_b - z_0))) for desirable, λ_U (1 - σ(β (z_0 - r_b))) for undesirable;
    loss = Σ_b loss_b / #labelled. A precomputed batch['kto_kl'] (0-d) replaces the in-batch estimate of
    z_0 (0 when neither is there).
    Defaults β = 0.1, λ_D = λ_U = 1 (the paper's). Rewards β r: mean over desirable (rewards_chosen) and
    undesirable (rewards_rejected) examples, rewards_margin their difference."""

    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    length_normalize: bool = False
    coupled = True

    def __post_init__(self) -> None:
        _check_beta(self.beta)
        if self.desirable_weight < 0 or self.undesirable_weight < 0:
            raise ValueError("desirable_weight and undesirable_weight must be >= 0, got "
                             f"{self.desirable_weight}, {self.undesirable_weight}")

    def _labels(self, tb: TokenBatch) -> Tensor:
        label = tb.batch.get("kto_label")
        if not isinstance(label, Tensor) or tuple(label.shape) != (tb.n_seq,):
            raise KeyError(f"KTOLoss requires batch['kto_label'] of shape [{tb.n_seq}] (1, 0 or -1 per sequence)")
        return label

    def coupling_groups(self, tb: TokenBatch) -> list[int] | None:
        if "kto_kl" not in tb.batch and bool((self._labels(tb) < 0).any()):  # KL samples couple the batch
            return None
        return _group_starts(tb.seq)

    def objective(self, lp, H, tb, with_stats):
        label = self._labels(tb).to(lp.device)
        r = _seq_logps(lp, tb, self.length_normalize) - _ref_seq_logps(tb, self.length_normalize, "KTOLoss")
        if "kto_kl" in tb.batch:
            z0 = tb.batch["kto_kl"].float().reshape(())
        else:
            kl_rows = (label < 0).float()
            z0 = ((r.detach() * kl_rows).sum() / kl_rows.sum().clamp(min=1.0)).clamp(min=0.0)
        good, bad = (label == 1).float(), (label == 0).float()
        losses = (good * self.desirable_weight * (1.0 - torch.sigmoid(self.beta * (r - z0)))
                  + bad * self.undesirable_weight * (1.0 - torch.sigmoid(self.beta * (z0 - r))))
        loss = losses.sum() / (good + bad).sum().clamp(min=1.0)
        if not with_stats:
            return loss, {}
        rewards = self.beta * r.detach()
        chosen = (rewards * good).sum() / good.sum().clamp(min=1.0)
        rejected = (rewards * bad).sum() / bad.sum().clamp(min=1.0)
        return loss, {"loss": loss, "rewards_chosen": chosen, "rewards_rejected": rejected,
                      "rewards_margin": chosen - rejected, "kl": z0.detach()}


__all__ = ["DPOLoss", "IPOLoss", "SimPOLoss", "ORPOLoss", "KTOLoss", "log1mexp"]
