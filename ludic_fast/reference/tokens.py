"""What every Ludic-layout loss twin shares: the token log-probs of a batch on the causal shift, the shifted
masks, masked statistics and the loss base class."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ludic_fast.reference.head import token_entropy

Batch = Mapping[str, Tensor]
Stats = dict[str, Any]


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
