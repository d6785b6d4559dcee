"""Training under torch.distributed on a 2-process gloo group: Ludic's cross-rank stats reduction and one
training step under DDP / FSDP2 equal to the single-process step."""

from __future__ import annotations

import pytest
import torch

from ludic_fast.distributed.local import run_local_group
from ludic_fast.distributed.stats import reduce_stats_across_ranks


def _stats_worker(rank: int, world: int) -> None:
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


def test_stats_reduced_across_ranks_by_ludic_rule():
    run_local_group(_stats_worker, 2)


def test_stats_reduction_is_identity_without_a_process_group():
    stats = {"loss": 2.0, "num_samples": 3}
    assert reduce_stats_across_ranks(stats) == stats
