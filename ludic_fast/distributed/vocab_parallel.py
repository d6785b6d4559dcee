"""Losses on a vocab-parallel head: any `ludic_fast.losses` loss over a weight sharded by vocabulary rows.

The head op itself is `ludic_fast.ops.vocab_parallel` (also reached through
`ludic_fast.linear_logprobs(..., process_group=pg, vocab_start=s)`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import Tensor

from ludic_fast.losses import HeadLoss
from ludic_fast.ops.vocab_parallel import vocab_parallel_linear_logprobs, vocab_partition
from ludic_fast.token_batch import TokenBatch

__all__ = ["vocab_parallel_linear_logprobs", "vocab_parallel_loss", "vocab_partition"]


def vocab_parallel_loss(
    loss_fn: HeadLoss,
    batch: Mapping[str, Tensor],
    *,
    hidden: Tensor,
    weight: Tensor,
    process_group: dist.ProcessGroup | None,
    vocab_start: int,
    vocab_size: int,
    bias: Tensor | None = None,
    reduce_grad_hidden: bool = True,
    **head_kwargs: Any,
) -> tuple[Tensor, dict[str, Any]]:
    """Any `ludic_fast.losses` loss on a vocab-sharded head: `(loss, stats)` equal on every rank to
    `loss_fn(batch, hidden=hidden, weight=<full weight>)`.

    The action tokens' logprobs (and entropies when the loss reads them) come from
    `vocab_parallel_linear_logprobs` in generic mode (8NDV: every loss, token-local or sequence-coupled),
    then `loss_fn.objective` runs on them, replicated. `head_kwargs`: logit_scale, softcap, temperature
    (scalar or [B, T]), chunk_elements."""
    tb = TokenBatch.from_batch(batch)
    shape = tuple(batch["input_ids"].shape)
    if not isinstance(hidden, Tensor) or hidden.ndim != 3 or tuple(hidden.shape[:-1]) != shape:
        raise ValueError(f"hidden must have shape [*input_ids.shape, D] = [{shape}, D]")
    temperature = head_kwargs.pop("temperature", 1.0)
    if isinstance(temperature, Tensor) and temperature.ndim > 0:
        if tuple(temperature.shape) != shape:
            raise ValueError(f"temperature tensor must have the shape of input_ids {shape}")
        temperature = temperature.reshape(-1)[tb.rows]
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, tb.rows)
    out = vocab_parallel_linear_logprobs(
        h, weight, tb.targets, process_group=process_group, vocab_start=vocab_start, vocab_size=vocab_size,
        bias=bias, temperature=temperature, entropy=loss_fn.needs_entropy, reduce_grad_hidden=reduce_grad_hidden,
        **head_kwargs,
    )
    loss, stats = loss_fn.objective(out.logprobs, out.entropy, tb, True)
    return loss, {k: v.detach() if isinstance(v, Tensor) else v for k, v in stats.items()}
