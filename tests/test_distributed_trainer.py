"""Training under torch.distributed on a 2-process gloo group (CPU): Ludic's cross-rank stats reduction, and
one `Trainer` step under DDP and under FSDP2 (`fully_shard` on the layers and the root, and with the head as
its own unit) equal to the single-process step on the union of both ranks' items, for a per-sequence mean
(CISPO), the token mean (DAPO's) and the prompt mean (ScaleRL's) with unequal token counts on the ranks and
prompts whose responses are split across them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ludic_fast.algorithm import RLAlgorithm
from ludic_fast.data.batching import MacroTotals
from ludic_fast.data.credit import ConstantCredit
from ludic_fast.data.types import ActorTokenLogps, SampleAttachments, SAWBatch, SAWItem
from ludic_fast.distributed import Rank0Publisher
from ludic_fast.distributed.local import run_local_group
from ludic_fast.distributed.macro import macro_totals_across_ranks
from ludic_fast.distributed.stats import reduce_stats_across_ranks
from ludic_fast.embedded import build_tiny_model
from ludic_fast.losses import CISPOLoss, ScaleRLLoss, TokenClippedSurrogateLoss
from ludic_fast.trainer import Trainer, TrainerConfig

pytestmark = pytest.mark.timeout(300)
V = 24
ITEMS_PER_RANK = 4


def _check_stats(rank: int) -> None:
    local = [
        {"loss": 1.0, "num_samples": 2, "target_rollouts": 1, "gpu_mem_mb": 5.0, "train_step": 3, "phase": "rl",
         "ratio_mean": torch.tensor(0.5)},
        {"loss": 4.0, "num_samples": 6, "target_rollouts": 3, "gpu_mem_mb": 7.0, "train_step": 3, "phase": "rl",
         "ratio_mean": torch.tensor(1.5)},
    ][rank]
    out = reduce_stats_across_ranks(local)
    assert out["loss"] == pytest.approx((1.0 * 2 + 4.0 * 6) / 8)  # weighted by num_samples
    assert out["ratio_mean"] == pytest.approx((0.5 * 2 + 1.5 * 6) / 8)
    assert out["num_samples"] == 8 and out["target_rollouts"] == 4  # summed
    assert out["gpu_mem_mb"] == 7.0  # max
    assert out["train_step"] == 3 and out["phase"] == "rl"  # local / non-numeric untouched
    plain = reduce_stats_across_ranks({"loss": [1.0, 4.0][rank]})
    assert plain["loss"] == pytest.approx(2.5)  # no num_samples: mean over ranks
    with pytest.raises(ValueError, match="different numeric stat keys"):
        reduce_stats_across_ranks({"loss": 1.0} if rank == 0 else {"kl": 1.0})


def _items(rank: int) -> list[SAWItem]:
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for i in range(ITEMS_PER_RANK):
        # ragged: several micro-batches, padding; 14 action tokens on rank 0, 12 on rank 1
        n_prompt, n_action = 3 + i % 2, 2 + (i * (rank + 1)) % 4
        ids = torch.randint(3, V, (n_prompt + n_action,), generator=g).tolist()
        logps = (-2.5 + 0.3 * torch.randn(n_action, generator=g)).tolist()
        weight = float(torch.randn((), generator=g))
        meta = {"rollout_id": f"r{rank}-{i}"}
        if rank == 0 or i < 3:  # groups g0, g1 straddle the ranks; rank 1's last item is a prompt of its own
            meta["request_meta"] = {"group_id": f"g{i // 2}"}
        out.append(SAWItem(ids, [1] * len(ids), [0] * n_prompt + [1] * n_action, weight=weight, meta=meta,
                           attachments=SampleAttachments(ActorTokenLogps(logps))))
    return out


class _Source:
    def __init__(self, items: list[SAWItem]):
        self.items = items

    async def next_batch(self) -> SAWBatch:
        return SAWBatch(items=list(self.items), meta={"target_rollouts": len(self.items)})


def _model() -> nn.Module:
    return build_tiny_model(V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=2, seed=0)


class _Capture:
    def __init__(self):
        self.published: list[tuple[dict, int]] = []

    def publish(self, params, version):
        self.published.append(({k: v.detach().clone() for k, v in params.items()}, version))


# the loss families by aggregation: per-sequence means, the token mean (DAPO), the prompt mean (ScaleRL)
LOSSES = {"cispo": CISPOLoss, "token_mean": lambda: TokenClippedSurrogateLoss(0.2, 0.28, aggregation="token_mean"),
          "prompt_mean": lambda: ScaleRLLoss(eps_max=4.0)}


def _step(model: nn.Module, items: list[SAWItem], loss: str, reduce_stats: bool, publisher=None) -> dict:
    cfg = TrainerConfig(model_device="cpu", pad_token_id=0, sync_every_steps=int(publisher is not None), lr=1e-3,
                        max_grad_norm=1.0, max_seq_len=16, micro_token_budget=20,
                        reduce_stats_across_ranks=reduce_stats)
    algo = RLAlgorithm(loss, ConstantCredit(1.0), LOSSES[loss]())
    trainer = Trainer(model=model, algo=algo, batch_source=_Source(items), cfg=cfg, publisher=publisher)
    return trainer.train_step_sync()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _check_step(rank: int, world: int, mode: str, loss: str, single: nn.Module, ref_stats: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    model = _model()
    if mode == "ddp":
        wrapped = DistributedDataParallel(model)
    else:
        # an explicit CPU mesh: fully_shard's default mesh is CUDA whenever a GPU is visible, which would move
        # the parameters to cuda:0 while the gloo ranks feed CPU batches
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        if mode == "fsdp2_head":  # the head its own FSDP unit: call_head's module forward unshards it
            fully_shard(model.lm_head, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped = model  # bare FSDP2 module: call_in_forward goes through its hooks
    capture = _Capture()
    stats = _step(wrapped, _items(rank), loss, reduce_stats=True, publisher=capture)  # wrapped in Rank0Publisher
    mode = f"{mode}/{loss}"

    ref_params = dict(single.named_parameters())
    # weights pushed after the step: gathered, wrapper prefixes stripped, from rank 0 only
    assert len(capture.published) == (1 if rank == 0 else 0), mode
    if rank == 0:
        params, version = capture.published[0]
        assert version == 1 and params.keys() == ref_params.keys(), mode
        for name, t in params.items():
            torch.testing.assert_close(t, ref_params[name].detach(), rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(_full(p.detach()), ref_params[name].detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{mode}: parameter {name} after one step: {m}")
    assert stats["train/num_samples"] == ref_stats["train/num_samples"] == world * ITEMS_PER_RANK
    assert stats["train/loss"] == pytest.approx(ref_stats["train/loss"], rel=1e-5), mode
    assert stats["train/grad_norm"] == pytest.approx(ref_stats["train/grad_norm"], rel=1e-4), mode


def _check_macro_totals(rank: int) -> None:
    """By hand: action tokens 2 3 4 5 (rank 0) and 2 4 2 4 (rank 1); g0 = items 0-1 of both ranks, g1 = items
    2-3 of rank 0 and item 2 of rank 1, rank 1's item 3 ungrouped: 26 tokens, 3 prompts, g0 11, g1 11."""
    total = macro_totals_across_ranks(MacroTotals.of(_items(rank)))
    assert (total.n_items, total.tokens, total.prompts, total.ranks) == (4, 26.0, 3, 2)
    assert dict(total.prompt_tokens) == {"g0": 11.0, "g1": 11.0}  # rank-local counts: 5, 9 | 6, 2


