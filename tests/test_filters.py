"""Sample filters (Ludic's truth tables) and preprocess functions (Ludic's cases, hand-derived checks)."""

from __future__ import annotations

import logging

import pytest

from ludic_fast.data.filters import (
    any_of,
    apply_filter,
    combine,
    compose_preprocess,
    drop_incomplete_completions,
    drop_items,
    drop_parse_errors,
    drop_truncated,
    drop_zero_weight_samples,
    filter_zero_variance_groups,
    keep_all,
    validate_actor_logps,
)
from ludic_fast.data.types import ActorTokenLogps, SampleAttachments, SAWBatch, SAWItem


def _item(meta=None, weight=1.0, logps=None, action_mask=(0, 1, 1)):
    return SAWItem(
        input_ids=[1, 2, 3],
        attention_mask=[1, 1, 1],
        action_mask=list(action_mask),
        weight=weight,
        meta=meta or {},
        attachments=SampleAttachments(None if logps is None else ActorTokenLogps(logps)),
    )


# ------------------------------------------------------------------------------------ sample filters
@pytest.mark.parametrize(
    "fn, meta, keep",
    [
        (keep_all, {"truncated": True}, True),
        (drop_truncated, {}, True),
        (drop_truncated, {"truncated": False}, True),
        (drop_truncated, {"truncated": True}, False),
        (drop_incomplete_completions, {}, True),
        (drop_incomplete_completions, {"finish_reason": "stop"}, True),
        (drop_incomplete_completions, {"finish_reason": "length"}, False),
        (drop_parse_errors, {}, True),
        (drop_parse_errors, {"parse_error": False}, True),
        (drop_parse_errors, {"parse_error": True}, False),
    ],
)
def test_filter_truth_tables(fn, meta, keep):
    assert fn(_item(meta)) is keep


def test_combine_any_of_apply():
    trunc, parse, both = _item({"truncated": True}), _item({"parse_error": True}), _item({})
    both_bad = _item({"truncated": True, "parse_error": True})
    f_and = combine(drop_truncated, drop_parse_errors)
    f_or = any_of(drop_truncated, drop_parse_errors)
    assert [f_and(i) for i in (trunc, parse, both, both_bad)] == [False, False, True, False]
    assert [f_or(i) for i in (trunc, parse, both, both_bad)] == [True, True, True, False]
    assert apply_filter([trunc, both], drop_truncated) == [both]
    assert apply_filter([trunc, both], None) == [trunc, both]


# ---------------------------------------------------------------------------------- validate logps
def test_validate_actor_logps_missing():
    batch = SAWBatch([_item(logps=[-1.0, -2.0]), _item(), _item({"rollout_id": "r", "policy_version": 3})])
    with pytest.raises(ValueError, match=r"Missing SampleAttachments.actor_logps.*Missing indices: \[1, 2\]"):
        validate_actor_logps(batch)


def test_validate_actor_logps_length_mismatch_and_types():
    with pytest.raises(ValueError, match="length mismatch"):
        validate_actor_logps(SAWBatch([_item(logps=[-1.0])]))
    bad = ActorTokenLogps([-1.0, -2.0])
    object.__setattr__(bad, "token_logps", [-1.0, "x"])
    item = _item()
    item.attachments = SampleAttachments(bad)
    with pytest.raises(TypeError, match="must be a List\\[float\\]"):
        validate_actor_logps(SAWBatch([item]))
    ok = SAWBatch([_item(logps=[-1.0, -2.0])])
    assert validate_actor_logps(ok) is ok


# --------------------------------------------------------------------------------- drop zero weight
def test_drop_zero_weight_samples():
    batch = SAWBatch([_item(weight=0.0), _item(weight=2.0), _item(weight=1e-4), _item(weight=-1e-3)])
    out = drop_zero_weight_samples(batch)
    assert out is batch and [i.weight for i in out.items] == [2.0, -1e-3]
    with pytest.raises(ValueError, match="eps must be >= 0"):
        drop_zero_weight_samples(batch, eps=-1)


# ---------------------------------------------------------------------------------------- ZVP filter
def _g(gid, weight):
    return _item({"request_meta": {"group_id": gid}}, weight=weight)


def test_filter_zero_variance_groups_hand_derived(caplog):
    # hand-derived: HybridNormalizedReturn weights for A={1,0}, B={1,1}: A = ±1.414214, B = 0, 0
    items = [_g("A", 1.414214), _g("B", 0.0), _g("A", -1.414214), _g("B", 0.0), _item({}, weight=0.0)]
    batch = SAWBatch(items)
    with caplog.at_level(logging.INFO, logger="ludic_fast.data.filters"):
        out = filter_zero_variance_groups(batch)
    # group A regrouped first, B dropped, the ungrouped item kept last
    assert out.items == [items[0], items[2], items[4]]
    assert out.meta["zvp_filter_frac"] == 0.5
    assert "dropped 1 of 2 groups (0.500)" in caplog.text


def test_filter_zero_variance_groups_edges():
    single = SAWBatch([_g("A", 0.0)])
    assert filter_zero_variance_groups(single).items == single.items  # a 1-item group is kept
    assert single.meta["zvp_filter_frac"] == 0.0
    empty = SAWBatch([])
    assert filter_zero_variance_groups(empty).meta == {}
    ungrouped = SAWBatch([_item({}, 0.0), _item({}, 0.0)])
    assert len(filter_zero_variance_groups(ungrouped).items) == 2 and "zvp_filter_frac" not in ungrouped.meta
    # sample std of (0, 2e-6) is 1.41e-6 > 1e-6: kept; with eps = 2e-6 dropped
    near = [_g("A", 0.0), _g("A", 2e-6)]
    assert len(filter_zero_variance_groups(SAWBatch(list(near))).items) == 2
    assert filter_zero_variance_groups(SAWBatch(list(near)), eps=2e-6).items == []
    with pytest.raises(ValueError, match="eps must be >= 0"):
        filter_zero_variance_groups(single, eps=-1.0)


def test_compose_preprocess_preserves_order():
    calls = []

    def tag(name):
        def fn(batch):
            calls.append(name)
            batch.meta.setdefault("order", []).append(name)
            return batch

        return fn

    out = compose_preprocess(tag("a"), tag("b"), tag("c"))(SAWBatch([]))
    assert calls == ["a", "b", "c"] and out.meta["order"] == ["a", "b", "c"]


def test_drop_items_turns_a_sample_filter_into_a_preprocess():
    keep, trunc = _item({}), _item({"truncated": True})
    batch = SAWBatch([trunc, keep])
    assert drop_items(drop_truncated)(batch) is batch and batch.items == [keep]
