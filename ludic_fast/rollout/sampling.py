"""The rollout side's protocol, `Sampler`, and what it exchanges: `SamplingConfig` in, `Completion` out.

A sampler does three things:
- `generate(prompts, sampling, *, seed=None) -> list[Completion]`: completions of token-id prompts under a
  `SamplingConfig`, each with the behaviour log-prob of every sampled token, `log_softmax(z / T)[y]` over the
  full vocabulary, z the model's raw logits (T = the sampling temperature; T = 0 is greedy decoding, with the
  log-probs of `log_softmax(z)`), which is what `loss(batch, hidden=h, weight=W, temperature=T)` computes for
  the same token;
- `publish(params, version)`: take the trainer's new weights (a name -> tensor mapping in the trainer's names);
- `version`: the policy version of the weights it samples with now, stamped on each rollout as `policy_version`.

The samplers themselves, and the registry `ludic-fast train --sampler` chooses from, are in
`ludic_fast.rollout.sampler`, which imports this module (never the other way).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from torch import Tensor

from ludic_fast._common import logprob_temperature


@dataclass(frozen=True)
class SamplingConfig:
    """temperature (0 = greedy), top_p, top_k (0 = off), max_new_tokens per completion."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 32

    def __post_init__(self) -> None:
        logprob_temperature(self.temperature)  # finite and >= 0
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def logprob_temperature(self) -> float:
        """The head temperature of this sampler's log-probs (`ludic_fast._common.logprob_temperature`)."""
        return logprob_temperature(self.temperature)


@dataclass(frozen=True)
class Completion:
    """One sampled completion: its token ids (ending in eos when stopped), their behaviour logprobs, and
    finish_reason "stop" (eos produced) or "length" (max_new_tokens reached)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str


def cut_at_eos(ids: list[int], logprobs: list[float], eos_ids: set[int]) -> tuple[list[int], list[float], str]:
    """Keep tokens up to and including the first eos; finish reason "stop" if one was found, else "length"."""
    for i, t in enumerate(ids):
        if t in eos_ids:
            return ids[: i + 1], logprobs[: i + 1], "stop"
    return ids, logprobs, "length"


@runtime_checkable
class Sampler(Protocol):
    """What a rollout source and the trainer's weight push need of the rollout side (module docstring)."""

    version: int

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, *, seed: int | None = None
                 ) -> list[Completion]: ...

    def publish(self, params: Mapping[str, Tensor], version: int) -> None: ...


__all__ = ["SamplingConfig", "Completion", "cut_at_eos", "Sampler"]
