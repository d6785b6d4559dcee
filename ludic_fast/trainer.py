"""The bundled trainer: Ludic's `Trainer` shape (https://github.com/joanvelja/ludic) on the fused head.

`Trainer` is the one training engine (`ludic_fast.engine.trainer`); `Trainer(model=..., algo=...,
batch_source=..., cfg=...)` runs the RL / SFT objective (`ludic_fast.objectives.rl`), `objective=...` any
other (`ludic_fast.objectives`: preference, KTO, reward model, distillation). One `train_step()`:
1. fetch a SAWBatch from the batch source (async), drop items older than `max_lag` policy versions,
   run `algo.preprocess`; refetch while nothing is left;
2. split the N items by token budget (Ludic's truncate -> sort -> pack) and collate each chunk;
3. per chunk k with n_k items: hidden states from the base model (no logits), the LM head from
   `integrations.transformers.lm_head` (run as the head module's forward, `call_head`, so ZeRO-3 gathers it),
   `loss_k = algo.compute_loss(batch, hidden=h, **head)`, then
   `(loss_k * n_k / N).backward()` — the accumulated gradient is that of the mean over all N sequences
   (token_mean / prompt_mean divide by the step's counts, summed over data-parallel ranks: `MacroTotals`);
4. grad-norm clipping (the norm before clipping is logged); if the loss or the gradient norm is not finite
   the step is skipped: gradients dropped, weights, optimizer and LR schedule untouched (bit-identical),
   `skipped_steps` counted and logged; a loss non-finite `max_nonfinite_steps` steps in a row stops the run
   (`engine.guard.NonFiniteError`);
5. AdamW step, LR schedule (linear warm-up, then constant | linear | cosine decay; `train/lr` is the rate the
   step used), weight push to the publisher every `sync_every_steps`, checkpoint, stats
   (`stats.aggregate_stats`, Ludic's grouping).

Reference model (KL terms) and ProRL-style reference resets: `ludic_fast.objectives.rl`.
"""

from __future__ import annotations

from ludic_fast.engine.config import MIXED_PRECISION, TrainerConfig, resolve_pad_token_id
from ludic_fast.engine.schedule import lr_lambda
from ludic_fast.engine.trainer import Trainer

__all__ = ["MIXED_PRECISION", "Trainer", "TrainerConfig", "lr_lambda", "resolve_pad_token_id"]
