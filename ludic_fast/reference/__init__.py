"""The executable spec: plain PyTorch on materialised logits.

Every op and loss of ludic_fast is tested against the functions and classes here. Nothing is chunked or
fused; clarity over speed. Logits are computed in float32 (float64 when an input is float64, for
finite-difference checks); log-softmax and entropy are taken from them in float64 (`token_entropy`: exact
for confident tokens and for masked columns of logit -inf) and returned as float32 (float64 for float64).

Head:   z = softcap(logit_scale * (h W^T + b)) / T,   softcap(x) = c * tanh(x / c)
        logprob_t = z_{t, y_t} - logsumexp(z_t),       H_t = -sum_v p_{t,v} log p_{t,v}

Losses follow Ludic master (joanvelja/ludic @ 321e8d7) exactly, on the causal shift: position j of the
logits scores token j+1; M[b,j] = action_mask[b,j+1]; n[b] = max(1, sum_j M[b,j]).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ludic_fast._common import HeadOutput, per_token_temperature, validate_head_inputs
from ludic_fast.reference.divergence import linear_divergence
from ludic_fast.reference.preference import CPOLoss, DPOLoss, IPOLoss, KTOLoss, ORPOLoss, SimPOLoss

Batch = Mapping[str, Tensor]
Stats = dict[str, Any]


# --------------------------------------------------------------------------------------------- head op
def head_logits(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    temperature: float | Tensor = 1.0,
) -> Tensor:
    """Materialised final logits `softcap(logit_scale * (h W^T + b)) / T`, float32 (float64 if any input is)."""
    dtype = torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32
    z = hidden.to(dtype) @ weight.to(dtype).T
    if bias is not None:
        z = z + bias.to(dtype)
    z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    temp = per_token_temperature(temperature, hidden.shape[:-1].numel(), hidden.device)
    return z / temp.to(dtype).reshape(*hidden.shape[:-1], 1)


def logprobs_from_logits(
    logits: Tensor, targets: Tensor, *, entropy: bool = True, ignore_index: int = -100
) -> HeadOutput:
    """Per-token log p(target), entropy and logsumexp from materialised logits `[..., V]`."""
    out_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logp = torch.log_softmax(logits.double(), dim=-1)
    valid = targets != ignore_index
    safe_targets = torch.where(valid, targets, torch.zeros_like(targets))
    zero = torch.zeros((), dtype=torch.float64, device=logits.device)
    lp = torch.where(valid, logp.gather(-1, safe_targets.unsqueeze(-1).long()).squeeze(-1), zero).to(out_dtype)
    ent = None
    if entropy:
        ent = torch.where(valid, _entropy_from_logp(logp), zero).to(out_dtype)
    lse = torch.logsumexp(logits.double(), dim=-1).to(out_dtype).detach()
    return HeadOutput(lp, ent, lse)


def _entropy_from_logp(logp: Tensor) -> Tensor:
    """H = -sum_v p_v log p_v over the last dim, with 0 log 0 = 0 (value and gradient) for p_v = 0."""
    p = logp.exp()
    safe_logp = torch.where(p > 0, logp, torch.zeros((), dtype=logp.dtype, device=logp.device))
    return -(p * safe_logp).sum(-1)


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim: float64 log-softmax (shifted by the row maximum, so a
    confident token keeps its relative precision), 0 log 0 = 0; float32 out (float64 for float64 logits)."""
    out_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return _entropy_from_logp(torch.log_softmax(logits.double(), dim=-1)).to(out_dtype)


def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    temperature: float | Tensor = 1.0,
    entropy: bool = True,
    ignore_index: int = -100,
) -> HeadOutput:
    """Reference for `ludic_fast.linear_logprobs`: materialises all `[N, V]` logits."""
    validate_head_inputs(hidden, weight, targets, bias, logit_scale, softcap, temperature, ignore_index)
    logits = head_logits(
        hidden, weight, bias, logit_scale=logit_scale, softcap=softcap, temperature=temperature
    )
    return logprobs_from_logits(logits, targets, entropy=entropy, ignore_index=ignore_index)


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    reduction: str = "mean",
    ignore_index: int = -100,
    **head_kwargs: Any,
) -> Tensor:
    """Reference SFT cross-entropy `-logprob`, reduced over non-ignored tokens (none | sum | mean)."""
    out = linear_logprobs(hidden, weight, targets, entropy=False, ignore_index=ignore_index, **head_kwargs)
    nll = -out.logprobs
    if reduction == "none":
        return nll
    if reduction == "sum":
        return nll.sum()
    if reduction == "mean":
        return nll.sum() / (targets != ignore_index).sum().clamp(min=1)
    raise ValueError(f"reduction must be 'none', 'sum' or 'mean', got {reduction!r}")


