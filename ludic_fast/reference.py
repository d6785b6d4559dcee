"""The executable spec: plain PyTorch on materialised logits.

Every op and loss of ludic_fast is tested against the functions and classes here. Nothing is chunked or
fused; clarity over speed. Logits are computed in float32 (float64 when an input is float64, for
finite-difference checks).

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
    logits = logits if logits.dtype == torch.float64 else logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    valid = targets != ignore_index
    safe_targets = torch.where(valid, targets, torch.zeros_like(targets))
    lp = logp.gather(-1, safe_targets.unsqueeze(-1).long()).squeeze(-1) * valid
    ent = None
    if entropy:
        ent = -(logp.exp() * logp).sum(-1) * valid
    lse = torch.logsumexp(logits, dim=-1).detach()
    return HeadOutput(lp, ent, lse)


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
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


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
    """loss = -coeff * (sum H M / sum M) over the micro-batch (0 when nothing is masked in).

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
            logp = torch.log_softmax(logits.float(), dim=-1)
            ent = -(logp.exp() * logp).sum(-1)
            mask = batch["action_mask"].to(ent.dtype)
        denom = mask.sum()
        mean_h = (ent * mask).sum() / denom.clamp(min=1.0)
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


__all__ = [
    "head_logits",
    "logprobs_from_logits",
    "linear_logprobs",
    "linear_cross_entropy",
    "compute_token_logp",
    "compute_token_entropy",
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
]
