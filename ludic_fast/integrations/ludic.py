"""Ludic drop-in: Ludic's loss classes, batch dict and `RLAlgorithm.compute_loss` shape, from hidden states.

`ludic_fast.losses` keeps Ludic master's class names, constructor arguments and defaults and reads the
batch dict Ludic's `collate_saw_items` builds (`input_ids`, `attention_mask`, `action_mask`, `weight`,
`actor_logps`, `old_logp_action`). A Ludic user swaps

    from ludic.training.loss import CISPOLoss          ->  from ludic_fast.losses import CISPOLoss
    loss, stats = loss_fn.compute(model(**inputs).logits, batch)
                                                        ->  loss, stats = compute_loss(model, loss_fn, batch)

and gets the same loss, stats and gradients without the `[B, T, V]` logits (fp32 statistics always, as
Ludic's default `cast_logits_to_fp32=True`). One documented difference: `EntropyBonus` takes the entropy at
the position that scores each action token (Ludic master reads it one position late).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ludic_fast.integrations.transformers import call_head, call_in_forward, final_hidden_states


def compute_loss(
    model: nn.Module,
    loss: Any,
    batch: dict[str, Tensor],
    *,
    fp32_head: bool = False,
    **loss_kwargs: Any,
) -> tuple[Tensor, dict[str, Any]]:
    """`loss(batch, hidden=h, weight=W, bias=b, logit_scale=s, softcap=c, **loss_kwargs)` for a causal LM.

    The hidden states come from one base-model forward on `batch["input_ids"]` and
    `batch["attention_mask"]` (as Ludic's `RLAlgorithm.compute_loss` calls the model), run inside the
    wrappers' forward (DDP/FSDP/PEFT); the head is the model's own (`integrations.transformers.lm_head`).
    """

    def body(lm: nn.Module, *, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, dict[str, Any]]:
        hidden = final_hidden_states(lm, input_ids, attention_mask)
        return call_head(
            lm, lambda head, h: loss(batch, hidden=h, **head.kwargs(), **loss_kwargs), hidden, fp32_head=fp32_head
        )

    return call_in_forward(model, body, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])


__all__ = ["compute_loss"]