# ------------------------------------------------------------------------------ Ludic token helpers
def _check_logits_batch(logits: Tensor, input_ids: Tensor) -> None:
    if logits.ndim != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    if tuple(input_ids.shape) != tuple(logits.shape[:2]):
        raise ValueError(f"input_ids shape {tuple(input_ids.shape)} must equal logits.shape[:2]")
    if logits.shape[1] < 2:
        raise ValueError("sequences need T >= 2 for the causal shift")


def compute_token_logp(logits: Tensor, input_ids: Tensor) -> Tensor:
    """ℓ[b, j] = log_softmax(z[b, j])[x[b, j+1]], shape [B, T-1] (Ludic's compute_token_logp)."""
    _check_logits_batch(logits, input_ids)
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1).long()).squeeze(-1)


def compute_token_entropy(logits: Tensor) -> Tensor:
    """H[b, j] = entropy of softmax(z[b, j]) at the shifted positions, shape [B, T-1]."""
    return token_entropy(logits[:, :-1])


def compute_logp_action(
    logits: Tensor, input_ids: Tensor, action_mask: Tensor, *, length_normalize: bool = False
) -> Tensor:
    """L[b] = sum_j M[b,j] ℓ[b,j], divided by n[b] when length_normalize."""
    token_logp = compute_token_logp(logits, input_ids)
    mask = action_mask[:, 1:].to(token_logp.dtype)
    total = (token_logp * mask).sum(-1)
    if length_normalize:
        total = total / mask.sum(-1).clamp(min=1.0)
    return total


class _Shifted:
    """The shifted per-token tensors a Ludic loss reads (the role of Ludic's SharedContext)."""

    def __init__(self, logits: Tensor, batch: Batch):
        self.batch = batch
        self.token_logp = compute_token_logp(logits, batch["input_ids"])
        self.mask = batch["action_mask"][:, 1:].to(self.token_logp.dtype)
        self.counts = self.mask.sum(-1).clamp(min=1.0)

    def logp_action(self, length_normalize: bool) -> Tensor:
        total = (self.token_logp * self.mask).sum(-1)
        return total / self.counts if length_normalize else total

    def actor_logps(self, owner: str) -> Tensor:
        if "actor_logps" not in self.batch:
            raise KeyError(f"{owner} requires batch['actor_logps'] (behaviour log-probs at action positions)")
        actor = self.batch["actor_logps"]
        if tuple(actor.shape) != tuple(self.batch["input_ids"].shape):
            raise ValueError(
                f"actor_logps shape {tuple(actor.shape)} must equal input_ids shape "
                f"{tuple(self.batch['input_ids'].shape)}"
            )
        return actor[:, 1:].to(self.token_logp.dtype)

    def old_logp(self, key: str, length_normalize: bool) -> Tensor:
        if key not in self.batch:
            raise KeyError(f"missing batch[{key!r}] (sum of behaviour log-probs per sequence)")
        old = self.batch[key].to(self.token_logp.dtype)
        return old / self.counts if length_normalize else old


def _pop_std(x: Tensor) -> Tensor:
    return x.std(unbiased=False) if x.numel() > 1 else torch.zeros((), dtype=x.dtype, device=x.device)


