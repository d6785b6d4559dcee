"""Training statistics with Ludic master's semantics (`ludic.training.stats`).

- `aggregate_stats`: per-key reduction of the micro-batch loss stats (`gpu_*` -> max; the count keys
  -> sum; everything else -> mean weighted by the micro-batch item counts `sum_k n_k v_k / sum_k n_k`),
  plus batch-meta totals and the named `Reducer`s over the batch items. One host transfer in all.
- `Reducer`: a named reduction (mean | sum | count_true) of one value per item, read from a dotted path
  into `item.meta` (a missing segment skips the item) or computed by a callable, optionally normalised
  by the number of samples or rollouts (a zero denominator leaves the value un-normalised, as Ludic).
- `group_log_stats`: the key grouping of the log lines (`train/`, `eval/`, `perf/`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

#: keys summed (not averaged) across micro-batches and ranks.
SUM_KEYS = frozenset({"num_samples", "target_rollouts", "effective_rollouts", "total_completion_tokens"})
_KINDS = ("mean", "sum", "count_true")
_NORMALIZERS = (None, "samples", "rollouts")


@dataclass(frozen=True)
class Reducer:
    """Reduce one value per item: `kind` over `transform(source(item))` for the items whose value is not None.

    source: dotted path into `item.meta` (or into a plain dict record), or a callable taking the item.
    normalize_by: None | "samples" | "rollouts" (divide by that count unless it is 0).
    as_percent: display hint only; the value is never multiplied by 100.
    """

    kind: str
    source: str | Callable[[Any], Any]
    transform: Callable[[Any], Any] | None = None
    normalize_by: str | None = None
    as_percent: bool = False

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"Reducer kind must be one of {_KINDS}, got {self.kind!r}")
        if self.normalize_by not in _NORMALIZERS:
            raise ValueError(f"Reducer normalize_by must be one of {_NORMALIZERS}, got {self.normalize_by!r}")
        if not (callable(self.source) or isinstance(self.source, str)):
            raise TypeError("Reducer source must be a dotted path string or a callable")

    def value_of(self, item: Any) -> Any:
        """The item's value (None = skip): `source(item)`, or the dotted path into `item.meta` / the dict."""
        if callable(self.source):
            return self.source(item)
        node: Any = item if isinstance(item, Mapping) else getattr(item, "meta", {})
        for part in self.source.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return None
            node = node[part]
        return node

    def reduce(self, items: Iterable[Any], *, sample_count: int, rollout_count: int) -> float:
        values = []
        for item in items:
            v = self.value_of(item)
            if v is None:
                continue
            values.append(self.transform(v) if self.transform is not None else v)
        if self.kind == "mean":
            out = float(sum(float(v) for v in values) / len(values)) if values else 0.0
        elif self.kind == "sum":
            out = float(sum(float(v) for v in values))
        else:
            out = float(sum(1 for v in values if v))
        denom = {"samples": sample_count, "rollouts": rollout_count}.get(self.normalize_by or "", 0)
        return out / denom if denom else out


def default_reducers() -> dict[str, Reducer]:
    """Ludic's defaults: the rate of completions cut by the token limit, and of sequences cut by max_seq_len."""
    return {
        "completion_truncated_rate": Reducer(
            kind="count_true",
            source="finish_reason",
            transform=lambda r: r == "length",
            normalize_by="samples",
            as_percent=True,
        ),
        "seq_len_truncated_rate": Reducer(
            kind="count_true", source="seq_len_truncated", normalize_by="samples", as_percent=True
        ),
    }


def apply_reducers_to_records(
    records: Sequence[Any],
    reducers: Mapping[str, Reducer],
    *,
    sample_count: int | None = None,
    rollout_count: int | None = None,
) -> dict[str, float]:
    """The reducers over plain records (dicts or items); both counts default to `len(records)`."""
    n = len(records)
    return {
        name: r.reduce(
            records,
            sample_count=n if sample_count is None else sample_count,
            rollout_count=n if rollout_count is None else rollout_count,
        )
        for name, r in reducers.items()
    }


def _to_float_dict(values: Mapping[str, Tensor | float]) -> dict[str, float]:
    """One host transfer for all tensor values."""
    keys = [k for k, v in values.items() if isinstance(v, Tensor)]
    out = {k: float(v) for k, v in values.items() if not isinstance(v, Tensor)}
    if keys:
        stacked = torch.stack([values[k].detach().float().reshape(()) for k in keys]).cpu().tolist()
        out.update(zip(keys, stacked))
    return out


