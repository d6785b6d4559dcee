"""Pieces every preference loss shares: sequence sums, the reference's sums, pair checks, pair statistics.

Notation (`ludic_fast.losses.preference`): L_b = Σ_t M_t lp_t of sequence b, R_b the reference model's, n_b =
max(1, Σ_t M_t); sequences 2i / 2i+1 are the chosen / rejected responses of pair i. Every value keeps the
dtype of its inputs: float32 for float32 / bf16 / fp16 log-probs, float64 for float64 ones.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from ludic_fast.losses.base import HeadLoss, Stats, seq_logps
from ludic_fast.losses.reward import pair_reward_stats
from ludic_fast.token_batch import TokenBatch, widen


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - e^x) for x <= 0, stable on both sides of -ln 2; x is capped at -1e-12 (finite at x = 0)."""
    x = x.clamp(max=-1e-12)
    near = torch.log(-torch.expm1(x.clamp(min=-math.log(2.0))))
    far = torch.log1p(-torch.exp(x.clamp(max=-math.log(2.0))))
    return torch.where(x > -math.log(2.0), near, far)


def group_starts(group: Tensor) -> list[int]:
    """Offsets in the flat token order where the (non-decreasing) group id changes (one host sync)."""
    return (torch.nonzero(group[1:] != group[:-1]).squeeze(1) + 1).tolist()


def ref_seq_logps(tb: TokenBatch, length_normalize: bool, owner: str) -> Tensor:
    """R_b [S] from batch['ref_seq_logps'] [S] or the per-token batch['ref_logps'] [B, T] (float64 stays float64)."""
    if "ref_seq_logps" in tb.batch:
        ref = tb.batch["ref_seq_logps"]
        if not isinstance(ref, Tensor) or tuple(ref.shape) != (tb.n_seq,):
            raise ValueError(f"batch['ref_seq_logps'] must have shape [{tb.n_seq}] (one sum per sequence)")
        ref = widen(ref)
    elif "ref_logps" in tb.tokens:
        ref = tb.seq_sum(tb.mask * tb.tokens["ref_logps"])
    else:
        raise KeyError(f"{owner} requires the reference model's log-probs: batch['ref_logps'] [B, T] or "
                       "batch['ref_seq_logps'] [S]")
    return ref / tb.seqs["counts"] if length_normalize else ref


def check_pairs(tb: TokenBatch, owner: str) -> None:
    if tb.n_seq == 0 or tb.n_seq % 2:
        raise ValueError(f"{owner} needs a pair batch: an even number of sequences (2i chosen, 2i+1 rejected), "
                         f"got {tb.n_seq}")


def check_beta(beta: float, label_smoothing: float = 0.0) -> None:
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must lie in [0, 0.5), got {label_smoothing}")


def smoothed_sigmoid_loss(logits: Tensor, eps: float) -> Tensor:
    """-(1 - ε) log σ(x) - ε log σ(-x) per pair (cDPO; ε = 0 is the plain logistic loss)."""
    loss = -F.logsigmoid(logits)
    return loss if eps == 0.0 else (1.0 - eps) * loss - eps * F.logsigmoid(-logits)


def chosen_nll(lp: Tensor, tb: TokenBatch) -> Tensor:
    """-Σ_{chosen tokens} M lp / Σ_{chosen} M: the SFT term on the chosen responses (token mean over the batch)."""
    chosen_sum = tb.seq_sum(tb.mask * lp)[0::2].sum()
    return -chosen_sum / tb.seqs["raw_counts"][0::2].sum().clamp(min=1.0)


def pair_stats(loss: Tensor, rw: Tensor, rl: Tensor, lw: Tensor, ll: Tensor) -> Stats:
    return {
        "loss": loss,
        **pair_reward_stats(rw, rl),
        "logps_chosen": lw.detach().mean(),
        "logps_rejected": ll.detach().mean(),
    }


def _side_token_mean(per_seq_sum: Tensor, tb: TokenBatch) -> tuple[Tensor, Tensor]:
    """(Σ over chosen, Σ over rejected) of per-sequence sums, each ÷ that side's Σ M."""
    raw = tb.seqs["raw_counts"]
    chosen = per_seq_sum[0::2].sum() / raw[0::2].sum().clamp(min=1.0)
    return chosen, per_seq_sum[1::2].sum() / raw[1::2].sum().clamp(min=1.0)


def policy_stats(lp: Tensor, H: Tensor | None, tb: TokenBatch, with_reference: bool) -> Stats:
    """Per response side, token means over the responses: `kl_chosen` / `kl_rejected` = mean of
    lp - ref_lp (the sample estimate of KL(π ‖ π_ref) at the data's tokens; reference losses only) and
    `entropy_chosen` / `entropy_rejected` = mean of the policy's entropy H (when the head computed it)."""
    stats: Stats = {}
    if with_reference:
        log_ratio = seq_logps(lp, tb, False).detach() - ref_seq_logps(tb, False, "policy_stats")
        stats["kl_chosen"], stats["kl_rejected"] = _side_token_mean(log_ratio, tb)
    if H is not None:
        stats["entropy_chosen"], stats["entropy_rejected"] = _side_token_mean(tb.seq_sum(tb.mask * H.detach()), tb)
    return stats


class PairLoss(HeadLoss):
    """A loss of the pair sums (L_w, L_l) [P]: coupled within pairs only. `entropy_stats` (a dataclass field of
    each subclass) makes the head compute the policy's entropy for the statistics. `uses_reference`: whether
    the batch must carry the reference model's log-probs; `needs_token_reference`: whether as per-token
    batch['ref_logps'] (sums in batch['ref_seq_logps'] do not suffice)."""

    coupled = True
    uses_reference: ClassVar[bool] = False
    length_normalize: bool
    entropy_stats: bool

    @property
    def needs_token_reference(self) -> bool:
        return False

    @property
    def needs_entropy(self) -> bool:  # type: ignore[override]
        return self.entropy_stats

    def coupling_groups(self, tb: TokenBatch) -> list[int] | None:
        return group_starts(torch.div(tb.seq, 2, rounding_mode="floor"))

    def pair_logps(self, lp: Tensor, tb: TokenBatch) -> tuple[Tensor, Tensor]:
        check_pairs(tb, type(self).__name__)
        L = seq_logps(lp, tb, self.length_normalize)
        return L[0::2], L[1::2]

    def pair_ref(self, tb: TokenBatch) -> tuple[Tensor, Tensor]:
        R = ref_seq_logps(tb, self.length_normalize, type(self).__name__)
        return R[0::2], R[1::2]
