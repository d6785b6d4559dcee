"""Sample filters (per item, True = KEEP) and batch preprocess functions (SAWBatch -> SAWBatch).

Sample filters, as Ludic master's `training/filters.py`; a missing meta key means keep:
    keep_all, drop_truncated (meta['truncated']), drop_incomplete_completions
    (meta['finish_reason'] == 'length'), drop_parse_errors (meta['parse_error']),
    combine (AND), any_of (OR), apply_filter.
Preprocess functions, as Ludic master's `training/algorithm.py` (the trainer runs them on the whole
macro-batch before truncation and micro-batching):
    validate_actor_logps, drop_zero_weight_samples (keep |w| > eps), filter_zero_variance_groups
    (drop GRPO groups whose item weights have sample std ≤ eps), compose_preprocess (left to right),
    and drop_items (any sample filter as a preprocess; ours).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Iterable

from ludic_fast.data.types import Preprocess, SampleFilter, SAWBatch, SAWItem, group_id_of

logger = logging.getLogger(__name__)

UNGROUPED = "__ungrouped__"


# ------------------------------------------------------------------------------------- sample filters
def keep_all(item: SAWItem) -> bool:
    """Keep every item."""
    return True


def drop_truncated(item: SAWItem) -> bool:
    """Drop items whose meta['truncated'] is true."""
    return not item.meta.get("truncated", False)


def drop_incomplete_completions(item: SAWItem) -> bool:
    """Drop items whose completion stopped on the token limit (meta['finish_reason'] == 'length')."""
    return item.meta.get("finish_reason") != "length"


def drop_parse_errors(item: SAWItem) -> bool:
    """Drop items whose action failed to parse (meta['parse_error'] true)."""
    return not item.meta.get("parse_error", False)


def combine(*filters: SampleFilter) -> SampleFilter:
    """Keep an item only if every filter keeps it."""
    return lambda item: all(f(item) for f in filters)


def any_of(*filters: SampleFilter) -> SampleFilter:
    """Keep an item if any filter keeps it."""
    return lambda item: any(f(item) for f in filters)


def apply_filter(items: Iterable[SAWItem], sample_filter: SampleFilter | None) -> list[SAWItem]:
    """The items the filter keeps, in order (all of them when the filter is None)."""
    return list(items) if sample_filter is None else [i for i in items if sample_filter(i)]


# --------------------------------------------------------------------------------- preprocess functions
def drop_items(sample_filter: SampleFilter) -> Preprocess:
    """A preprocess that keeps only the items `sample_filter` keeps (in place; returns the batch)."""

    def _drop(saw_batch: SAWBatch) -> SAWBatch:
        saw_batch.items = apply_filter(saw_batch.items, sample_filter)
        return saw_batch

    return _drop


def validate_actor_logps(saw_batch: SAWBatch) -> SAWBatch:
    """Check every item carries behaviour logprobs, one float per action token; return the batch unchanged.

    A length mismatch raises ValueError at once, a non-float entry TypeError; items without logps are
    collected and reported together in one ValueError.
    """
    missing = []
    for idx, item in enumerate(saw_batch.items):
        logps = item.actor_logps
        if logps is None:
            missing.append(idx)
            continue
        expected = sum(map(int, item.action_mask))
        if len(logps.token_logps) != expected:
            raise ValueError(
                f"ActorTokenLogps length mismatch for item {idx}: {len(logps.token_logps)} logps for "
                f"{expected} action tokens (rollout_id={item.meta.get('rollout_id')})"
            )
        if any(issubclass(t, bool) or not issubclass(t, (int, float)) for t in set(map(type, logps.token_logps))):
            raise TypeError(f"ActorTokenLogps.token_logps of item {idx} must be a List[float]")
    if missing:
        raise ValueError(
            "Missing SampleAttachments.actor_logps: token-level ratio losses need behaviour logprobs for every "
            f"item (return_chosen_logprobs=True in the rollout engine). Missing indices: {missing}"
        )
    return saw_batch


def drop_zero_weight_samples(saw_batch: SAWBatch, *, eps: float = 1e-4) -> SAWBatch:
    """Keep items with |weight| > eps (in place; returns the batch)."""
    if eps < 0:
        raise ValueError("eps must be >= 0.")
    saw_batch.items = [i for i in saw_batch.items if abs(i.weight) > eps]
    return saw_batch


def filter_zero_variance_groups(saw_batch: SAWBatch, *, eps: float = 1e-6) -> SAWBatch:
    """Drop every GRPO group whose item weights have sample std (n−1) ≤ eps (in place; returns the batch).

    Items without a group id, and groups of one item, are kept. Kept items are regrouped by group in order
    of first appearance. Sets `meta['zvp_filter_frac']` = dropped groups / groups and logs it.
    """
    if eps < 0:
        raise ValueError("eps must be >= 0.")
    if not saw_batch.items:
        return saw_batch
    buckets: dict[str, list[SAWItem]] = {}
    for item in saw_batch.items:
        buckets.setdefault(group_id_of(item.meta) or UNGROUPED, []).append(item)
    kept: list[SAWItem] = []
    total = dropped = 0
    for gid, members in buckets.items():
        if gid != UNGROUPED:
            total += 1
            if len(members) >= 2 and statistics.stdev(i.weight for i in members) <= eps:
                dropped += 1
                continue
        kept.extend(members)
    saw_batch.items = kept
    if total:
        saw_batch.meta["zvp_filter_frac"] = dropped / total
        logger.info("filter_zero_variance_groups dropped %d of %d groups (%.3f)", dropped, total, dropped / total)
    return saw_batch


def compose_preprocess(*fns: Preprocess) -> Preprocess:
    """Apply the preprocess functions left to right."""

    def _composed(saw_batch: SAWBatch) -> SAWBatch:
        for fn in fns:
            saw_batch = fn(saw_batch)
        return saw_batch

    return _composed


__all__ = [
    "keep_all",
    "drop_truncated",
    "drop_incomplete_completions",
    "drop_parse_errors",
    "combine",
    "any_of",
    "apply_filter",
    "drop_items",
    "validate_actor_logps",
    "drop_zero_weight_samples",
    "filter_zero_variance_groups",
    "compose_preprocess",
]
