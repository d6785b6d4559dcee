"""An offline objective (DPO against a reference model) on the engine under DDP and FSDP2 on a 2-process gloo
group (CPU): each rank trains on its half of the pairs; after one step the weights and the mean loss equal
the single-process step on all pairs (a mean over pairs, equal counts per rank)."""

from __future__ import annotations

import pytest
import torch

from ludic_fast.data.preference_data import embedded_rows, encode_rows
from ludic_fast.distributed.local import run_local_group
from ludic_fast.embedded import build_char_tokenizer, build_tiny_model
from ludic_fast.losses import DPOLoss
from ludic_fast.objectives.preference import PreferenceObjective
from ludic_fast.trainer import Trainer, TrainerConfig

pytestmark = pytest.mark.timeout(300)
SMALL = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2)


def _model(tok, seed: int) -> torch.nn.Module:
    return build_tiny_model(len(tok), seed=seed, **SMALL)


def _step(model, tok, pairs, reduce_stats: bool) -> dict:
    objective = PreferenceObjective(DPOLoss(), _model(tok, seed=1).requires_grad_(False))
    cfg = TrainerConfig(model_device="cpu", pad_token_id=tok.pad_token_id, lr=1e-2, max_seq_len=32,
                        micro_token_budget=64, sync_every_steps=0, reduce_stats_across_ranks=reduce_stats)
    trainer = Trainer(model=model, objective=objective.use_examples(pairs, batch_size=len(pairs)), cfg=cfg)
    return trainer.train_step_sync()


def _worker(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    pairs = encode_rows(embedded_rows("pairs", 8), "pairs", tok, chat_template=False)
    single = _model(tok, seed=0)
    ref_stats = _step(single, tok, pairs, reduce_stats=False)
    mine = pairs[rank::world]
    for mode in ("ddp", "fsdp2"):
        model = _model(tok, seed=0)
        if mode == "ddp":
            wrapped = DistributedDataParallel(model)
        else:
            mesh = init_device_mesh("cpu", (world,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            wrapped = model
        stats = _step(wrapped, tok, mine, reduce_stats=True)
        assert stats["train/loss"] == pytest.approx(ref_stats["train/loss"], rel=1e-5), mode
        for (name, p), q in zip(model.named_parameters(), single.parameters()):
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            torch.testing.assert_close(full.detach(), q.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name, mode=mode: f"{mode}: {name}: {m}")


def test_dpo_under_ddp_and_fsdp2_equals_the_single_process_step():
    run_local_group(_worker, 2)
