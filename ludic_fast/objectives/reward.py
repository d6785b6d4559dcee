"""The reward-model objective: Bradley-Terry on a scalar value head (`nn.Linear(D, 1)`, trained with the
model) over the backbone's final hidden states of `collate_pairs` batches (`ludic_fast.losses.reward`)."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ludic_fast.data.pair_batching import PreferencePair, collate_pairs
from ludic_fast.engine.objective import EngineView
from ludic_fast.integrations.transformers import LMHead
from ludic_fast.losses import BradleyTerryLoss
from ludic_fast.objectives.dataset import DatasetObjective


class RewardObjective(DatasetObjective):
    name = "reward"

    def __init__(self, value_head: nn.Linear, loss_fn: BradleyTerryLoss | None = None):
        self.value_head = value_head
        self.loss_fn = loss_fn or BradleyTerryLoss()

    def parameters(self) -> list[nn.Parameter]:
        return list(self.value_head.parameters())

    def lengths(self, example: PreferencePair) -> list[int]:
        return [len(example.prompt) + len(example.chosen), len(example.prompt) + len(example.rejected)]

    def collate(self, examples: list[Any], engine: EngineView) -> dict[str, Tensor]:
        return collate_pairs(examples, layout=engine.cfg.layout, pad_token_id=engine.cfg.pad_token_id,
                             max_length=engine.cfg.max_seq_len, device=engine.device)

    def loss(self, engine: EngineView, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Any]]:
        def loss(head: LMHead, hidden: Tensor) -> tuple[Tensor, dict[str, Any]]:
            del head  # the value head scores the hidden states, not the LM head
            vh = self.value_head
            return self.loss_fn(batch, hidden=hidden.to(vh.weight.dtype), weight=vh.weight, bias=vh.bias)

        return engine.head_loss(batch, loss)


__all__ = ["RewardObjective"]