def _masked_mean_std(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and population std of x over mask > 0 (both 0 when nothing is selected)."""
    sel = mask > 0
    count = sel.sum()
    if int(count) == 0:
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        return zero, zero
    vals = x[sel]
    return vals.mean(), vals.std(unbiased=False) if vals.numel() > 1 else torch.zeros_like(vals.mean())


def _masked_frac(cond: Tensor, mask: Tensor) -> Tensor:
    sel = mask > 0
    if int(sel.sum()) == 0:
        return torch.zeros((), dtype=torch.float32, device=cond.device)
    return cond[sel].float().mean()


def _detach(stats: Stats) -> Stats:
    return {k: v.detach() if isinstance(v, Tensor) else v for k, v in stats.items()}


class _LudicLoss:
    """Calling conventions shared by every reference loss: `loss(batch, logits=...)` and Ludic's
    `loss.compute(logits, batch)`; both return `(scalar_loss, stats)`."""

    def __call__(self, batch: Batch, *, logits: Tensor) -> tuple[Tensor, Stats]:
        return self.compute(logits, batch)

    def compute(self, logits: Tensor, batch: Batch) -> tuple[Tensor, Stats]:
        loss, stats = self._compute(_Shifted(logits, batch), logits)
        return loss, _detach(stats)

    def _compute(self, s: _Shifted, logits: Tensor) -> tuple[Tensor, Stats]:  # pragma: no cover
        raise NotImplementedError


def _check_eps(low: float, high: float, ratio_clip: float | None) -> None:
    if low < 0 or high < 0:
        raise ValueError(f"clip_eps_low and clip_eps_high must be >= 0, got {low}, {high}")
    if ratio_clip is not None and ratio_clip <= 0:
        raise ValueError(f"ratio_clip must be > 0, got {ratio_clip}")


# ------------------------------------------------------------------------------------ Ludic losses
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


# -------------------------------------------------------------- twins of the new losses and options
# Straightforward code on the shifted [B, T-1] tensors of materialised logits (padded layout only: a packed
# batch is checked against its padded twin). `ludic_fast.losses` must give the same numbers.
def _token_values(batch: Batch, key: str, owner: str) -> Tensor:
    if key not in batch:
        raise KeyError(f"{owner} requires batch[{key!r}]")
    return batch[key][:, 1:].float()


def _aggregate(x: Tensor, s: _Shifted, aggregation: str, normalizer: float | None, norm_length: float | None) -> Tensor:
    """Reduce the masked per-token terms x [B, T-1] (already multiplied by M) to the loss. With the trainer's
    macro-batch totals in the batch (token_batch.py), token and prompt counts are the macro-batch's."""
    B = x.shape[0]
    macro = "macro_tokens_per_seq" in s.batch
    if aggregation == "token_mean":
        if normalizer is None:
            normalizer = B * s.batch["macro_tokens_per_seq"] if macro else s.mask.sum().clamp(min=1.0)
        return x.sum() / normalizer
    if aggregation == "seq_mean_token_mean":
        return (x.sum(-1) / s.counts).sum() / (normalizer or B)
    if aggregation == "seq_mean_token_sum":
        return x.sum() / (normalizer or B)
    if aggregation == "seq_mean_token_sum_norm":
        return x.sum() / ((normalizer or B) * norm_length)
    if aggregation == "prompt_mean":
        groups = s.batch["group_id"]
        per_prompt = []
        for g in torch.unique(groups):
            rows = groups == g
            size = s.batch["macro_prompt_tokens"][rows][0] if macro else s.mask[rows].sum()
            per_prompt.append(x[rows].sum() / size.clamp(min=1.0))
        total = torch.stack(per_prompt).sum()
        if normalizer is None:
            normalizer = B * s.batch["macro_prompts_per_seq"] if macro else len(per_prompt)
        return total / normalizer
    raise ValueError(f"unknown aggregation {aggregation!r}")


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


__all__ = [
    "linear_divergence",
    "CPOLoss",
    "DPOLoss",
    "IPOLoss",
    "KTOLoss",
    "ORPOLoss",
    "SimPOLoss",
    "head_logits",
    "logprobs_from_logits",
    "linear_logprobs",
    "linear_cross_entropy",
    "compute_token_logp",
    "compute_token_entropy",
    "token_entropy",
    "compute_logp_action",
    "ReinforceLoss",
    "ReinforceBaselineLoss",
    "MaskedCausalLMCrossEntropyLoss",
    "ClippedSurrogateLoss",
    "TokenClippedSurrogateLoss",
    "CISPOLoss",
    "TokenKLLoss",
    "KLLoss",
    "EntropyBonus",
    "LossTerm",
    "CompositeLoss",
    "TokenSurrogateLoss",
    "ZVPCISPOLoss",
    "ScaleRLLoss",
    "SAPOLoss",
    "GSPOTokenLoss",
]
