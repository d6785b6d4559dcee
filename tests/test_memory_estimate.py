"""The peak-memory estimate against hand-counted terms of the 1-layer, 32-wide test Llama."""

from __future__ import annotations

import pytest
import torch
from _trainer_fixtures import ListSource, make_items, tiny_model

from ludic_fast.algorithm import make_cispo
from ludic_fast.engine.memory_estimate import estimate_peak_memory
from ludic_fast.ops.plan import plan_head
from ludic_fast.trainer import Trainer, TrainerConfig

V, H, I = 47, 32, 64  # noqa: E741
N_PARAMS = V * H + 4 * H * H + 3 * H * I + 3 * H + V * H  # embed, q/k/v/o, gate/up/down, 3 norms, untied head


def test_terms_by_hand():
    est = estimate_peak_memory(tiny_model(), micro_tokens=10)
    assert est.parameters == 4 * N_PARAMS and est.gradients == 4 * N_PARAMS and est.optimizer == 8 * N_PARAMS
    assert est.activations == 10 * ((10 * H + 4 * I) + 2 * H) * 4
    # the head term is the head plan's transient memory: at least the fp32 dW [V, H] and dh [10, H]
    assert est.head == plan_head(10, H, V, dtype=torch.float32, mode="fused_loss", device="cpu",
                                 backend="torch").transient_bytes
    assert est.head >= 4 * (V + 10) * H
    assert est.total == est.parameters + est.gradients + est.optimizer + est.activations + est.head
    assert est.format().startswith(f"peak memory estimate {est.total / 2**30:.2f} GiB")


def test_checkpointing_bf16_and_frozen_parameters():
    model = tiny_model()
    ckpt = estimate_peak_memory(model, micro_tokens=10, compute_dtype=torch.bfloat16, gradient_checkpointing=True)
    assert ckpt.activations == 10 * (H + (10 * H + 4 * I) + 2 * H) * 2
    model.lm_head.requires_grad_(False)
    frozen = estimate_peak_memory(model, micro_tokens=10, chunk_elements=100)
    assert frozen.gradients == 4 * (N_PARAMS - V * H) and frozen.optimizer == 2 * frozen.gradients
    for kw in ({"chunk_elements": 100}, {"memory_budget": "64KiB"}):
        got = estimate_peak_memory(model, micro_tokens=10, **kw).head
        assert got == plan_head(10, H, V, dtype=torch.float32, mode="fused_loss", device="cpu", backend="torch",
                                **kw).transient_bytes
    with pytest.raises(ValueError, match="micro_tokens"):
        estimate_peak_memory(model, micro_tokens=0)


def test_trainer_carries_the_estimate_at_its_micro_token_budget():
    trainer = Trainer(model=tiny_model(), algo=make_cispo(group_size=1), batch_source=ListSource([make_items(2)]),
                      cfg=TrainerConfig(model_device="cpu", pad_token_id=0, sync_every_steps=0, max_seq_len=16,
                                        micro_token_budget=64))
    assert trainer.memory_estimate == estimate_peak_memory(trainer.model, micro_tokens=64)
    budget = Trainer(model=tiny_model(), algo=make_cispo(group_size=1), batch_source=ListSource([make_items(2)]),
                     cfg=TrainerConfig(model_device="cpu", pad_token_id=0, sync_every_steps=0, max_seq_len=16,
                                       micro_token_budget=64, memory_budget="64KiB"))
    assert budget.memory_estimate == estimate_peak_memory(budget.model, micro_tokens=64, memory_budget=65536)
