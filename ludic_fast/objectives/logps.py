"""A frozen model's log-probs of a batch's action tokens, the one way every objective computes them (the RL
reference, the preference reference): the final hidden states of the action positions through the fused
head, scattered back to the position of the token they score."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ludic_fast.integrations.transformers import LMHead, final_hidden_states, lm_head
from ludic_fast.token_batch import TokenBatch


def action_logps(head: LMHead, hidden: Tensor, batch: Mapping[str, Tensor], **head_kwargs: Any) -> Tensor:
    """log p of every action token at its position (shape of input_ids, 0 elsewhere), padded or packed, from
    the final hidden states through the fused head; `head_kwargs` go to `head.logprobs` (temperature, backend,
    chunk_elements, memory_budget)."""
    tb = TokenBatch.from_batch(batch)
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, tb.rows)
    out = head.logprobs(rows, tb.targets, entropy=False, **head_kwargs)
    logps = out.logprobs.new_zeros(batch["input_ids"].numel())  # the head's dtype: float64 stays float64
    logps[tb.rows + 1] = out.logprobs
    return logps.reshape(batch["input_ids"].shape)


@torch.no_grad()
def reference_logps(ref_model: nn.Module, batch: Mapping[str, Tensor]) -> Tensor:
    """`action_logps` of a padded batch under `ref_model` in its own precision, outside any engine."""
    hidden = final_hidden_states(ref_model, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    return action_logps(lm_head(ref_model), hidden, batch)


__all__ = ["action_logps", "reference_logps"]
