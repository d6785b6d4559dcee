"""Shared fixtures of the trainer/rollout/checkpoint tests: a tiny Llama, the character tokenizer, SAW items."""

from __future__ import annotations

import random

import torch

from ludic_fast.data.types import ActorTokenLogps, SampleAttachments, SAWBatch, SAWItem
from ludic_fast.embedded import build_char_tokenizer, build_tiny_model

TOKENIZER = build_char_tokenizer()
SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
         "num_key_value_heads": 2}


def tiny_model(seed: int = 0) -> torch.nn.Module:
    """A 1-layer, 32-wide Llama over the character vocabulary (deterministic init)."""
    return build_tiny_model(len(TOKENIZER), seed=seed, **SMALL)


def make_items(n: int, *, seed: int = 0, with_logps: bool = True, groups: int | None = None) -> list[SAWItem]:
    """n items of random lengths 4..9 (prompt 2..4 tokens), random weights, behaviour logps near -3."""
    rng = random.Random(seed)
    items = []
    vocab = len(TOKENIZER)
    for i in range(n):
        p, c = rng.randint(2, 4), rng.randint(2, 5)
        ids = [rng.randrange(4, vocab) for _ in range(p + c)]
        logps = ActorTokenLogps([-3.0 + rng.uniform(-0.5, 0.5) for _ in range(c)]) if with_logps else None
        meta = {"rollout_id": f"r{i}"}
        if groups:
            meta["request_meta"] = {"group_id": f"g{i % groups}"}
        items.append(SAWItem(input_ids=ids, attention_mask=[1] * (p + c), action_mask=[0] * p + [1] * c,
                             weight=rng.uniform(-1.0, 1.0), meta=meta, attachments=SampleAttachments(logps)))
    return items


class ListSource:
    """A batch source serving fixed batches in a cycle (`async next_batch`)."""

    def __init__(self, batches: list[list[SAWItem]], meta: dict | None = None):
        self.batches, self.meta, self.i = batches, dict(meta or {}), 0

    async def next_batch(self) -> SAWBatch:
        items = self.batches[self.i % len(self.batches)]
        self.i += 1
        return SAWBatch(items=list(items), meta=dict(self.meta))
