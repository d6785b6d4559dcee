"""The bundled trainer: Ludic's `Trainer` shape (https://github.com/joanvelja/ludic) on the fused head.

`Trainer` is the one training engine (`ludic_fast.engine.trainer.Engine`) on the RL / SFT objective
(`ludic_fast.objectives.rl.RLObjective`) built from `Trainer(model=..., algo=..., batch_source=..., cfg=...)`;
`objective=...` runs any other (`ludic_fast.objectives`: preference, KTO, reward model, distillation).
`TrainerConfig` is the engine's settings (`EngineConfig`) and the RL objective's (`RLConfig`) in one.
One `train_step()`:
1. fetch a SAWBatch from the batch source (async), drop items older than `max_lag` policy versions,
   run `algo.preprocess`; refetch while nothing is left;
2. split the N items by token budget (Ludic's truncate -> sort -> pack) and collate each chunk;
3. per chunk k with n_k items: hidden states from the base model (no logits), the LM head from
   `integrations.transformers.lm_head` (run as the head module's forward, `call_head`, so ZeRO-3 gathers it),
   `loss_k = algo.compute_loss(batch, hidden=h, **head)` at the temperature the rollouts sampled with, then
   `(loss_k * n_k / N).backward()` — the accumulated gradient is that of the mean over all N sequences
   (token_mean / prompt_mean divide by the step's counts, summed over data-parallel ranks: `MacroTotals`);
4. grad-norm clipping (the norm before clipping is logged); if the loss or the gradient norm is not finite
   the step is skipped: gradients dropped, weights, optimizer and LR schedule untouched (bit-identical),
   `skipped_steps` counted and logged; a loss non-finite `max_nonfinite_steps` steps in a row stops the run
   (`engine.guard.NonFiniteError`);
5. AdamW step, LR schedule (linear warm-up, then constant | linear | cosine decay; `train/lr` is the rate the
   step used), weight push to the publisher every `sync_every_steps`, checkpoint, stats
   (`stats.aggregate_stats`, Ludic's grouping).

Reference model (KL terms), temperature and ProRL-style reference resets: `ludic_fast.objectives.rl`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from torch import Tensor, nn

from ludic_fast.algorithm import RLAlgorithm
from ludic_fast.engine.config import MIXED_PRECISION, EngineConfig, resolve_pad_token_id
from ludic_fast.engine.objective import Objective
from ludic_fast.engine.schedule import lr_lambda
from ludic_fast.engine.trainer import Engine
from ludic_fast.objectives.rl import RLConfig, RLObjective
from ludic_fast.run.stats import Reducer


@dataclass
class TrainerConfig(RLConfig, EngineConfig):
    """The engine's settings (`EngineConfig`: device, optimizer, schedule, lengths, layout, precision, head) and
    the RL objective's (`RLConfig`: max_lag, temperature, kl_target, entropy_floor, kl_ema_decay, ref_reset,
    ref_mix_alpha), each checked by its own class."""

    def __post_init__(self) -> None:
        EngineConfig.__post_init__(self)
        RLConfig.__post_init__(self)

    def rl_config(self) -> RLConfig:
        """The RL objective's part."""
        return RLConfig(**{f.name: getattr(self, f.name) for f in fields(RLConfig)})


def _rl_settings_set(cfg: EngineConfig) -> list[str]:
    """The RL settings `cfg` sets away from their defaults (none for a plain EngineConfig)."""
    if not isinstance(cfg, RLConfig):
        return []
    default = RLConfig()
    return [f.name for f in fields(RLConfig) if getattr(cfg, f.name) != getattr(default, f.name)]


class Trainer(Engine):
    """The engine on `RLObjective(algo, batch_source, ref_model=, reducers=, config=cfg.rl_config())`, or on
    `objective` (then algo, batch_source, ref_model, reducers and cfg's RL settings are refused). The other
    keyword arguments are the engine's (`Engine`: publisher, param_filter, checkpoint_config, resume_from,
    train_logger, evaluator, lora_config)."""

    def __init__(
        self,
        *,
        model: nn.Module,
        cfg: EngineConfig,
        algo: RLAlgorithm | None = None,
        batch_source: Any = None,
        objective: Objective | None = None,
        ref_model: nn.Module | None = None,
        reducers: Mapping[str, Reducer] | None = None,
        **engine_kwargs: Any,
    ):
        if not isinstance(cfg, EngineConfig):
            raise TypeError(f"cfg must be a TrainerConfig (or an EngineConfig), got {type(cfg).__name__}")
        if objective is None:
            if algo is None:
                raise ValueError("pass an objective, or algo and batch_source (RL / SFT)")
            config = cfg.rl_config() if isinstance(cfg, TrainerConfig) else RLConfig()
            objective = RLObjective(algo, batch_source, ref_model=ref_model, reducers=reducers, config=config)
        elif algo is not None or batch_source is not None or ref_model is not None or reducers:
            raise ValueError("algo / batch_source / ref_model / reducers build an RL objective: not with objective=")
        elif _rl_settings_set(cfg):
            raise ValueError(f"{', '.join(_rl_settings_set(cfg))}: settings of the RL objective built from algo=, "
                             "not of objective= (give them to its own config)")
        super().__init__(model=model, cfg=cfg, objective=objective, **engine_kwargs)

    # ------------------------------------------------------------------------ the RL objective's parts
    @property
    def algo(self) -> RLAlgorithm | None:
        return getattr(self.objective, "algo", None)

    @property
    def batch_source(self) -> Any:
        return getattr(self.objective, "batch_source", None)

    @property
    def ref_model(self) -> nn.Module | None:
        return getattr(self.objective, "ref_model", None)

    def reference_logps(self, batch: Mapping[str, Tensor]) -> Tensor:
        """The RL objective's reference log-probs of a collated batch (`RLObjective.reference_logps`)."""
        return self.objective.reference_logps(self, batch)

    def reset_reference(self) -> None:
        """ref <- policy (or the mix), as the RL objective's reset (`RLObjective.reset_reference`)."""
        self.objective.reset_reference(self)


__all__ = ["MIXED_PRECISION", "Trainer", "TrainerConfig", "lr_lambda", "resolve_pad_token_id"]