def _worker(rank: int, world: int) -> None:
    torch.set_num_threads(1)
    _check_stats(rank)
    _check_macro_totals(rank)
    for loss in LOSSES:  # token / prompt means over both ranks' items: macro_totals_across_ranks
        single = _model()  # the reference: one process, both ranks' items (every rank computes it)
        ref_stats = _step(single, [it for r in range(world) for it in _items(r)], loss, reduce_stats=False)
        for mode in ("ddp", "fsdp2", "fsdp2_head"):
            _check_step(rank, world, mode, loss, single, ref_stats)


def test_two_rank_ddp_and_fsdp2_steps_equal_the_single_process_step():
    # forked ranks inherit this process's imports (spawned ones start an interpreter each); not after CUDA started
    run_local_group(_worker, 2, start_method="spawn" if torch.cuda.is_initialized() else "fork")


def test_without_a_process_group_stats_and_publishing_pass_through():
    stats = {"loss": 2.0, "num_samples": 3}
    assert reduce_stats_across_ranks(stats) == stats
    capture = _Capture()
    Rank0Publisher(capture).publish({"module.w": torch.ones(2)}, version=4)
    assert list(capture.published[0][0]) == ["w"] and capture.published[0][1] == 4
    with pytest.raises(TypeError, match="inner"):
        Rank0Publisher(object())
