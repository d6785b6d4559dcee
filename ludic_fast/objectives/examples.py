"""The example stream of the offline objectives: `batch_size` examples per step, drawn without replacement
from a shuffled order that is reshuffled (by its own seeded RNG) each time it runs out; its state (order
left, RNG) is part of a checkpoint, so a resumed run draws what the uninterrupted run would have."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from ludic_fast.run.checkpoint import random_state, set_random_state


class ExampleStream:
    def __init__(self, examples: Sequence[Any], *, batch_size: int, seed: int = 0):
        if not examples:
            raise ValueError("examples must not be empty")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.examples, self.batch_size = list(examples), batch_size
        self._rng = random.Random(seed)
        self._order: list[int] = []

    def next(self) -> list[Any]:
        out = []
        while len(out) < self.batch_size:
            if not self._order:
                self._order = list(range(len(self.examples)))
                self._rng.shuffle(self._order)
            out.append(self.examples[self._order.pop()])
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"order": list(self._order), "rng": random_state(self._rng)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._order = [int(i) for i in state["order"]]
        set_random_state(state["rng"], self._rng)


__all__ = ["ExampleStream"]
