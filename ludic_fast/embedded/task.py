"""The built-in verifiable task: add two non-negative integers, written as characters.

    prompt "37+48="   completion "85" + <eos>   reward 1.0 iff the completion is exactly the sum

Problems are drawn with a seeded `random.Random`, so the train and eval splits are reproducible and
disjoint. A tiny model learns the format and the easy cases from a short SFT warm-up; carries stay hard
for a while, which leaves the RL phase room to raise the reward.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class AdditionTask:
    """Seeded addition problems `a+b=` with `0 <= a, b <= max_operand`."""

    max_operand: int = 99
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {self.max_operand}")

    def samples(self, split: str, n: int) -> list[dict[str, str]]:
        """`n` distinct problems `{"id", "prompt", "answer"}`; splits "train" and "eval" never share a problem."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        pairs = [(a, b) for a in range(self.max_operand + 1) for b in range(self.max_operand + 1)]
        random.Random(self.seed).shuffle(pairs)
        n_eval = len(pairs) // 5
        pool = pairs[:n_eval] if split == "eval" else pairs[n_eval:]
        if n > len(pool):
            raise ValueError(f"split {split!r} has only {len(pool)} problems, asked for {n}")
        return [{"id": f"{split}-{a}+{b}", "prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pool[:n]]
