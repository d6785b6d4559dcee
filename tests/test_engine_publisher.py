"""The weight push: `PolicyPublisher` (publish(params, version)) types the engine's publisher, and a LoRA
policy is published with its adapters merged into the base weights, also when the rollout side shares the
model's device (the merged weights are copied before the in-place unmerge)."""

from __future__ import annotations

import peft
import pytest
import torch
from _trainer_fixtures import ListSource, make_items, tiny_model

from ludic_fast.algorithm import make_cispo
from ludic_fast.engine.publisher import PolicyPublisher
from ludic_fast.trainer import Trainer, TrainerConfig


class _Capture:
    def __init__(self):
        self.params, self.versions = {}, []

    def publish(self, params, version):
        self.params, self.versions = dict(params), [*self.versions, version]


def _lora_trainer(publisher) -> Trainer:
    lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], lora_dropout=0.0)
    cfg = TrainerConfig(model_device="cpu", pad_token_id=0, sync_every_steps=1, max_seq_len=16,
                        micro_token_budget=64, lr=1e-2)
    return Trainer(model=tiny_model(), algo=make_cispo(group_size=1), batch_source=ListSource([make_items(3)]),
                   cfg=cfg, publisher=publisher, lora_config=lora)


def test_lora_weights_are_published_merged():
    capture = _Capture()
    trainer = _lora_trainer(capture)
    trainer.train_step_sync()  # the adapters move off their zero init, then the push
    model = trainer.model
    name = next(n for n in capture.params if n.endswith("q_proj.base_layer.weight"))
    base = dict(model.named_parameters())[name].detach().clone()
    prefix = name[: -len("base_layer.weight")]
    a, b = (dict(model.named_parameters())[f"{prefix}lora_{x}.default.weight"].detach() for x in "AB")
    scale = 4 / 2  # lora_alpha / r
    assert capture.versions == [1] and b.abs().max() > 0
    torch.testing.assert_close(capture.params[name], base + scale * b @ a)
    assert torch.equal(dict(model.named_parameters())[name], base)  # the model itself left unmerged


def test_the_publisher_is_a_policy_publisher():
    assert isinstance(_Capture(), PolicyPublisher)
    with pytest.raises(TypeError, match="publisher must have publish"):
        _lora_trainer(object())
