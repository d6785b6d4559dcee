"""The engine step's speed parts on the test's device (`ludic_fast.engine.step_parts`): AdamW from
`make_adamw` (fused) against torch's per-parameter AdamW, and the synchronising
CUDA calls of a Trainer step (`engine.host_syncs.CudaSyncs`): one in the step's own code."""

from __future__ import annotations

import pytest
import torch
from _gpu import DEVICES, on
from _trainer_fixtures import ListSource, make_items, tiny_model

from ludic_fast.algorithm import make_cispo
from ludic_fast.engine.host_syncs import CudaSyncs
from ludic_fast.engine.step_parts import make_adamw
from ludic_fast.trainer import Trainer, TrainerConfig


@pytest.mark.parametrize("device", DEVICES)
def test_make_adamw_equals_the_per_parameter_loop(device):
    """Fused (fp32 arithmetic in one kernel) on both devices: within 1e-6 relative of the loop."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 48, device=device)),
              torch.nn.Parameter(torch.randn(300, device=device))]
    loop = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = make_adamw(params, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    ref = torch.optim.AdamW(loop, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    assert opt.defaults["fused"] is True
    for _ in range(5):
        for p, q in zip(params, loop):
            g = torch.randn(p.shape, device=device)
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    for p, q in zip(params, loop):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", [on("cuda", id="cuda")])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_a_trainer_step_synchronises_once_in_its_own_code(device, layout):
    cfg = TrainerConfig(model_device=device, pad_token_id=0, sync_every_steps=0, max_seq_len=16,
                        micro_token_budget=24, layout=layout)
    trainer = Trainer(model=tiny_model(), algo=make_cispo(group_size=2), batch_source=ListSource([make_items(6)]),
                      cfg=cfg)
    trainer.train_step_sync()
    with CudaSyncs() as syncs:
        trainer.train_step_sync()
    own = [r for r in syncs.log if r.where.startswith(("ludic_fast/engine/", "ludic_fast/objectives/",
                                                       "ludic_fast/run/"))]
    assert len(own) == 1 and "read_step_values" in own[0].where, syncs.where()
