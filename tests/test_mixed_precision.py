"""Mixed precision (TrainerConfig.mixed_precision_dtype): fp32 master weights, gradients and AdamW states; the
forward under autocast; bf16 close to fp32; fp16 with a dynamic loss scale that skips an overflowing step."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from _trainer_fixtures import ListSource, make_items, tiny_model

from ludic_fast.algorithm import make_cispo
from ludic_fast.data.types import SAWBatch
from ludic_fast.engine.guard import NonFiniteError
from ludic_fast.trainer import Trainer, TrainerConfig


def _trainer(items, **kw) -> Trainer:
    cfg = TrainerConfig(model_device="cpu", pad_token_id=0, sync_every_steps=0, max_seq_len=16,
                        micro_token_budget=64, **kw)
    return Trainer(model=tiny_model(), algo=make_cispo(group_size=1), batch_source=ListSource([items]), cfg=cfg)


def test_bf16_autocast_keeps_fp32_master_weights_and_is_close_to_fp32():
    items = make_items(6, seed=1)
    runs = {}
    for dtype in (None, "bf16"):
        trainer = _trainer(items, mixed_precision_dtype=dtype)
        loss, _, _, _ = trainer.accumulate_gradients(SAWBatch(items=list(items)))
        runs[dtype] = loss, {n: p.grad for n, p in trainer.model.named_parameters()}
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in trainer.model.parameters())
    torch.testing.assert_close(runs["bf16"][0], runs[None][0], rtol=3e-2, atol=1e-3)
    g32 = torch.cat([g.flatten() for g in runs[None][1].values()])
    g16 = torch.cat([runs["bf16"][1][n].flatten() for n in runs[None][1]])
    assert float((g16 - g32).norm() / g32.norm()) < 5e-2
    assert not torch.equal(g16, g32)  # the forward really ran in bf16


def test_head_gets_the_autocast_dtype():
    items = make_items(3, seed=2)
    trainer = _trainer(items, mixed_precision_dtype="bf16")
    seen = {}
    compute = trainer.algo.compute_loss

    def spy(batch, hidden, weight, **kw):
        seen["hidden"], seen["weight"] = hidden.dtype, weight.dtype
        return compute(batch, hidden=hidden, weight=weight, **kw)

    trainer.algo.compute_loss = spy
    trainer.accumulate_gradients(SAWBatch(items=list(items)))
    assert seen == {"hidden": torch.bfloat16, "weight": torch.bfloat16}


def test_fp16_loss_scale_steps_and_skips_an_overflow():
    items = make_items(4, seed=3)
    trainer = _trainer(items, mixed_precision_dtype="fp16", lr=1e-2)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    scale0 = trainer.scaler.get_scale()
    trainer.train_step_sync()
    assert trainer.skipped_steps == 0
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))
    trainer.scaler.update(new_scale=2.0**100)  # the next scaled gradients overflow in fp16
    weights = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train_step_sync()
    assert trainer.skipped_steps == 1
    assert all(torch.equal(a, p) for a, p in zip(weights, trainer.model.parameters()))
    assert trainer.scaler.get_scale() == 2.0**99 and scale0 > 0  # halved after the overflow


def test_fp16_overflows_do_not_stop_the_run_but_a_non_finite_loss_does():
    """Four fp16 steps whose scaled gradients overflow (finite loss, infinite gradient) are skipped and halve
    the loss scale, and the run goes on: `max_nonfinite_steps` (3) counts steps whose loss is not finite, which
    still stop the run at the third in a row."""
    trainer = _trainer(make_items(4, seed=5), mixed_precision_dtype="fp16", lr=1e-2)
    assert trainer.train_step_sync()["train/step_skipped"] == 0.0
    trainer.scaler.update(new_scale=2.0**100)  # every scaled gradient below overflows in fp16
    for _ in range(4):
        stats = trainer.train_step_sync()
        assert stats["train/step_skipped"] == 1.0 and math.isfinite(stats["train/loss"])
    assert trainer.skipped_steps == 4 and trainer.step_idx == 5 and trainer.scaler.get_scale() == 2.0**96
    trainer.algo.preprocess = _poisoned
    trainer.train_step_sync()
    trainer.train_step_sync()
    with pytest.raises(NonFiniteError, match=r"^step 8: the loss was not finite for 3 steps in a row"):
        trainer.train_step_sync()


def _poisoned(batch: SAWBatch) -> SAWBatch:
    bad = copy.copy(batch.items[0])
    bad.weight = float("nan")  # after construction: bypasses SAWItem's finiteness check
    batch.items[0] = bad
    return batch

def test_mixed_precision_dtype_validation():
    with pytest.raises(ValueError, match="mixed_precision_dtype"):
        TrainerConfig(model_device="cpu", pad_token_id=0, mixed_precision_dtype="fp8")


def test_fp16_loss_scale_is_checkpointed(tmp_path):
    from ludic_fast.run.checkpoint import CheckpointConfig

    items = make_items(3, seed=4)
    ckpt = CheckpointConfig(str(tmp_path), every_n_steps=0)
    cfg = dict(model_device="cpu", pad_token_id=0, sync_every_steps=0, max_seq_len=16, micro_token_budget=64,
               mixed_precision_dtype="fp16")
    trainer = Trainer(model=tiny_model(), algo=make_cispo(group_size=1), batch_source=ListSource([items]),
                      cfg=TrainerConfig(**cfg), checkpoint_config=ckpt)
    trainer.train_step_sync()
    trainer.scaler.update(new_scale=1024.0)
    trainer.save_checkpoint()
    resumed = Trainer(model=tiny_model(), algo=make_cispo(group_size=1), batch_source=ListSource([items]),
                      cfg=TrainerConfig(**cfg), checkpoint_config=ckpt, resume_from="latest")
    assert resumed.scaler.get_scale() == 1024.0
