"""Training statistics with Ludic master's semantics (`ludic.training.stats`).

- `aggregate_stats`: per-key reduction of the micro-batch loss stats (`gpu_*` -> max; the count keys
  -> sum; everything else -> mean weighted by the micro-batch item counts `sum_k n_k v_k / sum_k n_k`),
  plus batch-meta totals and the named `Reducer`s over the batch items. Tensor stats are read in one host
  transfer (none in the engine's step, which has read them already) and reduced in float64 on the host.
- `Reducer`: a named reduction (mean | sum | count_true) of one value per item, read from a dotted path
  into `item.meta` (a missing segment skips the item) or computed by a callable, optionally normalised
  by the number of samples or rollouts (a zero denominator leaves the value un-normalised, as Ludic).
- `group_log_stats`: the key grouping of the log lines (`train/`, `eval/`, `perf/`).
"""

from __future__ import annotations

import math
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


def _read_tensors(micro_stats_list: Sequence[Mapping[str, Any]]) -> list[dict[str, float]]:
    """The micro-batch stats as Python floats: every tensor value (one element) read in one host transfer, through
    float64 (exact for float32 / bf16 / fp16 values); nothing is read when none is a tensor (the engine's step has
    read them with its own values, `engine.step_parts.read_step_values`)."""
    out = [dict(stats) for stats in micro_stats_list]
    keys = [(i, k) for i, stats in enumerate(out) for k, v in stats.items() if isinstance(v, Tensor)]
    if keys:
        device = out[keys[0][0]][keys[0][1]].device
        values = torch.stack([out[i][k].detach().reshape(()).to(device=device, dtype=torch.float64)
                              for i, k in keys]).tolist()
        for (i, k), v in zip(keys, values):
            out[i][k] = v
    return out


def _reduce_micro_stats(
    micro_stats_list: Sequence[Mapping[str, Any]], micro_batch_sizes: Sequence[int] | None
) -> dict[str, float]:
    """Per key over the micro-batches holding it, in float64: `gpu_*` max, SUM_KEYS sum, else Σ w v / Σ w."""
    if micro_batch_sizes is not None and len(micro_batch_sizes) != len(micro_stats_list):
        raise ValueError(
            f"micro_batch_sizes has {len(micro_batch_sizes)} entries for {len(micro_stats_list)} micro-batches"
        )
    weights = [float(w) for w in micro_batch_sizes] if micro_batch_sizes is not None else [1.0] * len(micro_stats_list)
    stats_list = _read_tensors(micro_stats_list)
    keys: dict[str, None] = {}
    for stats in stats_list:
        keys.update(dict.fromkeys(stats))
    out: dict[str, float] = {}
    for key in keys:
        pairs = [(float(s[key]), w) for s, w in zip(stats_list, weights) if key in s]
        if key.startswith("gpu_"):
            values = [v for v, _ in pairs]
            out[key] = math.nan if any(math.isnan(v) for v in values) else max(values)  # NaN wins, as torch.max
        elif key in SUM_KEYS:
            out[key] = sum(v for v, _ in pairs)
        else:
            out[key] = sum(v * w for v, w in pairs) / max(sum(w for _, w in pairs), 1e-12)
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
    stats = _reduce_micro_stats(micro_stats_list, micro_batch_sizes)
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
