"""The RL trainer is the engine on the RL objective: `ludic_fast.trainer.TrainerConfig` is EngineConfig +
RLConfig, `Trainer(objective=...)` refuses RL settings it would ignore, the former paths and names still work
with a DeprecationWarning (engine.config.TrainerConfig, engine.trainer.Trainer, OfflineConfig's former fields),
and a setting an objective cannot act on is refused, not dropped."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _trainer_fixtures import ListSource, make_items, tiny_model

from ludic_fast.algorithm import make_cispo
from ludic_fast.data.preference_data import embedded_rows, encode_rows
from ludic_fast.embedded import build_char_tokenizer
from ludic_fast.engine.config import EngineConfig
from ludic_fast.engine.trainer import Engine
from ludic_fast.losses import SimPOLoss
from ludic_fast.objectives.distill import DistillObjective
from ludic_fast.objectives.preference import PreferenceObjective
from ludic_fast.objectives.rl import RLConfig, RLObjective
from ludic_fast.offline_trainer import OfflineConfig
from ludic_fast.trainer import Trainer, TrainerConfig

BASE = dict(model_device="cpu", pad_token_id=0, sync_every_steps=0, max_seq_len=16, micro_token_budget=64)


def test_trainer_config_is_the_engine_and_rl_settings():
    names = {f.name for f in dataclasses.fields(TrainerConfig)}
    engine, rl = {f.name for f in dataclasses.fields(EngineConfig)}, {f.name for f in dataclasses.fields(RLConfig)}
    assert names == engine | rl and not engine & rl
    assert rl == {"max_lag", "temperature", "kl_target", "entropy_floor", "kl_ema_decay", "ref_reset", "ref_mix_alpha"}
    cfg = TrainerConfig(**BASE, kl_target=0.5, ref_reset="mix", max_lag=2)
    assert cfg.rl_config() == RLConfig(kl_target=0.5, ref_reset="mix", max_lag=2)
    trainer = Trainer(model=tiny_model(), algo=make_cispo(group_size=1), batch_source=ListSource([make_items(2)]),
                      cfg=TrainerConfig(**BASE, max_lag=3))
    assert isinstance(trainer, Engine) and trainer.objective.config == RLConfig(max_lag=3)
    with pytest.raises(ValueError, match="ref_reset"):
        TrainerConfig(**BASE, ref_reset="soft")
    with pytest.raises(ValueError, match="pass ref_model"):
        RLObjective(make_cispo(group_size=1), ListSource([]), config=RLConfig(kl_target=1.0))


def test_rl_settings_with_another_objective_are_refused():
    objective = PreferenceObjective(SimPOLoss())
    with pytest.raises(ValueError, match="max_lag, kl_target: settings of the RL objective"):
        Trainer(model=tiny_model(), objective=objective, cfg=TrainerConfig(**BASE, kl_target=1.0, max_lag=1))
    assert Trainer(model=tiny_model(), objective=objective, cfg=TrainerConfig(**BASE)).objective is objective
    with pytest.raises(TypeError, match="EngineConfig"):
        Engine(model=tiny_model(), objective=objective, cfg=dict(BASE))


def test_former_paths_and_names_warn_and_still_work():
    import ludic_fast.engine.config as config_module
    import ludic_fast.engine.trainer as trainer_module

    with pytest.warns(DeprecationWarning, match="EngineConfig"):
        assert config_module.TrainerConfig is EngineConfig
    with pytest.warns(DeprecationWarning, match="Engine"):
        assert trainer_module.Trainer is Engine
    with pytest.warns(DeprecationWarning, match="micro_batch_size -> micro_token_budget"):
        cfg = OfflineConfig(micro_batch_size=4, max_length=10, device="cpu", mixed_precision="bf16")
    assert (cfg.micro_token_budget, cfg.max_seq_len, cfg.model_device, cfg.mixed_precision_dtype) == (80, 10, "cpu",
                                                                                                      "bf16")
    with pytest.warns(DeprecationWarning):  # None: no truncation, 16 pairs a micro-batch, as before
        assert (OfflineConfig(max_length=None).max_seq_len, OfflineConfig(max_length=8).micro_token_budget) == (
            1 << 20, 16 * 2 * 8)
    with pytest.raises(ValueError, match="not both"), pytest.warns(DeprecationWarning):
        OfflineConfig(max_length=8, micro_token_budget=100)
    assert (OfflineConfig().micro_token_budget, OfflineConfig(steps=7).total_steps) == (16 * 2 * 64, 7)
    with pytest.raises(AttributeError):
        OfflineConfig().max_length  # noqa: B018 - a construction name only: no stale default to read
    with pytest.raises(ValueError, match="micro_batch_size"), pytest.warns(DeprecationWarning):
        OfflineConfig(micro_batch_size=-1)


def test_distillation_refuses_chunk_elements_it_cannot_use():
    tok = build_char_tokenizer()
    examples = encode_rows(embedded_rows("completions", 2), "completions", tok, chat_template=False)
    objective = DistillObjective(tiny_model(seed=1)).use_examples(examples, batch_size=2)
    engine = Engine(model=tiny_model(), objective=objective,
                    cfg=EngineConfig(**{**BASE, "pad_token_id": tok.pad_token_id}, chunk_elements=4096))
    with pytest.raises(ValueError, match="chunk_elements"):
        engine.micro_loss(objective.collate(examples, engine))
    assert torch.isfinite(Engine(model=tiny_model(), objective=objective, cfg=EngineConfig(
        **{**BASE, "pad_token_id": tok.pad_token_id})).micro_loss(objective.collate(examples, engine))[0])
