"""RL losses on the fused LM head: Ludic's classes and numbers, plus RL-ZVP, ScaleRL and options.

Every loss is written once, as a differentiable function of the per-token log-probs lp [n] and entropies
H [n] of the batch's n action tokens (`ludic_fast.token_batch.TokenBatch`, flat, padded or packed layout).
Calling conventions, all returning `(loss, stats)` with detached 0-d stats and no host sync in the loss:

    loss_fn(batch, hidden=h, weight=W, bias=None)   # fused: dh/dW/db formed in the forward (6NDV or 8NDV)
    loss_fn(batch, hidden=h, weight=W, fused=False) # generic: the head op with autograd (8NDV)
    loss_fn(batch, logits=logits)                   # materialised logits (Ludic's input)
    loss_fn.compute(logits, batch)                  # Ludic's signature

Position t of hidden/logits scores token t+1; only action positions (action_mask[t+1] > 0, same sequence)
enter the head (a negative action_mask entry makes the loss and its gradients NaN rather than being dropped).
Notation as Ludic's losses (github.com/joanvelja/ludic): M_t the action-mask value, n_b =
max(1, sum_t M_t) per sequence, S the number of sequences, L_b = sum_t M_t lp_t (/ n_b when
length_normalize), O_b = batch[old_logp_key] (/ n_b), r_t = exp(lp_t - actor_logp_t), A from
batch['weight'] [S] (or per token from batch['advantages']). `mean_b` averages over all S sequences.

Losses whose per-token gradient depends on other tokens (`coupled`) run the two-pass fused mode:
sequence-level IS ratios (ReinforceLoss, ReinforceBaselineLoss, ClippedSurrogateLoss), RL-ZVP (per-response
max entropy), top-rho entropy masking (batch quantile). All others are token-local (one pass).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ludic_fast._common import validate_head_inputs
from ludic_fast.ops import linear_logprobs, resolve_backend
from ludic_fast.ops.budget import parse_memory_budget
from ludic_fast.ops.fused_loss import FusedPlan, fused_head_loss
from ludic_fast.ops.torch_head import HeadTransform
from ludic_fast.token_batch import AGGREGATIONS, TokenBatch

Batch = Mapping[str, Tensor]
Stats = dict[str, Any]


# ------------------------------------------------------------------------------------------ helpers
def _zero(like: Tensor) -> Tensor:
    return torch.zeros((), dtype=like.dtype, device=like.device)


def _mean_std(x: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and population std of a vector (both 0 when it is empty)."""
    if x.numel() == 0:
        return _zero(x), _zero(x)
    return x.mean(), x.std(correction=0) if x.numel() > 1 else _zero(x)


def _frac(cond: Tensor) -> Tensor:
    return cond.float().mean() if cond.numel() else torch.zeros((), device=cond.device)


def _detach(stats: Stats) -> Stats:
    return {k: v.detach() if isinstance(v, Tensor) else v for k, v in stats.items()}


def _rows_of(x: float | Tensor, tb: TokenBatch) -> float | Tensor:
    """A per-position tensor (shape of input_ids) read at the head rows; scalars pass through."""
    if isinstance(x, Tensor) and x.ndim > 0:
        if tuple(x.shape) != tuple(tb.batch["input_ids"].shape):
            raise ValueError(f"temperature tensor must have the shape of input_ids, got {tuple(x.shape)}")
        return x.reshape(-1)[tb.rows]
    return x


def _seq_logp(lp: Tensor, tb: TokenBatch, length_normalize: bool) -> Tensor:
    """L_b = sum_t M_t lp_t, divided by n_b when length_normalize."""
    total = tb.seq_sum(tb.mask * lp)
    return total / tb.seqs["counts"] if length_normalize else total


def _old_logp(tb: TokenBatch, key: str, length_normalize: bool, owner: str) -> Tensor:
    old = tb.per_seq(key, owner)
    return old / tb.seqs["counts"] if length_normalize else old


