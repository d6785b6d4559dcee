"""`OfflineTrainer`: a thin alias over the one engine (`ludic_fast.engine.trainer.Trainer`) for the offline
objectives, with the settings of the former offline loop (`OfflineConfig`).

    OfflineTrainer(model, PreferenceObjective(DPOLoss(), ref), examples, OfflineConfig(steps=40)).train()
is
    Trainer(model=model, objective=objective.use_examples(examples, batch_size=16, seed=0),
            cfg=TrainerConfig(lr=1e-3, weight_decay=0.0, max_seq_len=64, micro_token_budget=..., ...)
            ).train_sync(40)
so every engine feature applies: build the `TrainerConfig` yourself for LoRA, LR schedules, fp16,
gradient checkpointing, body kernels, compile or DDP / FSDP2. The objectives live in `ludic_fast.objectives`
(`PreferenceObjective`, `RewardObjective`, `DistillObjective`) and are re-exported here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from ludic_fast.engine.config import TrainerConfig
from ludic_fast.engine.stop import StopOnSignal
from ludic_fast.engine.trainer import Trainer
from ludic_fast.objectives.distill import DistillObjective
from ludic_fast.objectives.offline import OfflineObjective
from ludic_fast.objectives.preference import PreferenceObjective, reference_logps
from ludic_fast.objectives.reward import RewardObjective
from ludic_fast.run.checkpoint import CheckpointConfig

#: max_length=None (no truncation) maps to this engine max_seq_len
_UNBOUNDED_LENGTH = 1 << 20


@dataclass
class OfflineConfig:
    """Settings of `OfflineTrainer`: `batch_size` examples per step; micro-batches of at most
    `micro_batch_size` examples' worth of tokens (`micro_batch_size` x 2 x `max_length` tokens: a pair's two
    sequences; the engine splits by tokens); `mixed_precision` None | "bf16" | "fp16"."""

    steps: int = 40
    batch_size: int = 16
    micro_batch_size: int = 16
    lr: float = 1e-3
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    max_length: int | None = 64
    pad_token_id: int = 0
    seed: int = 0
    device: str = "cpu"
    chunk_elements: int | None = None
    memory_budget: int | None = None
    layout: str = "padded"
    mixed_precision: str | None = None

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        self.trainer_config()  # the engine's own checks (layout, precision, lengths)

    def trainer_config(self) -> TrainerConfig:
        length = self.max_length or _UNBOUNDED_LENGTH
        return TrainerConfig(
            model_device=self.device, lr=self.lr, weight_decay=self.weight_decay, max_grad_norm=self.max_grad_norm,
            max_seq_len=length, micro_token_budget=self.micro_batch_size * 2 * length, sync_every_steps=0,
            pad_token_id=self.pad_token_id, chunk_elements=self.chunk_elements, memory_budget=self.memory_budget,
            layout=self.layout, mixed_precision_dtype=self.mixed_precision, total_steps=self.steps,
        )


class OfflineTrainer(Trainer):
    """`Trainer` on `objective` drawing `cfg.batch_size` of `examples` per step (module docstring); `train()`
    runs the steps left up to `cfg.steps` and returns their records. resume_from: a step (int or digit
    string), a checkpoint path, or "latest"."""

    def __init__(self, model: nn.Module, objective: OfflineObjective, examples: Sequence[Any], cfg: OfflineConfig,
                 logger: Any = None, checkpoint_config: CheckpointConfig | None = None,
                 resume_from: int | str | None = None):
        self.offline_cfg = cfg
        objective.use_examples(examples, batch_size=cfg.batch_size, seed=cfg.seed)
        super().__init__(model=model, objective=objective, cfg=cfg.trainer_config(), train_logger=logger,
                         checkpoint_config=checkpoint_config, resume_from=resume_from)

    def step(self) -> dict[str, Any]:
        """One optimizer step; its record."""
        return self.train_step_sync()

    def train(self, stop: StopOnSignal | None = None) -> list[dict[str, Any]]:  # type: ignore[override]
        """The steps left up to `cfg.steps`, synchronously (the former loop's call; the engine's is async); a
        stop requested through `stop` ends them after the current one."""
        return asyncio.run(Trainer.train(self, max(0, self.offline_cfg.steps - self.step_idx), stop=stop))


__all__ = ["OfflineConfig", "OfflineTrainer", "PreferenceObjective", "RewardObjective", "DistillObjective",
           "reference_logps"]
