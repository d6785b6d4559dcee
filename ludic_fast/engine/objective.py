"""What the engine optimises: an `Objective` says how to fetch a step's examples, split and collate them into
micro-batches, and compute a micro-batch's loss on the fused head; the engine owns everything else (the
model, precision, optimizer, schedule, the step, checkpoints, logging). Objectives live in
`ludic_fast.objectives` (rl and sft, preference, kto, reward, distill).

The engine calls, per optimizer step:
    batch  = await objective.next_batch(engine)             # the step's examples (any type)
    micros = objective.micro_batches(engine, batch)         # [MicroBatch(collated dict, size n_k, aux)]
    for m in micros: loss_k, stats_k = objective.loss(engine, m.batch);  (loss_k · n_k / N).backward()
    stats  = objective.step_stats(engine, batch, [stats_k], [n_k])      # the step's record (before grouping)
    objective.after_step(engine, stats, [m.aux], finite)    # e.g. the RL reference reset
so the gradient is that of the mean over the step's N examples (or tokens). `engine` is what an objective may
read of the engine: `EngineView`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor, nn

from ludic_fast.engine.config import EngineConfig
from ludic_fast.integrations.transformers import LMHead

#: what a head function returns (a loss and its stats, log-probs, ...)
T = TypeVar("T")


@dataclass
class MicroBatch:
    """One collated micro-batch: the tensors the loss reads, its size n_k in the unit the loss averages over
    (examples; tokens for a token-mean loss), an objective's own per-micro-batch value handed back to
    `after_step` (the RL reference KL estimate; None otherwise), and its number of examples (an RL item, a
    preference pair, a KTO example, a completion; None: `size`), which `perf/examples_per_s` counts."""

    batch: dict[str, Tensor]
    size: int
    aux: Any = None
    examples: int | None = None


class EngineView(Protocol):
    """What an objective may read of the engine (`ludic_fast.engine.trainer.Engine` is one), and nothing else:

    cfg            the engine's settings (`EngineConfig`): layout, pad_token_id, max_seq_len, micro_token_budget,
                   and the fused head's options (`engine.config.head_options(cfg)`: backend, chunk_elements,
                   memory_budget)
    device         where batches go (the model's device)
    model          the policy being trained (possibly DDP / FSDP / PEFT wrapped): for sampling from it
                   (on-policy distillation) and for copying it (the RL reference reset)
    step_idx       optimizer steps taken so far
    optimizer      the AdamW optimizer (read its learning rate, e.g. for an error message)
    data_parallel  whether ranks average gradients (DDP / FSDP): step totals are summed over ranks
    head_loss      fn(head, hidden) on the policy's final hidden states, with gradients (the loss)
    frozen_head    fn(head, hidden) of a frozen model (`Objective.frozen_models`), without gradients
    """

    cfg: EngineConfig
    device: torch.device
    model: nn.Module
    step_idx: int
    optimizer: torch.optim.Optimizer
    data_parallel: bool

    def head_loss(self, batch: Mapping[str, Tensor], fn: Callable[[LMHead, Tensor], T], *,
                  fp32_head: bool = False) -> T:
        """fn(head, hidden) on the policy's final hidden states of `batch`, inside the model's forward (so
        DDP / FSDP / PEFT wrappers do their work), the head's inputs in the compute precision (float32 with
        `fp32_head`)."""
        ...

    def frozen_head(self, model: nn.Module, batch: Mapping[str, Tensor], fn: Callable[[LMHead, Tensor], T], *,
                    fp32_head: bool = False) -> T:
        """fn(head, hidden) on the final hidden states of frozen `model`, without gradients."""
        ...


class Objective(Protocol):
    name: str

    def frozen_models(self) -> list[nn.Module]:
        """Models the loss reads without training them (a reference, a teacher): the engine moves them to its
        device and applies its body kernels, packed attention and compile to them as to the policy."""
        ...

    def parameters(self) -> list[nn.Parameter]:
        """Trainable parameters besides the model's (a reward model's value head)."""
        ...

    async def next_batch(self, engine: EngineView) -> Any: ...

    def micro_batches(self, engine: EngineView, batch: Any) -> list[MicroBatch]: ...

    def loss(self, engine: EngineView, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Any]]: ...

    def step_stats(self, engine: EngineView, batch: Any, micro_stats: Sequence[dict[str, Any]],
                   sizes: Sequence[int]) -> dict[str, Any]: ...

    def after_step(self, engine: EngineView, stats: dict[str, Any], aux: Sequence[Any], finite: bool) -> None: ...

    def state(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """(JSON-ready state, tensors) a resumed run needs."""
        ...

    def load_state(self, meta: dict[str, Any], tensors: dict[str, Tensor]) -> None: ...


__all__ = ["EngineView", "MicroBatch", "Objective"]