def _common_stats(lp: Tensor, H: Tensor | None, tb: TokenBatch) -> Stats:
    """logp_mean = mean_b sum_t M lp (not normalised), avg_action_tokens, entropy_mean = sum M H / sum M."""
    stats: Stats = {
        "logp_mean": tb.seq_sum(tb.mask * lp).mean(),
        "avg_action_tokens": tb.seqs["raw_counts"].mean(),
    }
    if H is not None:
        stats["entropy_mean"] = (tb.mask * H).sum() / tb.total_mask.clamp(min=1.0)
    return stats


# --------------------------------------------------------------------------------------------- base
class HeadLoss:
    """Base of every loss: the calling conventions and the head pass (fused, generic or logits).

    Subclasses implement `objective(lp, H, tb, with_stats) -> (loss, stats)` on the flat action tokens;
    `coupled` says whether a token's gradient depends on other tokens; `needs_entropy` whether H is read.
    """

    coupled: bool = False
    needs_entropy: bool = False

    def objective(self, lp: Tensor, H: Tensor | None, tb: TokenBatch, with_stats: bool) -> tuple[Tensor, Stats]:
        raise NotImplementedError

    def coupling_groups(self, tb: TokenBatch) -> list[int] | None:
        """For a coupled loss whose tokens couple only within groups: the token offsets where groups start
        (the fused mode then keeps groups whole in its chunks and runs one pass). None: the whole batch."""
        return None

    def compute(self, logits: Tensor, batch: Batch) -> tuple[Tensor, Stats]:
        """Ludic's signature: the loss on materialised logits [B, T, V] (or [1, total, V] packed)."""
        return self(batch, logits=logits)

    def __call__(
        self,
        batch: Batch,
        *,
        hidden: Tensor | None = None,
        weight: Tensor | None = None,
        bias: Tensor | None = None,
        logits: Tensor | None = None,
        fused: bool = True,
        backend: str = "auto",
        chunk_elements: int | None = None,
        memory_budget: int | str | None = None,
        logit_scale: float = 1.0,
        softcap: float | None = None,
        temperature: float | Tensor = 1.0,
    ) -> tuple[Tensor, Stats]:
        """(loss, stats) from hidden states + lm_head weight (`hidden [B, T, D]`, `weight [V, D]`,
        optional `bias [V]`, head transform `softcap(logit_scale (h W^T + b)) / T`) or from `logits`.
        `memory_budget` (bytes, or a string like '4GiB') bounds the head's transient memory, the cost model
        (`ludic_fast.ops.plan`) picks its chunking; `chunk_elements` is the low-level override."""
        if (hidden is None) == (logits is None):
            raise ValueError("pass exactly one of hidden= (with weight=) or logits=")
        tb = TokenBatch.from_batch(batch)
        guard = _mask_guard(batch)
        if logits is not None:
            lp, H = _logits_rows(logits, tb, self.needs_entropy)
            loss, stats = self.objective(lp, H, tb, True)
            return loss * guard, _detach(stats)
        h, temp = _hidden_rows(hidden, weight, tb), _rows_of(temperature, tb)
        if not fused:  # linear_logprobs validates its inputs
            out = linear_logprobs(
                h, weight, tb.targets, bias=bias, logit_scale=logit_scale, softcap=softcap, temperature=temp,
                entropy=self.needs_entropy, backend=backend, chunk_elements=chunk_elements,
                memory_budget=memory_budget,
            )
            loss, stats = self.objective(out.logprobs, out.entropy, tb, True)
            return loss * guard, _detach(stats)
        validate_head_inputs(h, weight, tb.targets, bias, logit_scale, softcap, temp, -100)
        transform = HeadTransform.build(logit_scale, softcap, temp, tb.n, h.device)

        def objective(lp: Tensor, H: Tensor | None, rows: slice | None) -> Tensor:
            return self.objective(lp, H, tb if rows is None else tb.subset(rows), False)[0]

        impl = resolve_backend(backend, h.device)
        plan = FusedPlan(transform, objective, self.coupled, self.needs_entropy, chunk_elements, impl,
                         groups=self.coupling_groups(tb) if self.coupled else None,
                         memory_budget=parse_memory_budget(memory_budget))
        loss, lp, H = fused_head_loss(h, weight, bias, tb.targets, plan)
        with torch.no_grad():
            _, stats = self.objective(lp, H, tb, True)
        stats["loss"] = loss = loss * guard
        return loss, _detach(stats)