def _reduce_micro_stats(
    micro_stats_list: Sequence[Mapping[str, Any]], micro_batch_sizes: Sequence[int] | None
) -> dict[str, Tensor | float]:
    if micro_batch_sizes is not None and len(micro_batch_sizes) != len(micro_stats_list):
        raise ValueError(
            f"micro_batch_sizes has {len(micro_batch_sizes)} entries for {len(micro_stats_list)} micro-batches"
        )
    weights = [float(w) for w in micro_batch_sizes] if micro_batch_sizes is not None else [1.0] * len(micro_stats_list)
    keys: dict[str, None] = {}
    for stats in micro_stats_list:
        keys.update(dict.fromkeys(stats))
    out: dict[str, Tensor | float] = {}
    for key in keys:
        pairs = [(s[key], w) for s, w in zip(micro_stats_list, weights) if key in s]
        vals = [torch.as_tensor(v).detach().float().reshape(()) for v, _ in pairs]
        if not vals:
            continue
        device = vals[0].device
        stacked = torch.stack([v.to(device) for v in vals])
        if key.startswith("gpu_"):
            out[key] = stacked.max()
        elif key in SUM_KEYS:
            out[key] = stacked.sum()
        else:
            w = torch.tensor([w for _, w in pairs], dtype=torch.float32, device=device)
            out[key] = (stacked * w).sum() / w.sum().clamp(min=1e-12)
    return out


def aggregate_stats(
    micro_stats_list: Sequence[Mapping[str, Any]],
    saw_batches: Sequence[Any],
    *,
    reducers: Mapping[str, Reducer] | None = None,
    micro_batch_sizes: Sequence[int] | None = None,
) -> dict[str, float]:
    """Ludic's `aggregate_stats`: loss stats reduced over micro-batches, batch totals, reducers.

    Batch meta: num_samples = Σ len(items); target_rollouts = Σ (meta target_rollouts or batch_size or 0);
    effective_rollouts = Σ meta.get("effective_rollouts", target_rollouts); avg_total_reward and
    avg_completion_length are item-weighted means of the batch metas (0 without samples).
    """
    if not micro_stats_list:
        return {}
    stats = _to_float_dict(_reduce_micro_stats(micro_stats_list, micro_batch_sizes))
    num_samples = sum(len(b.items) for b in saw_batches)
    target = 0
    effective = 0
    weighted = {"avg_total_reward": 0.0, "avg_completion_length": 0.0}
    for b in saw_batches:
        t = b.meta.get("target_rollouts") or b.meta.get("batch_size") or 0
        target += int(t)
        effective += int(b.meta.get("effective_rollouts", t))
        for key in weighted:
            weighted[key] += float(b.meta.get(key, 0.0)) * len(b.items)
    stats["num_samples"] = float(num_samples)
    stats["target_rollouts"] = float(target)
    stats["effective_rollouts"] = float(effective)
    for key, total in weighted.items():
        stats[key] = total / num_samples if num_samples else 0.0
    if reducers:
        items = [it for b in saw_batches for it in b.items]
        stats.update(apply_reducers_to_records(items, reducers, sample_count=num_samples, rollout_count=target))
    return stats


def group_log_stats(stats: Mapping[str, Any]) -> dict[str, Any]:
    """Ludic's key grouping: train_step -> train/step, eval_step -> eval/step, keys already under
    train/ eval/ perf/ kept, eval_x -> eval/x, gpu_x -> perf/gpu_x, `phase` dropped, others -> train/x."""
    out: dict[str, Any] = {}
    for key, value in stats.items():
        if key == "phase":
            continue
        if key == "train_step":
            out["train/step"] = value
        elif key == "eval_step":
            out["eval/step"] = value
        elif key.startswith(("train/", "eval/", "perf/")):
            out[key] = value
        elif key.startswith("eval_"):
            out["eval/" + key[len("eval_") :]] = value
        elif key.startswith("gpu_"):
            out["perf/" + key] = value
        else:
            out["train/" + key] = value
    return out


__all__ = [
    "Reducer",
    "default_reducers",
    "aggregate_stats",
    "apply_reducers_to_records",
    "group_log_stats",
    "SUM_KEYS",
]
