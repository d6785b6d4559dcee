"""`OfflineTrainer`: a thin alias over the one engine (`ludic_fast.engine.trainer.Engine`) for the offline
objectives; `OfflineConfig` is the engine's settings (`EngineConfig`, with the former offline loop's defaults)
plus the run length and the example stream's.

    OfflineTrainer(model, PreferenceObjective(DPOLoss(), ref), examples, OfflineConfig(steps=40)).train()
is
    Engine(model=model, objective=objective.use_examples(examples, batch_size=16, seed=0),
           cfg=OfflineConfig(steps=40)).train_sync(40)
so every engine feature applies (LoRA, LR schedules, fp16, gradient checkpointing, body kernels, compile,
DDP / FSDP2). The objectives live in `ludic_fast.objectives` (`PreferenceObjective`, `RewardObjective`,
`DistillObjective`) and are re-exported here.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Sequence
from dataclasses import InitVar, dataclass
from typing import Any

from torch import nn

from ludic_fast.engine.config import EngineConfig
from ludic_fast.engine.stop import StopOnSignal
from ludic_fast.engine.trainer import Engine
from ludic_fast.objectives.dataset import DatasetObjective
from ludic_fast.objectives.distill import DistillObjective
from ludic_fast.objectives.logps import reference_logps
from ludic_fast.objectives.preference import PreferenceObjective
from ludic_fast.objectives.reward import RewardObjective
from ludic_fast.run.checkpoint import CheckpointConfig

#: max_length=None (no truncation) maps to this engine max_seq_len
_UNBOUNDED_LENGTH = 1 << 20
#: OfflineConfig's default micro_token_budget: 16 pairs of two 64-token sequences, the former loop's
_DEFAULT_BUDGET = 16 * 2 * 64
#: OfflineConfig's former names -> the engine's
_RENAMED = {"device": "model_device", "max_length": "max_seq_len", "mixed_precision": "mixed_precision_dtype",
            "micro_batch_size": "micro_token_budget (= micro_batch_size x 2 x max_seq_len)"}


@dataclass
class OfflineConfig(EngineConfig):
    """The engine's settings with the former offline loop's defaults (CPU, lr 1e-3, no weight decay, sequences
    of at most 64 tokens, micro-batches of at most 2048 tokens, pad id 0, no weight push; `total_steps`:
    `steps`), plus `steps` (the run's optimizer steps), `batch_size` (examples per step) and `seed` (their
    order).

    The former names still work, with a DeprecationWarning: device (model_device), max_length (max_seq_len; None:
    no truncation), mixed_precision (mixed_precision_dtype), micro_batch_size (micro_token_budget =
    micro_batch_size x 2 x max_seq_len: a pair's two sequences).
    """

    model_device: str = "cpu"
    lr: float = 1e-3
    weight_decay: float = 0.0
    max_seq_len: int = 64
    micro_token_budget: int = _DEFAULT_BUDGET
    sync_every_steps: int = 0
    pad_token_id: Any = 0
    steps: int = 40
    batch_size: int = 16
    seed: int = 0
    device: InitVar[str | None] = None
    max_length: InitVar[int | None] = 0  # 0: not given (None: no truncation)
    mixed_precision: InitVar[str | None] = None
    micro_batch_size: InitVar[int] = 0  # 0: not given

    def __post_init__(self, device: str | None, max_length: int | None, mixed_precision: str | None,
                      micro_batch_size: int) -> None:
        given = {"device": device is not None, "max_length": max_length != 0,
                 "mixed_precision": mixed_precision is not None, "micro_batch_size": micro_batch_size != 0}
        if any(given.values()):
            now = ", ".join(f"{old} -> {_RENAMED[old]}" for old, on in given.items() if on)
            warnings.warn(f"OfflineConfig: the engine's names replace the former ones ({now})", DeprecationWarning,
                          stacklevel=3)
        if device is not None:
            self.model_device = device
        if mixed_precision is not None:
            self.mixed_precision_dtype = mixed_precision
        if max_length != 0 or micro_batch_size != 0:  # the former sizes, together as before (16 pairs a micro-batch)
            if self.micro_token_budget != _DEFAULT_BUDGET:
                raise ValueError("micro_token_budget: give it, or the former max_length / micro_batch_size, not both")
            if micro_batch_size < 0:
                raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
            if max_length != 0:
                self.max_seq_len = _UNBOUNDED_LENGTH if max_length is None else max_length
            self.micro_token_budget = (micro_batch_size or 16) * 2 * self.max_seq_len
        for name in ("steps", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.total_steps is None:
            self.total_steps = self.steps
        super().__post_init__()


for _name in _RENAMED:
    delattr(OfflineConfig, _name)  # construction arguments only: reading one is an AttributeError, not its default


class OfflineTrainer(Engine):
    """The engine on `objective` drawing `cfg.batch_size` of `examples` per step (module docstring); `train()`
    runs the steps left up to `cfg.steps` and returns their records. resume_from: a step (int or digit
    string), a checkpoint path, or "latest"."""

    def __init__(self, model: nn.Module, objective: DatasetObjective, examples: Sequence[Any], cfg: OfflineConfig,
                 logger: Any = None, checkpoint_config: CheckpointConfig | None = None,
                 resume_from: int | str | None = None):
        self.offline_cfg = cfg
        objective.use_examples(examples, batch_size=cfg.batch_size, seed=cfg.seed)
        super().__init__(model=model, objective=objective, cfg=cfg, train_logger=logger,
                         checkpoint_config=checkpoint_config, resume_from=resume_from)

    def step(self) -> dict[str, Any]:
        """One optimizer step; its record."""
        return self.train_step_sync()

    def train(self, stop: StopOnSignal | None = None) -> list[dict[str, Any]]:  # type: ignore[override]
        """The steps left up to `cfg.steps`, synchronously (the former loop's call; the engine's is async); a
        stop requested through `stop` ends them after the current one."""
        return asyncio.run(Engine.train(self, max(0, self.offline_cfg.steps - self.step_idx), stop=stop))


__all__ = ["OfflineConfig", "OfflineTrainer", "PreferenceObjective", "RewardObjective", "DistillObjective",
           "reference_logps"]
