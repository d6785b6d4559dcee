"""DPO and its variants on the fused head: TRL 1.16's loss types, combined losses, f-DPO, LD-DPO, WPO; IPO."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ludic_fast.losses.base import Batch, Stats, seq_logps
from ludic_fast.losses.preference import dpo_terms as T
from ludic_fast.losses.preference.common import (
    PairLoss,
    check_beta,
    check_pairs,
    chosen_nll,
    pair_stats,
    policy_stats,
    ref_seq_logps,
)
from ludic_fast.losses.preference.wpo import WPO_KEY, with_log_sum_sq_probs
from ludic_fast.token_batch import TokenBatch


def _loss_types(loss_type: str | Sequence[str]) -> tuple[str, ...]:
    types = (loss_type,) if isinstance(loss_type, str) else tuple(loss_type)
    unknown = [t for t in types if t not in T.TERMS]
    if not types or unknown:
        raise ValueError(f"loss_type must be one or more of {T.LOSS_TYPES}, got {loss_type!r}")
    return types


def _ld_token_weights(tb: TokenBatch, ld_alpha: float, dtype: torch.dtype) -> Tensor:
    """LD-DPO weights per token: 1 for the first min(n_w, n_l) tokens of each response of a pair, ld_alpha
    beyond (ranks counted over the tokens present: every pair is whole wherever this runs)."""
    idx = torch.arange(tb.n, device=tb.seq.device)
    first = torch.full((tb.n_seq,), tb.n, device=idx.device).scatter_reduce(0, tb.seq, idx, "amin")
    rank = idx - first[tb.seq] + 1
    count = torch.zeros(tb.n_seq, device=idx.device, dtype=torch.long).index_add_(0, tb.seq, torch.ones_like(idx))
    shared = torch.minimum(count[0::2], count[1::2]).repeat_interleave(2)
    one = torch.ones((), dtype=dtype, device=idx.device)
    return torch.where(rank <= shared[tb.seq], one, one * ld_alpha)


@dataclass
class DPOLoss(PairLoss):
    """DPO (Rafailov et al., arXiv 2305.18290) and TRL 1.16's `DPOTrainer` loss types
    (`ludic_fast.losses.preference.dpo_terms`): loss = Σ_k w_k mean_pairs ℓ_k (one type, or several combined with
    `loss_weights` w, default 1 each: RPO is ["sigmoid", "sft"] with [1, α]).

    With the default loss_type "sigmoid": u = β[(L_w - R_w) - (L_l - R_l)],
    loss = mean_pairs [-(1 - ε) log σ(u) - ε log σ(-u)]; ε = label_smoothing > 0 is conservative DPO
    (cDPO, Mitchell 2023; TRL's sigmoid ignores ε). Options:
    - `f_divergence` (f-DPO, arXiv 2309.16240) with `f_alpha` (default 0.5) for "alpha_divergence";
    - `discopop_tau` (default 0.05) for "discopop";
    - `ld_alpha` (LD-DPO, arXiv 2409.06411): tokens of a response beyond the pair's shorter length weigh
      ld_alpha in L and R (needs the per-token batch['ref_logps']);
    - `use_weighting` (WPO, arXiv 2406.11827): each pair's terms × w_w w_l, w_b = exp(mean_t (lp_t -
      log Σ_v p_v²)), no gradient; log Σ p² comes from batch['log_sum_sq_probs'] [B, T] or one extra
      no-grad pass over the head (2NDV);
    - `length_normalize`: L and R ÷ n before everything (not with ipo / sigmoid_norm, which normalise).
    `entropy_stats` adds the policy's entropy per side to the stats (the head computes H).
    Rewards β (L - R). Values are float64 for float64 inputs, float32 otherwise. Paper default β = 0.1."""

    beta: float = 0.1
    label_smoothing: float = 0.0
    length_normalize: bool = False
    loss_type: str | Sequence[str] = "sigmoid"
    loss_weights: Sequence[float] | None = None
    f_divergence: str = "reverse_kl"
    f_alpha: float | None = None
    ld_alpha: float | None = None
    use_weighting: bool = False
    discopop_tau: float | None = None
    entropy_stats: bool = False
    uses_reference: ClassVar[bool] = True

    @property
    def needs_token_reference(self) -> bool:
        return self.ld_alpha is not None

    def __post_init__(self) -> None:
        check_beta(self.beta, self.label_smoothing)
        types = _loss_types(self.loss_type)
        if self.loss_weights is not None and len(self.loss_weights) != len(types):
            raise ValueError(f"loss_weights needs one weight per loss type ({len(types)}), got {self.loss_weights}")
        if self.label_smoothing and not set(types) & set(T.SMOOTHED):
            raise ValueError(f"label_smoothing is read only by the loss types {T.SMOOTHED}, got {types}")
        if "exo_pair" in types and self.label_smoothing == 0.0:
            raise ValueError("loss_type 'exo_pair' needs label_smoothing > 0 (the EXO paper uses 1e-3)")
        if self.f_divergence not in T.F_DIVERGENCES:
            raise ValueError(f"f_divergence must be one of {T.F_DIVERGENCES}, got {self.f_divergence!r}")
        if self.f_divergence != "reverse_kl" and not set(types) <= set(T.F_DIVERGENCE_TYPES):
            raise ValueError(f"f_divergence {self.f_divergence!r} applies only to the loss types "
                             f"{T.F_DIVERGENCE_TYPES}, got {types}")
        if self.f_alpha is not None and self.f_divergence != "alpha_divergence":
            raise ValueError("f_alpha is read only with f_divergence='alpha_divergence'")
        if self.discopop_tau is not None and "discopop" not in types:
            raise ValueError("discopop_tau is read only by loss_type 'discopop'")
        if self.ld_alpha is not None and not 0.0 <= self.ld_alpha <= 1.0:
            raise ValueError(f"ld_alpha must lie in [0, 1], got {self.ld_alpha}")
        if self.length_normalize and ({"ipo", "sigmoid_norm"} & set(types) or self.ld_alpha is not None):
            raise ValueError("length_normalize does not combine with ld_alpha or the loss types ipo / sigmoid_norm "
                             "(they normalise by the length themselves)")
        if self.use_weighting and set(types) & set(T.BATCH_SORTED):
            raise ValueError("use_weighting does not apply to aot / aot_unpaired (they sort the pairs)")
        if self.discopop_tau is not None and self.discopop_tau <= 0:
            raise ValueError(f"discopop_tau must be > 0, got {self.discopop_tau}")
        self._types = types
        self._weights = tuple(float(w) for w in (self.loss_weights or [1.0] * len(types)))

    def coupling_groups(self, tb: TokenBatch) -> list[int] | None:
        """None (the whole batch) for the batch-sorted types and for sft under WPO weighting (the pooled NLL
        is scaled by the mean pair weight); else pairs."""
        if set(self._types) & set(T.BATCH_SORTED) or (self.use_weighting and "sft" in self._types):
            return None
        return super().coupling_groups(tb)

    def __call__(self, batch: Batch, **kw) -> tuple[Tensor, Stats]:
        """As `HeadLoss.__call__`; with `use_weighting` and no batch['log_sum_sq_probs'], that key is first
        computed from the same head inputs without gradients."""
        if self.use_weighting and WPO_KEY not in batch:
            batch = with_log_sum_sq_probs(batch, **kw)
        return super().__call__(batch, **kw)

    def _sums(self, lp: Tensor, tb: TokenBatch) -> tuple[Tensor, Tensor]:
        """(L, R) per sequence [S], LD-weighted and length-normalised as configured."""
        if self.ld_alpha is None:
            return seq_logps(lp, tb, self.length_normalize), ref_seq_logps(tb, self.length_normalize, "DPOLoss")
        if "ref_logps" not in tb.tokens:
            raise KeyError("DPOLoss(ld_alpha=...) requires the per-token batch['ref_logps'] [B, T]")
        w = tb.mask * _ld_token_weights(tb, self.ld_alpha, lp.dtype)
        return tb.seq_sum(w * lp), tb.seq_sum(w * tb.tokens["ref_logps"])

    def _wpo_weights(self, lp: Tensor, tb: TokenBatch) -> Tensor:
        """w_w w_l per pair [P], no gradient."""
        lss = tb.token(WPO_KEY, "DPOLoss(use_weighting=True)")
        w = torch.exp(tb.seq_sum(tb.mask * (lp.detach() - lss)) / tb.seqs["counts"])
        return w[0::2] * w[1::2]

    def objective(self, lp, H, tb, with_stats):
        check_pairs(tb, "DPOLoss")
        L, R = self._sums(lp, tb)
        c = L - R
        s = T.f_divergence_score(c, self.f_divergence, 0.5 if self.f_alpha is None else self.f_alpha)
        counts = tb.seqs["counts"]
        terms = T.PairTerms(
            chosen=c[0::2], rejected=c[1::2], chosen_score=s[0::2], rejected_score=s[1::2],
            n_chosen=counts[0::2], n_rejected=counts[1::2], policy_margin=L[0::2] - L[1::2],
            ref_margin=R[0::2] - R[1::2], sft=chosen_nll(lp, tb) if "sft" in self._types else lp.new_zeros(()),
            beta=self.beta, eps=self.label_smoothing, tau=self.discopop_tau or 0.05,
        )
        pair_weight = self._wpo_weights(lp, tb) if self.use_weighting else None
        loss = lp.new_zeros(())
        for name, w in zip(self._types, self._weights):
            per_pair = T.TERMS[name](terms)
            loss = loss + w * (per_pair if pair_weight is None else per_pair * pair_weight).mean()
        if not with_stats:
            return loss, {}
        stats = pair_stats(loss, self.beta * c[0::2], self.beta * c[1::2], L[0::2], L[1::2])
        stats.update(policy_stats(lp, H, tb, with_reference=True))
        if pair_weight is not None:
            stats["wpo_weight"] = pair_weight.mean()
        return loss, stats


@dataclass
class IPOLoss(PairLoss):
    """IPO (Azar et al., arXiv 2310.12036, eq. 17): with h = (L_w - R_w) - (L_l - R_l),
    loss = mean_pairs (h - 1/(2τ))², τ = beta (default 0.1). Sequence log-probs are length-normalised by
    default, as TRL's IPO (= DPOLoss(loss_type="ipo")). Rewards β (L - R); float64 for float64 inputs."""

    beta: float = 0.1
    length_normalize: bool = True
    entropy_stats: bool = False
    uses_reference: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_beta(self.beta)

    def objective(self, lp, H, tb, with_stats):
        lw, ll = self.pair_logps(lp, tb)
        ref_w, ref_l = self.pair_ref(tb)
        h = (lw - ref_w) - (ll - ref_l)
        loss = (h - 1.0 / (2.0 * self.beta)).square().mean()
        if not with_stats:
            return loss, {}
        stats = pair_stats(loss, self.beta * (lw - ref_w), self.beta * (ll - ref_l), lw, ll)
        stats.update(policy_stats(lp, H, tb, with_reference=True))
        return loss, stats
