"""Reward-model loss: a scalar value head on the final hidden states and the Bradley-Terry pairwise loss.

The reward of a sequence is the value head at one token: r_b = w · h_{b, read} + c, with `read` the last
attended position of a padded row (right padding) or the last position of a packed sequence; with
`pad_token_id` given, the last position of the sequence whose token differs from it (the read-out of
transformers' `*ForSequenceClassification`: with pad = eos, as TRL sets it when the tokenizer has no pad
token, the reward is read at the token before the trailing eos). Rewards are float32, float64 when the
hidden states or the value head are float64.
Pairs use the layout of `ludic_fast.data.pair_batching.collate_pairs` (sequence 2i chosen, 2i+1 rejected).

Bradley-Terry (Bradley & Terry 1952; as a reward-model loss, Ouyang et al., arXiv 2203.02155, eq. 1):

    loss = mean_pairs -log σ(r_w - r_l - μ) + c_center · mean_pairs (r_w + r_l)²

μ an optional per-pair margin from `batch['margin']` [P] (Llama 2, arXiv 2307.09288 §3.2.2),
c_center the reward-centering coefficient (Eisenstein et al., arXiv 2312.09244; TRL's
`center_rewards_coefficient`). Stats: rewards_chosen / _rejected, rewards_margin, rewards_accuracy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

Batch = Mapping[str, Tensor]


def _sequence_of_positions(batch: Batch) -> tuple[Tensor, Tensor, int]:
    """(sequence id per flat position, 1 where the position belongs to a sequence, number of sequences)."""
    ids = batch["input_ids"]
    if "cu_seqlens" in batch:
        cu = batch["cu_seqlens"].to(device=ids.device, dtype=torch.long)
        pos = torch.arange(ids.numel(), device=ids.device)
        seq = torch.searchsorted(cu[1:], pos, right=True)
        return seq.clamp(max=cu.numel() - 2), (pos < cu[-1]), cu.numel() - 1
    B, T = ids.shape
    attn = batch.get("attention_mask")
    inside = torch.ones(B, T, dtype=torch.bool, device=ids.device) if attn is None else attn > 0
    return torch.arange(B, device=ids.device).repeat_interleave(T), inside.reshape(-1), B


def last_positions(batch: Batch, pad_token_id: int | None = None) -> Tensor:
    """Flat index (into hidden.reshape(-1, D)) of each sequence's last token [S] (attended, padded layout), or
    with `pad_token_id` its last token whose id is not pad_token_id."""
    seq, keep, n_seq = _sequence_of_positions(batch)
    if pad_token_id is not None:
        keep = keep & (batch["input_ids"].reshape(-1) != pad_token_id)
    pos = torch.arange(seq.numel(), device=seq.device)
    last = torch.full((n_seq,), -1, device=seq.device).scatter_reduce(0, seq[keep], pos[keep], "amax")
    if bool((last < 0).any()):
        what = "attended token" if pad_token_id is None else f"token other than pad_token_id={pad_token_id}"
        raise ValueError(f"every sequence needs at least one {what}")
    return last


def sequence_rewards(
    batch: Batch, hidden: Tensor, weight: Tensor, bias: Tensor | None = None, pad_token_id: int | None = None
) -> Tensor:
    """r_b = w · h_{b, read} + c [S] (float32, float64 for float64 inputs); `weight` [1, D] or [D] (an
    nn.Linear(D, 1)), `bias` [1] or None; the read position as `last_positions(batch, pad_token_id)`."""
    if hidden.ndim != 3 or tuple(hidden.shape[:2]) != tuple(batch["input_ids"].shape):
        raise ValueError(f"hidden must be [*input_ids.shape, D], got {tuple(hidden.shape)}")
    w = weight.reshape(-1)
    if w.numel() != hidden.shape[-1]:
        raise ValueError(f"weight must hold D = {hidden.shape[-1]} values ([1, D] or [D]), got {tuple(weight.shape)}")
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, last_positions(batch, pad_token_id))
    dtype = torch.float64 if torch.float64 in (h.dtype, w.dtype) else torch.float32
    r = h.to(dtype) @ w.to(dtype)
    return r if bias is None else r + bias.to(dtype).reshape(())


def pair_reward_stats(rw: Tensor, rl: Tensor) -> dict[str, Tensor]:
    """Detached statistics of pair rewards r_w, r_l [P]: means of r_w, r_l, r_w - r_l and 1[r_w > r_l]."""
    rw, rl = rw.detach(), rl.detach()
    return {
        "rewards_chosen": rw.mean(),
        "rewards_rejected": rl.mean(),
        "rewards_margin": (rw - rl).mean(),
        "rewards_accuracy": (rw > rl).float().mean(),
    }


@dataclass
class BradleyTerryLoss:
    """Pairwise reward-model loss (module docstring); call with hidden states + value head, or `rewards=` [S].
    `pad_token_id` picks the read position (`last_positions`). The loss is float64 for float64 rewards."""

    center_rewards_coefficient: float = 0.0
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.center_rewards_coefficient < 0:
            raise ValueError(f"center_rewards_coefficient must be >= 0, got {self.center_rewards_coefficient}")

    def __call__(
        self,
        batch: Batch,
        *,
        hidden: Tensor | None = None,
        weight: Tensor | None = None,
        bias: Tensor | None = None,
        rewards: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Any]]:
        if (hidden is None) == (rewards is None):
            raise ValueError("pass exactly one of hidden= (with weight=) or rewards=")
        if hidden is not None:
            if weight is None:
                raise ValueError("weight (the value head weight [1, D]) is required with hidden=")
            rewards = sequence_rewards(batch, hidden, weight, bias, self.pad_token_id)
        elif self.pad_token_id is not None:
            raise ValueError("pad_token_id picks where hidden states are read; with rewards= it has no use")
        if rewards.ndim != 1 or rewards.numel() == 0 or rewards.numel() % 2:
            raise ValueError(f"rewards must be [S] with S even (2i chosen, 2i+1 rejected), got {tuple(rewards.shape)}")
        rw, rl = rewards[0::2], rewards[1::2]
        diff = rw - rl
        if "margin" in batch:
            diff = diff - batch["margin"].to(diff.dtype)
        loss = F.softplus(-diff).mean()
        if self.center_rewards_coefficient:
            loss = loss + self.center_rewards_coefficient * (rw + rl).square().mean()
        return loss, {"loss": loss.detach(), **pair_reward_stats(rw, rl)}


__all__ = ["BradleyTerryLoss", "sequence_rewards", "last_positions", "pair_reward_stats"]
