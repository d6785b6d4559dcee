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
so the gradient is that of the mean over the step's N examples (or tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor, nn


@dataclass
class MicroBatch:
    """One collated micro-batch: the tensors the loss reads, its size n_k in the unit the loss averages over
    (examples; tokens for a token-mean loss), and an objective's own per-micro-batch value handed back to
    `after_step` (the RL reference KL estimate; None otherwise)."""

    batch: dict[str, Tensor]
    size: int
    aux: Any = None


class Objective(Protocol):
    name: str

    def frozen_models(self) -> list[nn.Module]:
        """Models the loss reads without training them (a reference, a teacher): the engine moves them to its
        device and applies its body kernels, packed attention and compile to them as to the policy."""
        ...

    def parameters(self) -> list[nn.Parameter]:
        """Trainable parameters besides the model's (a reward model's value head)."""
        ...

    async def next_batch(self, engine: Any) -> Any: ...

    def micro_batches(self, engine: Any, batch: Any) -> list[MicroBatch]: ...

    def loss(self, engine: Any, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Any]]: ...

    def step_stats(self, engine: Any, batch: Any, micro_stats: Sequence[dict[str, Any]],
                   sizes: Sequence[int]) -> dict[str, Any]: ...

    def after_step(self, engine: Any, stats: dict[str, Any], aux: Sequence[Any], finite: bool) -> None: ...

    def state(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """(JSON-ready state, tensors) a resumed run needs."""
        ...

    def load_state(self, meta: dict[str, Any], tensors: dict[str, Tensor]) -> None: ...


__all__ = ["MicroBatch", "Objective"]
