"""Preference objectives on the engine: the DPO family, IPO, SimPO, ORPO, CPO (pairs) and KTO (labelled
completions), any `ludic_fast.losses` preference loss (`make_preference_loss`).

A micro-batch is `collate_pairs` (sequence 2i chosen, 2i+1 rejected) or `collate_kto` (with in-batch KL
samples); its loss is `loss_fn(batch, hidden=h, **head)` on the fused head. The reference model (a frozen
copy of the initial policy, for the losses with `uses_reference`) scores each pair once: its sums over the
response tokens are cached by example and reach the loss as `batch['ref_seq_logps']`. KTO's KL samples
depend on the batch's pairing and LD-DPO needs per-token values, so those read `batch['ref_logps']`
computed for each batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ludic_fast.data.pair_batching import KTOExample, PreferencePair, collate_kto, collate_pairs
from ludic_fast.engine.config import head_options
from ludic_fast.engine.objective import EngineView
from ludic_fast.integrations.transformers import LMHead
from ludic_fast.losses import KTOLoss
from ludic_fast.objectives.dataset import DatasetObjective
from ludic_fast.objectives.logps import action_logps, reference_logps


class PreferenceObjective(DatasetObjective):
    """`loss_fn` (a `ludic_fast.losses` preference loss) on pairs, or on KTO examples for `KTOLoss`; `ref_model`:
    a frozen copy of the initial policy, required by the losses with `uses_reference`."""

    def __init__(self, loss_fn: Any, ref_model: nn.Module | None = None):
        if getattr(loss_fn, "uses_reference", False) and ref_model is None:
            raise ValueError(f"{type(loss_fn).__name__} needs ref_model (a frozen copy of the initial policy)")
        self.loss_fn = loss_fn
        self.name = type(loss_fn).__name__
        self.ref_model = None if ref_model is None else ref_model.eval().requires_grad_(False)
        self.kto = isinstance(loss_fn, KTOLoss)
        self.token_reference = self.kto or bool(getattr(loss_fn, "needs_token_reference", False))
        self._ref_cache: dict[int, Tensor] = {}

    def frozen_models(self) -> list[nn.Module]:
        return [] if self.ref_model is None else [self.ref_model]

    def lengths(self, example: PreferencePair | KTOExample) -> list[int]:
        if isinstance(example, KTOExample):
            return [len(example.prompt) + len(example.completion)] * 2  # with its KL sample
        return [len(example.prompt) + len(example.chosen), len(example.prompt) + len(example.rejected)]

    def collate(self, examples: list[Any], engine: EngineView) -> dict[str, Tensor]:
        cfg = engine.cfg
        kw = dict(pad_token_id=cfg.pad_token_id, max_length=cfg.max_seq_len, device=engine.device)
        if self.kto:
            batch = collate_kto(examples, layout=cfg.layout, **kw)
        else:
            batch = collate_pairs(examples, layout=cfg.layout, **kw)
        if self.ref_model is None:
            return batch
        if self.token_reference:
            batch["ref_logps"] = self._reference(engine, batch)
            return batch
        missing = [e for e in examples if id(e) not in self._ref_cache]
        if missing:
            fresh = collate_pairs(missing, **kw)
            sums = (self._reference(engine, fresh) * fresh["action_mask"]).sum(1)
            self._ref_cache.update({id(e): sums[2 * i:2 * i + 2] for i, e in enumerate(missing)})
        batch["ref_seq_logps"] = torch.cat([self._ref_cache[id(e)] for e in examples])
        return batch

    def _reference(self, engine: EngineView, batch: Mapping[str, Tensor]) -> Tensor:
        options = head_options(engine.cfg)
        return engine.frozen_head(self.ref_model, batch, lambda head, h: action_logps(head, h, batch, **options))

    def loss(self, engine: EngineView, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Any]]:
        def loss(head: LMHead, hidden: Tensor) -> tuple[Tensor, dict[str, Any]]:
            return self.loss_fn(batch, hidden=hidden, **head.kwargs(), **head_options(engine.cfg))

        return engine.head_loss(batch, loss)


__all__ = ["PreferenceObjective", "action_logps", "reference_logps"]
