"""Offline batches: SAW items from JSONL rollouts or chat-format SFT data, seeded shuffling, rank sharding.

`DatasetBatchSource(items, batch_size=32, shuffle=True, seed=42, drop_last=False, rank=None, world_size=None)`
serves `items` in epochs: epoch e is a permutation drawn with `random.Random(f"{seed}:{e}")` (or the
identity without shuffling); with `world_size > 1` (default: torch.distributed's when initialised) the
permutation is padded by wrapping to a multiple of world_size and rank r takes positions r, r + W, ...
(`DistributedSampler`'s rule), so ranks see disjoint items of equal count. Batches cycle across epochs.

Builders:
- `from_rollouts_jsonl(paths, credit_assigner)`: one `Rollout.to_dict()` JSON object per line; credit
  computed once over all rollouts (a step missing from the credit map gets weight 1.0, as Ludic).
- `from_chat_jsonl(paths, tokenizer)` / `from_chat(records, tokenizer)`: `{"messages": [...]}` records;
  the prompt is the chat template of all messages but the last with the generation prompt, the full
  sequence the template of all messages; the prompt must be a prefix and the action (the last assistant
  message) non-empty; action mask 1 on the action, weight 1.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ludic_fast._deprecation import renamed_attributes
from ludic_fast.data.batching import saw_item_from_step
from ludic_fast.data.filters import apply_filter
from ludic_fast.data.jsonl import jsonl_objects
from ludic_fast.data.types import CreditAssigner, Rollout, SampleFilter, SAWBatch, SAWItem


def _jsonl_objects(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[dict[str, Any]]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    return [obj for p in paths for _, obj in jsonl_objects(p)]


def _template_ids(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    if isinstance(out, Mapping):
        out = out["input_ids"]
    return [int(t) for t in out]


def chat_item(tokenizer: Any, messages: list[dict[str, Any]], meta: dict[str, Any] | None = None) -> SAWItem:
    """SAW item of a chat: prompt = template(messages[:-1], generation prompt), action = the rest."""
    if len(messages) < 2 or messages[-1].get("role") != "assistant":
        raise ValueError("messages must end with an assistant message after at least one other message")
    prompt = _template_ids(tokenizer, messages[:-1], True)
    full = _template_ids(tokenizer, messages, False)
    if full[: len(prompt)] != prompt:
        raise ValueError("the chat template of the prompt is not a prefix of the full conversation's")
    if len(full) == len(prompt):
        raise ValueError("the assistant message tokenises to an empty action")
    return SAWItem(
        input_ids=full,
        attention_mask=[1] * len(full),
        action_mask=[0] * len(prompt) + [1] * (len(full) - len(prompt)),
        weight=1.0,
        meta={"prompt_length": len(prompt), "completion_length": len(full) - len(prompt), **(meta or {})},
    )


class DatasetBatchSource:
    """Serves fixed SAW items in seeded, rank-sharded epochs (module docstring); `await next_batch()`."""

    def __init__(
        self,
        items: Sequence[SAWItem],
        *,
        batch_size: int = 32,
        shuffle: bool = True,
        seed: int = 42,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        sample_filter: SampleFilter | None = None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if rank is None or world_size is None:
            rank, world_size = _dist_rank_world(rank, world_size)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must lie in [0, world_size={world_size}), got {rank}")
        self.items = apply_filter(items, sample_filter)
        if not self.items:
            raise ValueError("DatasetBatchSource needs at least one item")
        self.batch_size, self.shuffle, self.seed, self.drop_last = batch_size, shuffle, seed, drop_last
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self.cursor = 0

    def epoch_indices(self, epoch: int) -> list[int]:
        """This rank's item indices for `epoch`, in serving order."""
        order = list(range(len(self.items)))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        total = -(-len(order) // self.world_size) * self.world_size
        order += order[: total - len(order)] if total > len(order) else []
        return order[self.rank :: self.world_size]

    async def next_batch(self) -> SAWBatch:
        indices = self.epoch_indices(self.epoch)
        if self.cursor >= len(indices) or (self.drop_last and self.cursor + self.batch_size > len(indices)):
            self.epoch += 1
            self.cursor = 0
            indices = self.epoch_indices(self.epoch)
        take = indices[self.cursor : self.cursor + self.batch_size]
        self.cursor += len(take)
        items = [self.items[i] for i in take]
        n = len(items)
        meta = {
            "num_samples": n,
            "epoch": self.epoch,
            "source": "offline",
            "avg_completion_length": sum(i.meta.get("completion_length", sum(i.action_mask)) for i in items) / n,
            "avg_prompt_length": sum(i.meta.get("prompt_length", 0) for i in items) / n,
        }
        return SAWBatch(items=items, meta=meta)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])

    # ------------------------------------------------------------------------------------- builders
    @classmethod
    def from_rollouts_jsonl(
        cls,
        paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        credit_assigner: CreditAssigner,
        **kwargs: Any,
    ) -> DatasetBatchSource:
        rollouts = [Rollout.from_dict(r) for r in _jsonl_objects(paths)]
        credit = credit_assigner.compute(rollouts)
        items = [saw_item_from_step(r, s, credit.get((r.id, s.index), 1.0)) for r in rollouts for s in r.steps]
        return cls(items, **kwargs)

    @classmethod
    def from_chat(cls, records: Iterable[Mapping[str, Any]], tokenizer: Any, **kwargs: Any) -> DatasetBatchSource:
        items = [
            chat_item(tokenizer, list(r["messages"]), {k: v for k, v in r.items() if k != "messages"}) for r in records
        ]
        return cls(items, **kwargs)

    @classmethod
    def from_chat_jsonl(
        cls, paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], tokenizer: Any, **kwargs: Any
    ) -> DatasetBatchSource:
        return cls.from_chat(_jsonl_objects(paths), tokenizer, **kwargs)


def _dist_rank_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    default_rank, default_world = (dist.get_rank(), dist.get_world_size()) if initialised else (0, 1)
    return (default_rank if rank is None else rank), (default_world if world_size is None else world_size)


__getattr__ = renamed_attributes(__name__, globals(), {"OfflineBatchSource": "DatasetBatchSource"})

__all__ = ["DatasetBatchSource", "chat_item"]
