"""Rollout engine on transformers `generate` (CPU or GPU): completion ids, finish reason, behaviour logprobs.

Temperature semantics (the losses' head): for sampling temperature T > 0 the behaviour log-prob of a
sampled token y is `log_softmax(z / T)[y]` over the full vocabulary, z the model's raw logits, which is
what `loss(batch, hidden=h, weight=W, temperature=T)` computes for the same token. (top-k / top-p
truncate the sampling distribution but not these logprobs; keep them off for exact on-policy ratios.)
T = 0 means greedy decoding, with logprobs of `log_softmax(z)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

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


class HFGenerateEngine:
    """Samples completions with `model.generate` (left-padded prompt batches of up to `max_batch_size`).

    `publish(params, version)` is the trainer's weight push: a no-op copy when the engine shares the
    trainer's model (in-process), otherwise `load_state_dict(params, strict=False)`; `version` is stored
    and stamped on rollouts as `policy_version`.
    """

    def __init__(
        self, model: nn.Module, *, pad_token_id: int, eos_token_id: int | list[int], max_batch_size: int = 256
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.pad_token_id = int(pad_token_id)
        self.eos_ids = {int(e) for e in (eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id])}
        self.max_batch_size = max_batch_size
        self.version = 0

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def publish(self, params: dict[str, Tensor], version: int) -> None:
        own = dict(self.model.named_parameters())
        if any(k not in own or own[k].data_ptr() != v.data_ptr() for k, v in params.items()):
            with torch.no_grad():
                self.model.load_state_dict(params, strict=False)
        self.version = int(version)

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, *, seed: int | None = None
    ) -> list[Completion]:
        """Completions of each prompt (token ids), sampled under `torch.manual_seed(seed)` when given."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token id lists")
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                if seed is not None:
                    torch.manual_seed(seed)
                out: list[Completion] = []
                for start in range(0, len(prompts), self.max_batch_size):
                    out.extend(self._generate_batch(prompts[start : start + self.max_batch_size], sampling))
                return out
        finally:
            self.model.train(was_training)

    def _generate_batch(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[Completion]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        kwargs: dict[str, Any] = {"do_sample": sampling.temperature > 0, "max_new_tokens": sampling.max_new_tokens}
        if sampling.temperature > 0:
            kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
        gen = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            pad_token_id=self.pad_token_id,
            eos_token_id=sorted(self.eos_ids),
            output_logits=True,
            return_dict_in_generate=True,
            use_cache=True,
            **kwargs,
        )
        new = gen.sequences[:, width:]
        logits = torch.stack(gen.logits, dim=1).float() / sampling.logprob_temperature
        logps = torch.log_softmax(logits, dim=-1).gather(-1, new[..., None]).squeeze(-1)
        out = []
        for i, prompt in enumerate(prompts):
            c_ids, c_lp, reason = cut_at_eos(new[i].tolist(), logps[i].tolist(), self.eos_ids)
            out.append(Completion(list(prompt), c_ids, c_lp, reason))
        return out


__all__ = ["SamplingConfig", "Completion", "HFGenerateEngine", "cut_at_eos"]
