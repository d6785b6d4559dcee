"""What every loss on the fused LM head shares: `HeadLoss` (the calling conventions and the head pass),
`Stats`, and the helpers on a `TokenBatch` that the RL, preference and reward losses all read.

A loss is written once, as a differentiable function of the per-token log-probs lp [n] and entropies H [n]
of the batch's n action tokens (`ludic_fast.token_batch.TokenBatch`, flat, padded or packed layout).
Calling conventions, all returning `(loss, stats)` with detached 0-d stats and no host sync in the loss:

    loss_fn(batch, hidden=h, weight=W, bias=None)   # fused: dh/dW/db formed in the forward (6NDV or 8NDV)
    loss_fn(batch, hidden=h, weight=W, fused=False) # generic: the head op with autograd (8NDV)
    loss_fn(batch, logits=logits)                   # materialised logits (Ludic's input)
    loss_fn.compute(logits, batch)                  # Ludic's signature

Position t of hidden/logits scores token t+1; only action positions (action_mask[t+1] > 0, same sequence)
enter the head (a negative action_mask entry makes the loss and its gradients NaN rather than being dropped).
Notation: M_t the action-mask value, n_b = max(1, sum_t M_t) per sequence, L_b = sum_t M_t lp_t (/ n_b when
length-normalised).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ludic_fast._common import validate_head_inputs
from ludic_fast.ops import linear_logprobs, resolve_backend
from ludic_fast.ops.budget import parse_memory_budget
from ludic_fast.ops.fused_loss import FusedPlan, fused_head_loss
from ludic_fast.ops.torch_head import HeadTransform
from ludic_fast.token_batch import TokenBatch, widen

Batch = Mapping[str, Tensor]
Stats = dict[str, Any]


def zero(like: Tensor) -> Tensor:
    return torch.zeros((), dtype=like.dtype, device=like.device)


def mean_std(x: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and population std of a vector (both 0 when it is empty)."""
    if x.numel() == 0:
        return zero(x), zero(x)
    return x.mean(), x.std(correction=0) if x.numel() > 1 else zero(x)


def frac(cond: Tensor) -> Tensor:
    return cond.float().mean() if cond.numel() else torch.zeros((), device=cond.device)


def detach_stats(stats: Stats) -> Stats:
    return {k: v.detach() if isinstance(v, Tensor) else v for k, v in stats.items()}


def _rows_of(x: float | Tensor, tb: TokenBatch) -> float | Tensor:
    """A per-position tensor (shape of input_ids) read at the head rows; scalars pass through."""
    if isinstance(x, Tensor) and x.ndim > 0:
        if tuple(x.shape) != tuple(tb.batch["input_ids"].shape):
            raise ValueError(f"temperature tensor must have the shape of input_ids, got {tuple(x.shape)}")
        return x.reshape(-1)[tb.rows]
    return x


def seq_logps(lp: Tensor, tb: TokenBatch, length_normalize: bool) -> Tensor:
    """L_b = sum_t M_t lp_t, divided by n_b when length_normalize."""
    total = tb.seq_sum(tb.mask * lp)
    return total / tb.seqs["counts"] if length_normalize else total


def old_seq_logps(tb: TokenBatch, key: str, length_normalize: bool, owner: str) -> Tensor:
    old = tb.per_seq(key, owner)
    return old / tb.seqs["counts"] if length_normalize else old


def common_stats(lp: Tensor, H: Tensor | None, tb: TokenBatch) -> Stats:
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
            return loss * guard, detach_stats(stats)
        h, temp = _hidden_rows(hidden, weight, tb), _rows_of(temperature, tb)
        if not fused:  # linear_logprobs validates its inputs
            out = linear_logprobs(
                h, weight, tb.targets, bias=bias, logit_scale=logit_scale, softcap=softcap, temperature=temp,
                entropy=self.needs_entropy, backend=backend, chunk_elements=chunk_elements,
                memory_budget=memory_budget,
            )
            loss, stats = self.objective(out.logprobs, out.entropy, tb, True)
            return loss * guard, detach_stats(stats)
        validate_head_inputs(h, weight, tb.targets, bias, logit_scale, softcap, temp, -100)
        transform = HeadTransform.build(logit_scale, softcap, temp, tb.n, h.device)

        whole: list[Stats] = []  # the stats of the head's one call on all tokens (at the final lp, H)

        def objective(lp: Tensor, H: Tensor | None, rows: slice | None) -> Tensor:
            if rows is not None:
                return self.objective(lp, H, tb.subset(rows), False)[0]
            value, stats = self.objective(lp, H, tb, True)
            whole.append(stats)
            return value

        impl = resolve_backend(backend, h.device)
        plan = FusedPlan(transform, objective, self.coupled, self.needs_entropy, chunk_elements, impl,
                         groups=self.coupling_groups(tb) if self.coupled else None,
                         memory_budget=parse_memory_budget(memory_budget))
        loss, lp, H = fused_head_loss(h, weight, bias, tb.targets, plan)
        (stats,) = whole  # fused_head_loss evaluates the objective on all tokens exactly once
        stats["loss"] = loss = loss * guard
        return loss, detach_stats(stats)


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
    logp = torch.log_softmax(widen(z), dim=-1)
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



def check_at_least(name: str, value: float, low: float, strict: bool = False) -> None:
    """ValueError naming `name` unless value >= low (> low when strict); NaN never passes."""
    ok = value > low if strict else value >= low
    if not ok:  # also NaN
        raise ValueError(f"{name} must be {'>' if strict else '>='} {low}, got {value}")


def check_eps(low: float, high: float, ratio_clip: float | None) -> None:
    """Clip widths ε >= 0 keep the bounds 1 - ε_lo <= 1 <= 1 + ε_hi in order."""
    check_at_least("clip_eps_low", low, 0.0)
    check_at_least("clip_eps_high", high, 0.0)
    if ratio_clip is not None:
        check_at_least("ratio_clip", ratio_clip, 0.0, strict=True)