def _mask_guard(batch: Batch) -> Tensor:
    """1, or NaN when batch['action_mask'] has a negative entry (which action selection, `> 0`, would drop
    silently): the loss is multiplied by it, so such a batch gives a NaN loss and NaN gradients, checked on
    the device without a host sync."""
    mask = batch["action_mask"]
    return torch.where((mask < 0).any(), math.nan, 1.0).to(mask.device)


def _logits_rows(logits: Tensor, tb: TokenBatch, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    shape = tuple(tb.batch["input_ids"].shape)
    if not isinstance(logits, Tensor) or tuple(logits.shape[:-1]) != shape or logits.ndim != 3:
        raise ValueError(f"logits must have shape [*input_ids.shape, V] = [{shape}, V], got {tuple(logits.shape)}")
    z = logits.reshape(-1, logits.shape[-1]).index_select(0, tb.rows)
    logp = torch.log_softmax(z if z.dtype == torch.float64 else z.float(), dim=-1)
    lp = logp.gather(1, tb.targets[:, None]).squeeze(1)
    H = -(logp.exp() * logp).sum(-1) if with_entropy else None
    return lp, H


def _hidden_rows(hidden: Tensor, weight: Tensor | None, tb: TokenBatch) -> Tensor:
    shape = tuple(tb.batch["input_ids"].shape)
    if not isinstance(hidden, Tensor) or tuple(hidden.shape[:-1]) != shape or hidden.ndim != 3:
        raise ValueError(f"hidden must have shape [*input_ids.shape, D] = [{shape}, D], got {tuple(hidden.shape)}")
    if weight is None:
        raise ValueError("weight (the lm_head weight [V, D]) is required with hidden=")
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, tb.rows)


# ------------------------------------------------------------------------- sequence-level (Ludic)
def _sequence_is_stats(adv: Tensor, L: Tensor, ratio: Tensor, log_ratio: Tensor) -> Stats:
    adv_mean, adv_std = _mean_std(adv)
    r_mean, r_std = _mean_std(ratio)
    return {
        "adv_mean": adv_mean,
        "adv_std": adv_std,
        "logp_mean": L.mean(),
        "ratio_mean": r_mean,
        "ratio_std": r_std,
        "kl_actor_policy": (ratio - log_ratio - 1).mean(),
    }


class _SequenceISLoss(HeadLoss):
    """loss = -mean_b sg(R_b) A_b L_b, R_b = exp(L_b - O_b): unclipped sequence IS (coupled, 8NDV)."""

    length_normalize: bool
    old_logp_key: str
    coupled = True

    def _advantage(self, tb: TokenBatch) -> tuple[Tensor, Stats]:
        return tb.per_seq("weight", type(self).__name__), {}

    def objective(self, lp, H, tb, with_stats):
        name = type(self).__name__
        old = _old_logp(tb, self.old_logp_key, self.length_normalize, name)
        adv, extra = self._advantage(tb)
        L = _seq_logp(lp, tb, self.length_normalize)
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
            adv = adv / (_mean_std(adv)[1] + 1e-8)
        return adv, {"baseline": baseline}


@dataclass
class MaskedCausalLMCrossEntropyLoss(HeadLoss):
    """SFT: nll_b = -L_b; loss = mean_b nll_b w_b (w = batch['weight'] when present). Token-local."""

    length_normalize: bool = True

    def objective(self, lp, H, tb, with_stats):
        nll = -_seq_logp(lp, tb, self.length_normalize)
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


def _check_at_least(name: str, value: float, low: float, strict: bool = False) -> None:
    """ValueError naming `name` unless value >= low (> low when strict); NaN never passes."""
    ok = value > low if strict else value >= low
    if not ok:  # also NaN
        raise ValueError(f"{name} must be {'>' if strict else '>='} {low}, got {value}")


def _check_eps(low: float, high: float, ratio_clip: float | None) -> None:
    """Clip widths ε >= 0 keep the bounds 1 - ε_lo <= 1 <= 1 + ε_hi in order."""
    _check_at_least("clip_eps_low", low, 0.0)
    _check_at_least("clip_eps_high", high, 0.0)
    if ratio_clip is not None:
        _check_at_least("ratio_clip", ratio_clip, 0.0, strict=True)


