"""The launch helpers (`ludic_fast.distributed.launch`): torchrun's environment read strictly; on 2 gloo ranks
(forked) a signal sent to one rank is seen by both at the same read, flags and sums agree, gradients outside a
wrapper are averaged, and an FSDP2 model samples with ranks decoding different numbers of steps (the tokens
equal the unsharded model's)."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from ludic_fast.distributed.launch import (
    AgreedStop,
    RankInfo,
    all_ranks,
    average_gradients,
    backend_for,
    full_parameters,
    global_sum,
    rank_share,
    torchrun_env,
    wrap_model,
)
from ludic_fast.distributed.local import run_local_group
from ludic_fast.embedded import build_char_tokenizer, build_tiny_model

pytestmark = pytest.mark.timeout(120)
SMALL = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2)


def test_torchrun_env():
    assert torchrun_env({}) is None
    assert torchrun_env({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}) == RankInfo(3, 4, 1)
    assert torchrun_env({"WORLD_SIZE": "2", "RANK": "0"}).is_main
    with pytest.raises(ValueError, match="RANK="):
        torchrun_env({"WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="WORLD_SIZE='x'"):
        torchrun_env({"WORLD_SIZE": "x", "RANK": "0"})
    with pytest.raises(ValueError, match=r"RANK=2 must lie in \[0, WORLD_SIZE=2\)"):
        torchrun_env({"WORLD_SIZE": "2", "RANK": "2"})


def test_backend_and_share():
    assert backend_for("cpu") == "gloo" and backend_for("cuda:1") == "nccl"
    assert rank_share(list(range(7)), 1, 3) == [1, 4]
    with pytest.raises(ValueError, match="mode must be one of"):
        wrap_model(torch.nn.Linear(2, 2), "zero3", "cpu")


def _worker(rank: int, world: int) -> None:
    torch.set_num_threads(1)
    # a SIGINT delivered to rank 1 only: both ranks read `requested` once, both see it, with SIGINT's exit code
    with AgreedStop() as stop:
        if rank == 1:
            os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested and stop.exit_code == 130, rank
    assert all_ranks(True) and not all_ranks(rank == 0)
    assert global_sum(rank + 1.5) == 4.0
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = None if rank == 0 else torch.tensor([2.0, 4.0, 6.0])  # a missing gradient counts as zero
    average_gradients([p])
    torch.testing.assert_close(p.grad, torch.tensor([1.0, 2.0, 3.0]))
    # sampling from FSDP2 shards: rank r decodes 3 + 5 r tokens; the tokens equal the unsharded model's
    tok = build_char_tokenizer()
    plain = build_tiny_model(len(tok), seed=0, **SMALL)
    sharded = wrap_model(build_tiny_model(len(tok), seed=0, **SMALL), "fsdp2", "cpu")
    ids, n = torch.tensor([[5, 6, 7]]), 3 + 5 * rank
    outs = []
    for model in (plain, sharded):
        torch.manual_seed(0)
        with full_parameters(model), torch.no_grad():
            outs.append(model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                       max_new_tokens=n, min_new_tokens=n, pad_token_id=0))
    assert outs[0].shape[1] == 3 + n and torch.equal(outs[0], outs[1]), rank
    assert type(next(sharded.parameters())).__name__ == "DTensor"  # sharded again afterwards
    sharded(input_ids=ids).logits.sum().backward()  # and trains


def test_two_ranks_agree():
    run_local_group(_worker, 2, start_method="fork")


def _late_signal_worker(rank: int, world: int) -> None:
    """SIGINT lands on rank 1 while the agreeing all-reduce is in flight (its handler runs as the collective
    returns): that read answers what the ranks sent (no stop) on both ranks, the next read a stop on both."""
    import torch.distributed as dist

    reduce = dist.all_reduce

    def reduce_then_signal(*args, **kwargs):
        result = reduce(*args, **kwargs)
        if rank == 1:
            dist.all_reduce = reduce  # once
            os.kill(os.getpid(), signal.SIGINT)
        return result

    dist.all_reduce = reduce_then_signal
    with AgreedStop() as stop:
        assert not stop.requested, rank
        assert stop.requested and stop.exit_code == 130, rank


def test_a_signal_during_the_agreement_is_seen_by_every_rank_at_the_next_read():
    run_local_group(_late_signal_worker, 2, start_method="fork")


def _guard_worker(rank: int, world: int) -> None:
    """DPO under DDP where only rank 1's loss is NaN: both ranks skip the step and both give up at it."""
    from ludic_fast.data.preference_data import embedded_rows, encode_rows
    from ludic_fast.engine.config import TrainerConfig
    from ludic_fast.engine.guard import NonFiniteError
    from ludic_fast.engine.trainer import Trainer
    from ludic_fast.losses import DPOLoss
    from ludic_fast.objectives.preference import PreferenceObjective

    class NaNOnRank1(PreferenceObjective):
        def loss(self, engine, batch):
            loss, stats = super().loss(engine, batch)
            return (loss * float("nan") if rank == 1 else loss), stats

    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    pairs = encode_rows(embedded_rows("pairs", 4), "pairs", tok, chat_template=False)
    model = wrap_model(build_tiny_model(len(tok), seed=0, **SMALL), "ddp", "cpu")
    objective = NaNOnRank1(DPOLoss(), build_tiny_model(len(tok), seed=1, **SMALL))
    objective.use_examples(pairs, batch_size=4).shard(rank, world)
    cfg = TrainerConfig(model_device="cpu", pad_token_id=tok.pad_token_id, max_seq_len=32, micro_token_budget=64,
                        sync_every_steps=0, max_nonfinite_steps=2)
    trainer = Trainer(model=model, objective=objective, cfg=cfg)
    before = [p.detach().clone() for p in model.parameters()]
    trainer.train_step_sync()
    assert trainer.skipped_steps == 1 and trainer.nonfinite_in_row == 1, rank
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(NonFiniteError, match="step 2"):
        trainer.train_step_sync()


def test_the_non_finite_guard_acts_on_every_rank_at_the_same_step():
    run_local_group(_guard_worker, 2, start_method="fork")
