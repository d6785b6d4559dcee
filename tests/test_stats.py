"""Stats with Ludic master's semantics (Ludic's test_stats, test_reducer)."""

from __future__ import annotations

import pytest
import torch

from ludic_fast.data.types import SAWBatch, SAWItem
from ludic_fast.run.stats import Reducer, aggregate_stats, apply_reducers_to_records, default_reducers, group_log_stats


def _item(**meta) -> SAWItem:
    return SAWItem(input_ids=[1, 2], attention_mask=[1, 1], action_mask=[0, 1], weight=1.0, meta=meta)


def test_micro_stats_weighted_by_item_counts():
    stats = aggregate_stats(
        [{"loss": torch.tensor(1.0), "logp": torch.tensor(-1.0)}, {"loss": torch.tensor(3.0), "logp": -3.0}],
        [SAWBatch(items=[_item() for _ in range(4)])],
        micro_batch_sizes=[1, 3],
    )
    assert stats["loss"] == pytest.approx(2.5) and stats["logp"] == pytest.approx(-2.5)
    assert stats["num_samples"] == 4
    with pytest.raises(ValueError, match="micro_batch_sizes"):
        aggregate_stats([{"loss": 1.0}], [], micro_batch_sizes=[1, 2])
    assert aggregate_stats([], []) == {}


def test_max_sum_keys_and_batch_meta():
    stats = aggregate_stats(
        [{"gpu_mem": 5.0, "num_samples": 2.0, "x": 1.0}, {"gpu_mem": 7.0, "num_samples": 3.0, "x": 3.0}],
        [SAWBatch(items=[_item(), _item()], meta={"target_rollouts": 3, "effective_rollouts": 1,
                                                  "avg_total_reward": 0.5, "avg_completion_length": 4.0})],
    )
    assert stats["gpu_mem"] == 7.0 and stats["x"] == 2.0
    assert stats["target_rollouts"] == 3 and stats["effective_rollouts"] == 1
    assert stats["num_samples"] == 2  # the batch count overrides the summed micro value
    assert stats["avg_total_reward"] == 0.5 and stats["avg_completion_length"] == 4.0
    assert aggregate_stats([{"a": 1.0}], [SAWBatch(meta={"batch_size": 4})])["avg_total_reward"] == 0.0


def test_reducers_ludic_cases():
    recs = [{"x": 1, "y": 3, "flag": True, "r": {"win": "yes"}}, {"x": 3, "y": 4, "flag": False, "r": {"win": "no"}}]
    recs.append({"r": {"win": "yes"}})
    out = apply_reducers_to_records(recs, {
        "mean_x": Reducer("mean", "x"),
        "sum_y": Reducer("sum", "y"),
        "flags": Reducer("count_true", "flag"),
        "flag_rate": Reducer("count_true", "flag", normalize_by="samples"),
        "win_rate": Reducer("mean", "r.win", transform=lambda v: v == "yes"),
        "x_plus_1": Reducer("mean", lambda r: r["x"] + 1 if "x" in r else None),
        "pct": Reducer("mean", "x", as_percent=True),
    })
    assert out["mean_x"] == 2.0 and out["sum_y"] == 7.0 and out["flags"] == 1.0
    assert out["flag_rate"] == pytest.approx(1 / 3) and out["win_rate"] == pytest.approx(2 / 3)
    assert out["x_plus_1"] == 3.0 and out["pct"] == 2.0
    zero = Reducer("sum", "y", normalize_by="rollouts")
    assert zero.reduce(recs, sample_count=3, rollout_count=0) == 7.0  # Ludic: a zero denominator is ignored
    assert Reducer("mean", "missing").reduce(recs, sample_count=3, rollout_count=3) == 0.0
    with pytest.raises(ValueError, match="kind"):
        Reducer("median", "x")


def test_default_reducers_on_items():
    items = [_item(finish_reason="length", seq_len_truncated=True), _item(finish_reason="stop")]
    stats = aggregate_stats([{"loss": 0.0}], [SAWBatch(items=items)], reducers=default_reducers())
    assert stats["completion_truncated_rate"] == 0.5 and stats["seq_len_truncated_rate"] == 0.5


def test_group_log_stats():
    grouped = group_log_stats({"train_step": 3, "eval_step": 2, "loss": 1.0, "cispo/loss": 2.0, "eval_acc": 0.5,
                               "gpu_mem": 1.0, "perf/t": 2.0, "train/x": 1.0, "eval/y": 0.0, "phase": "rl"})
    assert grouped == {"train/step": 3, "eval/step": 2, "train/loss": 1.0, "train/cispo/loss": 2.0,
                       "eval/acc": 0.5, "perf/gpu_mem": 1.0, "perf/t": 2.0, "train/x": 1.0, "eval/y": 0.0}