@dataclass
class ClippedSurrogateLoss(HeadLoss):
    """GSPO. ratio_level='sequence' (Ludic): obj_b = min(R'_b A_b, clip(R'_b, 1-ε_lo, 1+ε_hi) A_b),
    R_b = exp(L_b - O_b), R' = min(R, ratio_clip); loss = -mean_b obj_b.
    ratio_level='token' (GSPO-token): s_t = sg(R_b) exp(lp_t - sg(lp_t)) with per-token advantages,
    o_t = min(s'_t A_t, clip(s'_t) A_t); loss = -mean_b sum_t M o_t / n_b. Both coupled (8NDV)."""

    clip_eps_low: float = 3e-4
    clip_eps_high: float = 4e-4
    old_logp_key: str = "old_logp_action"
    length_normalize: bool = False
    ratio_clip: float | None = None
    ratio_level: str = field(default="sequence", kw_only=True)
    coupled = True

    def __post_init__(self) -> None:
        _check_eps(self.clip_eps_low, self.clip_eps_high, self.ratio_clip)
        if self.ratio_level not in ("sequence", "token"):
            raise ValueError(f"ratio_level must be 'sequence' or 'token', got {self.ratio_level!r}")

    def objective(self, lp, H, tb, with_stats):
        name = type(self).__name__
        old = _old_logp(tb, self.old_logp_key, self.length_normalize, name)
        L = _seq_logp(lp, tb, self.length_normalize)
        log_ratio = L - old
        lo, hi = 1.0 - self.clip_eps_low, 1.0 + self.clip_eps_high
        if self.ratio_level == "sequence":
            adv = tb.per_seq("weight", name)
            ratio = self._cap(log_ratio.exp())
        else:
            adv = tb.advantages(name)
            ratio = self._cap(torch.exp(lp - lp.detach() + log_ratio.detach()[tb.seq]))
        obj = torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv)
        if self.ratio_level == "sequence":
            loss = -obj.mean()
        else:
            loss = -(obj * tb.mask * tb.agg_coef("seq_mean_token_mean")).sum()
        if not with_stats:
            return loss, {}
        r = self._cap(log_ratio.detach().exp())
        r_mean, r_std = _mean_std(r)
        adv_mean, adv_std = _mean_std(tb.per_seq("weight", name) if "advantages" not in tb.tokens else adv)
        return loss, {
            "loss": loss,
            "ratio_mean": r_mean,
            "ratio_std": r_std,
            "clip_frac": _frac((r > hi) | (r < lo)),
            "ratio_clip_frac": _frac(r >= self.ratio_clip) if self.ratio_clip is not None else _zero(r),
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
        loss = self.coeff * _seq_logp(delta, tb, self.length_normalize).mean()
        if not with_stats:
            return loss, {}
        kl_mean, kl_std = _mean_std(delta)
        r_mean, r_std = _mean_std(delta.exp())
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
        old = _old_logp(tb, self.old_logp_key, self.length_normalize, type(self).__name__)
        kl = _seq_logp(lp, tb, self.length_normalize) - old
        loss = self.coeff * kl.mean()
        if not with_stats:
            return loss, {}
        return loss, {"loss": loss, "kl_mean": kl.mean(), "kl_std": _mean_std(kl)[1]}


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


# --------------------------------------------------------------------------- token policy family
_KL_ESTIMATORS = ("k1", "k2", "k3")


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
        if self.kl_estimator not in _KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {_KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.entropy_top_rho is not None and not 0 < self.entropy_top_rho <= 1:
            raise ValueError(f"entropy_top_rho must lie in (0, 1], got {self.entropy_top_rho}")
        if self.alpha_zvp is not None:
            _check_at_least("alpha_zvp", self.alpha_zvp, 0.0)


class _TokenPolicyLoss(HeadLoss, PolicyOptions):
    """loss = sum_t c_t M_t [ w_t l_t + β kl_t - c_H H_t ], l_t the policy term of the subclass,
    w_t = IS weight x top-ρ mask (detached), c_t the aggregation coefficient."""

    length_normalize: bool

    @property
    def coupled(self) -> bool:  # type: ignore[override]
        return self.entropy_top_rho is not None or self.alpha_zvp is not None

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
        d = lp - tb.token("ref_logps", f"{type(self).__name__}(kl_coeff)")
        if self.kl_estimator == "k1":
            return d
        if self.kl_estimator == "k2":
            return 0.5 * d * d
        return torch.exp(-d) - 1.0 + d

    def _stats(self, loss, lp, H, tb, log_ratio, ratio, adv, pstats) -> Stats:
        r_mean, r_std = _mean_std(ratio)
        if "weight" in tb.seqs and "advantages" not in tb.tokens:
            adv_mean, adv_std = _mean_std(tb.seqs["weight"])
        else:
            adv_mean, adv_std = _mean_std(adv.detach())
        stats: Stats = {
            "loss": loss,
            "ratio_mean": r_mean,
            "ratio_std": r_std,
            **pstats,
            "kl_actor_policy": _mean_std(log_ratio.exp() - log_ratio - 1)[0],
            "adv_mean": adv_mean,
            "adv_std": adv_std,
            **_common_stats(lp.detach(), H.detach() if self.needs_entropy else None, tb),
        }
        if self.alpha_zvp is not None:
            zvp = (tb.per_seq("zvp_direction", "alpha_zvp") != 0).float()
            stats["zvp_frac"] = zvp.mean()
            on = zvp[tb.seq]
            stats["zvp_adv_mean"] = (adv.detach() * on).sum() / on.sum().clamp(min=1.0)
        if self.kl_coeff != 0.0:
            stats["kl_ref_mean"] = _mean_std(self._kl(lp.detach(), tb))[0]
        if self.is_level is not None:
            stats["is_weight_mean"] = _mean_std(self._is_weights(tb))[0]
        if self.entropy_top_rho is not None:
            stats["entropy_keep_frac"] = _mean_std(self._top_rho_keep(H.detach(), tb))[0]
        return stats


def _clip_stats(r: Tensor, lo: float | None, hi: float) -> Stats:
    low = r < lo if lo is not None else torch.zeros_like(r, dtype=torch.bool)
    high = r > hi
    return {"clip_frac": _frac(low | high), "clip_frac_low": _frac(low), "clip_frac_high": _frac(high)}


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
        _check_eps(self.clip_eps_low, self.clip_eps_high, self.ratio_clip)
        if self.dual_clip is not None:
            _check_at_least("dual_clip", self.dual_clip, 1.0, strict=True)
        self._check_options()

    def _policy(self, lp, ratio, adv):
        r = ratio if self.ratio_clip is None else torch.clamp(ratio, max=self.ratio_clip)
        lo, hi = 1.0 - self.clip_eps_low, 1.0 + self.clip_eps_high
        obj = torch.minimum(r * adv, torch.clamp(r, lo, hi) * adv)
        if self.dual_clip is not None:
            obj = torch.where(adv < 0, torch.maximum(obj, self.dual_clip * adv), obj)
        rd = r.detach()
        stats = _clip_stats(rd, lo, hi)
        stats["ratio_clip_frac"] = _frac(rd >= self.ratio_clip) if self.ratio_clip is not None else _zero(rd)
        return -obj, r, stats


@dataclass
class CISPOLoss(_TokenPolicyLoss):
    """CISPO: l_t = -sg(w_t) A_t lp_t, w = clip(r, 1-ε_lo, 1+ε_hi) (cispo_bound='relative', Ludic/verl) or
    w = min(r, clip_eps_high) (cispo_bound='absolute', TRL/ScaleRL). Token-local."""

    clip_eps_low: float = 1e6
    clip_eps_high: float = 0.2
    length_normalize: bool = True
    cispo_bound: str = field(default="relative", kw_only=True)

    def __post_init__(self) -> None:
        _check_eps(self.clip_eps_low, self.clip_eps_high, None)
        if self.cispo_bound not in ("relative", "absolute"):
            raise ValueError(f"cispo_bound must be 'relative' or 'absolute', got {self.cispo_bound!r}")
        self._check_options()

    def _policy(self, lp, ratio, adv):
        r = ratio.detach()
        if self.cispo_bound == "absolute":
            return _cispo_term(lp, r, adv, None, self.clip_eps_high)
        return _cispo_term(lp, r, adv, 1.0 - self.clip_eps_low, 1.0 + self.clip_eps_high)


def _cispo_term(lp: Tensor, r: Tensor, adv: Tensor, lo: float | None, hi: float) -> tuple[Tensor, Tensor, Stats]:
    w = torch.clamp(r, min=lo, max=hi)
    return -(w * adv * lp), r, _clip_stats(r, lo, hi)


@dataclass
class ZVPCISPOLoss(CISPOLoss):
    """RL-ZVP (arXiv 2509.21880) inside CISPO: zvp_direction +1 sequences get A_t = α sg(H_t), -1 get
    A_t = -α (max over the response of sg(H) - sg(H_t)), 0 are CISPOLoss exactly. Coupled (8NDV)."""

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
        _check_at_least("eps_max", self.eps_max, 0.0, strict=True)
        self._check_options()

    def _default_aggregation(self) -> str:
        return "prompt_mean"

    def _policy(self, lp, ratio, adv):
        return _cispo_term(lp, ratio.detach(), adv, None, self.eps_max)


@dataclass
class SAPOLoss(_TokenPolicyLoss):
    """SAPO (arXiv 2511.20347): l_t = -(4/τ) σ(τ (r_t - 1)) A_t, τ = tau_pos if A_t > 0 else tau_neg."""

    tau_pos: float = 1.0
    tau_neg: float = 1.05
    length_normalize: bool = False

    def __post_init__(self) -> None:
        _check_at_least("tau_pos", self.tau_pos, 0.0, strict=True)
        _check_at_least("tau_neg", self.tau_neg, 0.0, strict=True)
        self._check_options()

    def _policy(self, lp, ratio, adv):
        tau = torch.where(adv > 0, self.tau_pos, self.tau_neg)
        return -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * adv, ratio, {}


# ------------------------------------------------------------------------------------ composition
@dataclass
class LossTerm:
    """One named, weighted term of a CompositeLoss."""

    name: str
    loss: HeadLoss
    weight: float = 1.0


@dataclass
class CompositeLoss(HeadLoss):
    """total = sum_i weight_i loss_i over ONE head pass; stats '{name}/{k}', '{name}/weight', 'loss'."""

    terms: list[LossTerm] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.terms:
            raise ValueError("CompositeLoss needs at least one LossTerm")
        for term in self.terms:
            if not isinstance(term.loss, HeadLoss):
                raise TypeError(f"term {term.name!r}: loss must be a ludic_fast.losses loss, got {type(term.loss)}")

    @property
    def coupled(self) -> bool:  # type: ignore[override]
        return any(t.loss.coupled for t in self.terms)

    @property
    def needs_entropy(self) -> bool:  # type: ignore[override]
        return any(t.loss.needs_entropy for t in self.terms)

    def objective(self, lp, H, tb, with_stats):
        total = None
        stats: Stats = {}
        for term in self.terms:
            loss, child = term.loss.objective(lp, H, tb, with_stats)
            total = term.weight * loss if total is None else total + term.weight * loss
            if with_stats:
                stats[f"{term.name}/loss"] = loss
                stats[f"{term.name}/weight"] = float(term.weight)
                stats.update({f"{term.name}/{k}": v for k, v in child.items() if k != "loss"})
        if with_stats:
            stats["loss"] = total
        return total, stats


_PREFERENCE = ("DPOLoss", "IPOLoss", "SimPOLoss", "ORPOLoss", "KTOLoss", "CPOLoss")


def __getattr__(name: str):
    """The preference losses live in `ludic_fast.preference` (which imports this module); re-exported here."""
    if name in _PREFERENCE:
        from ludic_fast import preference

        return getattr(preference, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    *_PREFERENCE,
    "HeadLoss",
    "PolicyOptions",
    "ReinforceLoss",
    "ReinforceBaselineLoss",
    "MaskedCausalLMCrossEntropyLoss",
    "ClippedSurrogateLoss",
    "TokenClippedSurrogateLoss",
    "CISPOLoss",
    "ZVPCISPOLoss",
    "ScaleRLLoss",
    "SAPOLoss",
    "TokenKLLoss",
    "KLLoss",
    "EntropyBonus",
    "LossTerm",
    "CompositeLoss",
]
