"""Environments for `ludic-fast train --env` runs that meet the faults of tests/test_empty_batches.py: a prompt
longer than the episode's token budget, and an environment that breaks after its first batch."""

from __future__ import annotations

from dataclasses import dataclass

from ludic_fast.agents.embedded_envs import GuessNumberEnv


@dataclass
class LongPromptEnv(GuessNumberEnv):
    """GuessNumberEnv whose prompt is padded with `pad` dots (its demonstrations start with that prompt too)."""

    pad: int = 0

    def prompt(self) -> str:
        return super().prompt() + "." * self.pad


#: resets played by `breaking_env` environments in this process
RESETS = {"n": 0}


@dataclass
class BreakingEnv(GuessNumberEnv):
    """GuessNumberEnv whose reset raises from the `works_for + 1`-th reset in the process on: every episode of
    the later batches fails, so every later batch is empty."""

    works_for: int = 4

    def reset(self, seed: int):
        RESETS["n"] += 1
        if RESETS["n"] > self.works_for:
            raise RuntimeError("the environment's server went away")
        return super().reset(seed)


def long_prompt(pad: int = 0, max_turns: int = 1) -> LongPromptEnv:
    return LongPromptEnv(max_turns=max_turns, pad=pad)


def breaking_env(works_for: int = 4) -> BreakingEnv:
    return BreakingEnv(max_turns=1, works_for=works_for)
