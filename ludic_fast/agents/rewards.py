"""Reward functions scored on a finished episode, several at once with weights (a rubric, as in `verifiers`).

A reward function is `fn(messages, info) -> float`: the episode's whole conversation (chat messages) and the
last step's info, with how the episode ended added (`info["episode_status"]`: "done" or "truncated";
`info["episode_reason"]`: the truncation's reason, e.g. "turn_length", or None).
`WeightedRewards([(name, fn, weight), ...])` adds Σ_i w_i · fn_i(messages, info) to the episode's last step
reward (after the environment's own rewards) and reports each unweighted component, so every component can be
logged on its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ludic_fast.agents.protocol import Message

EpisodeReward = Callable[[list[Message], dict[str, Any]], float]


@dataclass(frozen=True)
class WeightedRewards:
    """Named reward functions with weights (module docstring)."""

    terms: Sequence[tuple[str, EpisodeReward, float]]

    def __post_init__(self) -> None:
        names = [n for n, _, _ in self.terms]
        if len(set(names)) != len(names):
            raise ValueError(f"reward names must be distinct, got {names}")
        for name, fn, weight in self.terms:
            if not callable(fn):
                raise TypeError(f"reward {name!r} is not callable")
            if not math.isfinite(weight):
                raise ValueError(f"reward {name!r} has a non-finite weight {weight}")

    def score(self, messages: list[Message], info: dict[str, Any]) -> tuple[float, dict[str, float]]:
        """(Σ_i w_i r_i, {name: r_i}); a non-finite r_i is a ValueError naming the function."""
        parts = {}
        for name, fn, _ in self.terms:
            value = float(fn(messages, info))
            if not math.isfinite(value):
                raise ValueError(f"reward {name!r} returned {value}")
            parts[name] = value
        return sum(w * parts[n] for n, _, w in self.terms), parts


def truncated(messages: list[Message], info: dict[str, Any]) -> float:
    """1 for an episode cut short by a limit (turns, tokens, a turn without its stop token, the environment),
    else 0. With a negative weight (`--env-reward ludic_fast.agents.rewards:truncated=-1.5`) it keeps a policy
    from escaping a game's negative rewards by never finishing a turn."""
    del messages
    return 1.0 if info.get("episode_status") == "truncated" else 0.0


__all__ = ["EpisodeReward", "WeightedRewards", "truncated"]
