"""The distillation objective: `linear_divergence(student, teacher)` on the completion tokens of
prompt/completion examples (`collate_completions`), the teacher's hidden states under no_grad; the two heads
may differ in hidden size. Off-policy on the dataset, or GKD-style on-policy (Agarwal et al., arXiv
2306.13649): with probability `on_policy_fraction` λ an example's completion is replaced by a sample of the
student (the student samples, the teacher scores). The coin and the sample's seed of an example come from
(seed, step, its place in the global batch), so a data-parallel rank samples what a one-rank run would; a DDP
wrapper is looked through for `generate`."""

from __future__ import annotations

import random
from typing import Any

import torch
from torch import Tensor, nn

from ludic_fast.data.pair_batching import collate_completions
from ludic_fast.distributed.launch import unwrap
from ludic_fast.engine.config import head_options
from ludic_fast.engine.objective import EngineView
from ludic_fast.integrations.transformers import LMHead
from ludic_fast.objectives.dataset import DatasetObjective
from ludic_fast.ops.divergence import linear_divergence
from ludic_fast.token_batch import TokenBatch


class DistillObjective(DatasetObjective):
    """Examples are (prompt ids, completion ids); `kind` forward_kl | reverse_kl | jsd (mixture `beta`),
    `temperature`, `hard_weight` (the hard-label CE's weight); on-policy samples of up to `max_new_tokens`."""

    name = "distill"

    def __init__(self, teacher: nn.Module, kind: str = "forward_kl", beta: float = 0.5, temperature: float = 1.0,
                 hard_weight: float = 0.0, on_policy_fraction: float = 0.0, max_new_tokens: int = 4,
                 eos_token_id: int | None = None, seed: int = 0):
        if not 0.0 <= on_policy_fraction <= 1.0:
            raise ValueError(f"on_policy_fraction must lie in [0, 1], got {on_policy_fraction}")
        self.teacher = teacher.eval().requires_grad_(False)
        self.kind, self.beta, self.temperature, self.hard_weight = kind, beta, temperature, hard_weight
        self.on_policy_fraction, self.max_new_tokens = on_policy_fraction, max_new_tokens
        self.eos_token_id, self.seed = eos_token_id, seed
        self.samples_policy = on_policy_fraction > 0  # the engine keeps FSDP2 parameters whole for next_batch

    def frozen_models(self) -> list[nn.Module]:
        return [self.teacher]

    @torch.no_grad()
    def prepare(self, engine: EngineView, examples: list[Any], places: list[int]) -> list[Any]:
        """Replace completions by the student's samples (eval mode) with probability on_policy_fraction."""
        model = unwrap(engine.model)
        out, was_training = [], model.training
        model.eval()
        devices = [engine.device] if engine.device.type == "cuda" else []
        for (prompt, completion), place in zip(examples, places):
            draw = random.Random(f"{self.seed}:{engine.step_idx}:{place}")
            if self.on_policy_fraction > 0 and draw.random() < self.on_policy_fraction:
                ids = torch.tensor([prompt], device=engine.device)
                with torch.random.fork_rng(devices=devices):
                    torch.manual_seed(draw.getrandbits(63))
                    gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                         max_new_tokens=self.max_new_tokens, eos_token_id=self.eos_token_id,
                                         pad_token_id=self.eos_token_id)
                completion = gen[0, len(prompt):].tolist() or completion
            out.append((prompt, completion))
        model.train(was_training)
        return out

    def size(self, batch: dict[str, Tensor], n_examples: int) -> int:
        """The divergence is a mean over completion tokens: a micro-batch weighs its token count."""
        return TokenBatch.from_batch(batch).n

    def lengths(self, example: tuple[list[int], list[int]]) -> list[int]:
        return [len(example[0]) + len(example[1])]

    def collate(self, examples: list[Any], engine: EngineView) -> dict[str, Tensor]:
        prompts, completions = zip(*examples)
        return collate_completions(prompts, completions, layout=engine.cfg.layout, pad_token_id=engine.cfg.pad_token_id,
                                   max_length=engine.cfg.max_seq_len, device=engine.device)

    def loss(self, engine: EngineView, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Any]]:
        options = head_options(engine.cfg)
        if options.pop("chunk_elements") is not None:
            raise ValueError("chunk_elements: the distillation divergence is chunked by memory_budget alone; "
                             "leave chunk_elements unset")
        tb = TokenBatch.from_batch(batch)  # the completion tokens' rows and targets (never across a boundary)

        def rows(head: LMHead, hidden: Tensor) -> tuple[LMHead, Tensor]:
            return head, hidden.reshape(-1, hidden.shape[-1]).index_select(0, tb.rows)

        t_head, ht = engine.frozen_head(self.teacher, batch, rows)

        def loss(head: LMHead, hidden: Tensor) -> tuple[Tensor, dict[str, Any]]:
            s_head, hs = rows(head, hidden)
            if (s_head.logit_scale, s_head.softcap) != (t_head.logit_scale, t_head.softcap):
                raise ValueError("distillation needs one logit scale and final softcap for both heads (the op applies "
                                 f"one): student ({s_head.logit_scale}, {s_head.softcap}), teacher "
                                 f"({t_head.logit_scale}, {t_head.softcap})")
            value = linear_divergence(hs, s_head.weight, ht, t_head.weight, tb.targets, kind=self.kind, beta=self.beta,
                                      temperature=self.temperature, hard_weight=self.hard_weight,
                                      b_student=s_head.bias, b_teacher=t_head.bias,
                                      logit_scale=s_head.logit_scale, softcap=s_head.softcap, **options)
            return value, {"loss": value.detach(), "tokens": float(tb.n)}

        return engine.head_loss(batch, loss)


__all__ = ["DistillObjective"]
