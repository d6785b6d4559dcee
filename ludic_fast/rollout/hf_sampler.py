"""The `hf` sampler: transformers `generate` (CPU or GPU) on the trainer's model: completion ids, finish reason,
behaviour logprobs with the temperature semantics of `ludic_fast.rollout.sampler` (top-k / top-p truncate the
sampling distribution but not these logprobs; keep them off for exact on-policy ratios).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ludic_fast._deprecation import renamed_attributes
from ludic_fast.rollout.sampling import Completion, SamplingConfig, cut_at_eos


class HFSampler:
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


__getattr__ = renamed_attributes(__name__, globals(), {"HFGenerateEngine": "HFSampler"})

__all__ = ["HFSampler"]
