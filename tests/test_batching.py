"""Micro-batching and collation: Ludic's test cases, packed layout, property tests."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ludic_fast import losses, reference
from ludic_fast.data.batching import (
    GRPORequestStrategy,
    MacroTotals,
    PaddingReport,
    collate_micro_batches,
    collate_packed,
    collate_saw_items,
    padding_waste,
    saw_item_from_step,
    split_items_by_token_budget,
)
from ludic_fast.data.credit import ZVPGroupNormalizedReturn
from ludic_fast.data.types import (
    ActorTokenLogps,
    EnvSpec,
    ProtocolSpec,
    Rollout,
    RolloutRequest,
    SampleAttachments,
    SAWItem,
    Step,
    TokenTrace,
)
from ludic_fast.losses.preference.common import group_starts
from ludic_fast.token_batch import ACTION_ROWS, TokenBatch


def _item(ids, action_mask=None, logps=None, weight=1.0, meta=None):
    action_mask = action_mask if action_mask is not None else [0] + [1] * (len(ids) - 1)
    return SAWItem(
        input_ids=list(ids),
        attention_mask=[1] * len(ids),
        action_mask=list(action_mask),
        weight=weight,
        meta=meta or {},
        attachments=SampleAttachments(None if logps is None else ActorTokenLogps(logps)),
    )


def _of_len(n, tag=0):
    return _item([tag + 1] * n, meta={"tag": tag})


# ------------------------------------------------------------------------------ Ludic's cases
def test_split_lengths_2555_budget_10():
    chunks = split_items_by_token_budget(
        [_of_len(5, 0), _of_len(2, 1), _of_len(5, 2), _of_len(5, 3)], micro_token_budget=10, max_seq_len=5
    )
    assert [[len(i) for i in c] for c in chunks] == [[2, 5], [5, 5]]
    assert all(max(len(i) for i in c) * len(c) <= 10 for c in chunks)
    # stable sort: equal lengths keep their input order
    assert [i.meta["tag"] for c in chunks for i in c] == [1, 0, 2, 3]


def test_split_lengths_35_budget_8():
    assert len(split_items_by_token_budget([_of_len(3), _of_len(5)], micro_token_budget=8, max_seq_len=5)) == 2


def test_truncation_metadata_and_logps():
    item = _item([1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 1, 1], [-0.1, -0.2, -0.3], meta={"completion_length": 3})
    chunks = split_items_by_token_budget([item], micro_token_budget=12, max_seq_len=5)
    assert len(chunks) == 1 and len(chunks[0]) == 1
    t = chunks[0][0]
    assert t.input_ids == [1, 2, 3, 4, 5] and t.action_mask == [0, 0, 0, 1, 1]
    assert t.meta["seq_len_truncated"] is True
    assert (t.meta["seq_len_original"], t.meta["seq_len_retained"]) == (6, 5)
    assert t.meta["seq_len_retained_frac"] == pytest.approx(5 / 6)
    assert t.meta["truncated"] is True and t.meta["truncation_reason"] == "max_seq_len"
    assert t.meta["completion_length"] == 2 and "prompt_length" not in t.meta
    assert t.actor_logps.token_logps == [-0.1, -0.2]
    assert item.input_ids == [1, 2, 3, 4, 5, 6]  # the input item is not modified


def test_truncation_keeps_existing_reason():
    item = _item([1] * 6, meta={"truncation_reason": "max_steps", "prompt_length": 1})
    (t,) = split_items_by_token_budget([item], micro_token_budget=5, max_seq_len=5)[0]
    assert t.meta["truncation_reason"] == "max_steps" and t.meta["prompt_length"] == 1


@pytest.mark.parametrize(
    "budget, max_len, match",
    [(3, 4, "micro_token_budget \\(3\\) must be >= max_seq_len \\(4\\)"), (0, 4, "micro_token_budget"),
     (4, 0, "max_seq_len")],
)
def test_split_errors(budget, max_len, match):
    with pytest.raises(ValueError, match=match):
        split_items_by_token_budget([_of_len(2)], micro_token_budget=budget, max_seq_len=max_len)
    with pytest.raises(ValueError, match="layout"):
        split_items_by_token_budget([_of_len(2)], micro_token_budget=8, max_seq_len=4, layout="ragged")


def test_split_empty():
    assert split_items_by_token_budget([], micro_token_budget=3, max_seq_len=4) == []


def test_collate_padded_ludic_case():
    out = collate_saw_items([_item([1, 2, 3], [0, 1, 1]), _item([4, 5], [0, 1])], pad_token_id=0, device="cpu")
    assert out["input_ids"].tolist() == [[1, 2, 3], [4, 5, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert out["action_mask"].tolist() == [[0, 1, 1], [0, 1, 0]]
    assert out["input_ids"].dtype == torch.long and out["action_mask"].dtype == torch.float32
    assert out["weight"].dtype == torch.float32
    assert "actor_logps" not in out and "old_logp_action" not in out and "group_id" not in out


def test_collate_actor_logps_and_old_logp_action():
    items = [_item([1, 2, 3], [0, 1, 1], [-1.0, -2.0]), _item([4, 5, 6], [0, 1, 1], [-1.0, -2.0])]
    out = collate_saw_items(items, pad_token_id=0)
    assert out["old_logp_action"].tolist() == [-3.0, -3.0]
    assert out["actor_logps"].tolist() == [[0, -1, -2], [0, -1, -2]]


def test_collate_errors():
    with pytest.raises(ValueError, match="Mixed presence"):
        collate_saw_items([_item([1, 2], [0, 1], [-1.0]), _item([1, 2], [0, 1])], pad_token_id=0)
    with pytest.raises(ValueError, match="Length mismatch"):
        collate_saw_items([_item([1, 2, 3], [0, 1, 1], [-1.0])], pad_token_id=0)
    with pytest.raises(ValueError, match="at least one item"):
        collate_saw_items([], pad_token_id=0)
    with pytest.raises(ValueError, match="zvp_direction must be"):
        collate_saw_items([_item([1, 2], meta={"zvp_direction": 2})], pad_token_id=0)


def test_collate_micro_batches_ludic_case():
    mbs = collate_micro_batches(
        [_of_len(4, t) for t in range(3)], pad_token_id=0, device="cpu", micro_token_budget=8, max_seq_len=4
    )
    assert [mb.num_items for mb in mbs] == [2, 1]
    assert [tuple(mb.tensors["input_ids"].shape) for mb in mbs] == [(2, 4), (1, 4)]
    assert collate_micro_batches([], pad_token_id=0, micro_token_budget=8, max_seq_len=4) == []


# ---------------------------------------------------------------------------- group ids and ZVP
def test_group_ids_are_ints_numbered_over_the_whole_macro_batch():
    items = [
        _item([1, 2], meta={"request_meta": {"group_id": "g-a"}}),
        _item([1, 2, 3, 4], meta={"request_meta": {"group_id": "g-b"}}),
        _item([1, 2, 3, 4], meta={"request_meta": {"group_id": "g-a"}}),
        _item([1, 2], meta={}),
    ]
    mbs = collate_micro_batches(items, pad_token_id=0, micro_token_budget=4, max_seq_len=4)
    ids = [mb.tensors["group_id"].tolist() for mb in mbs]
    # sorted chunks: [len2 a, len2 ungrouped], [len4 b], [len4 a]; a=0, b=1, the ungrouped item gets 2
    assert ids == [[0, 2], [1], [0]]
    assert mbs[0].tensors["group_id"].dtype == torch.long


def test_zvp_direction_reaches_the_batch():
    rollouts = [
        Rollout(
            steps=[Step(0, "q", "a", None, reward, trace=TokenTrace([5, 6], [7, 8], [-0.5, -0.25]))],
            meta={"request_meta": {"group_id": gid}, "group_id": gid},
        )
        for gid, reward in [("P", 1.0), ("P", 1.0), ("M", 1.0), ("M", 0.0)]
    ]
    credit = ZVPGroupNormalizedReturn(group_size=2).compute(rollouts)
    items = [saw_item_from_step(r, r.steps[0], credit[(r.id, 0)]) for r in rollouts]
    assert [i.meta["zvp_direction"] for i in items] == [1, 1, 0, 0]
    assert items[0].input_ids == [5, 6, 7, 8] and items[0].action_mask == [0, 0, 1, 1]
    for batch in (collate_saw_items(items, pad_token_id=0), collate_packed(items)):
        assert batch["zvp_direction"].tolist() == [1, 1, 0, 0]
        assert batch["weight"].tolist() == pytest.approx([0.0, 0.0, 1.0, -1.0])
        assert batch["group_id"].tolist() == [0, 0, 1, 1]


def test_saw_item_from_step_rules():
    trace = TokenTrace([10, 11], [12, 13, 14], None, "stop")
    step = Step(0, "obs", "act", None, 1.0, info={"parse_error": False, "completion_token_ids": [1]}, trace=trace)
    rollout = Rollout(steps=[step], meta={"policy_version": 3, "reward": "overridden"})
    item = saw_item_from_step(rollout, step, 1.23)
    assert item.input_ids == [10, 11, 12, 13, 14] and item.action_mask == [0, 0, 1, 1, 1]
    assert item.weight == 1.23 and item.meta["policy_version"] == 3 and item.meta["reward"] == "overridden"
    assert item.meta["completion_length"] == 3 and "completion_token_ids" not in item.meta
    rollout.meta["engine"] = {"return_spec": {"return_chosen_logprobs": True}}
    with pytest.raises(ValueError, match="return_chosen_logprobs=True"):
        saw_item_from_step(rollout, step, 1.0)
    with pytest.raises(ValueError, match="has no trace"):
        saw_item_from_step(rollout, Step(1, None, None, None, 0.0), 1.0)


# ------------------------------------------------------------------------------------ packed layout
def test_collate_packed_layout():
    items = [_item([1, 2, 3], [0, 1, 1], [-1.0, -2.0], weight=2.0), _item([4, 5], [0, 1], [-0.5], weight=-1.0)]
    out = collate_packed(items)
    assert out["input_ids"].tolist() == [[1, 2, 3, 4, 5]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert out["cu_seqlens"].tolist() == [0, 3, 5] and out["cu_seqlens"].dtype == torch.int32
    assert out["action_mask"].tolist() == [[0, 1, 1, 0, 1]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1, 1]]
    assert out["actor_logps"].tolist() == [[0, -1, -2, 0, -0.5]]
    assert out["old_logp_action"].tolist() == [-3.0, -0.5]
    assert out["weight"].tolist() == [2.0, -1.0]


def test_padding_reports():
    items = [_of_len(2), _of_len(4), _of_len(4), _of_len(3)]
    padded = collate_micro_batches(items, pad_token_id=0, micro_token_budget=8, max_seq_len=4)
    # chunks [2, 3] (cost 6) and [4, 4] (cost 8): real 13 of 14 allocated
    assert padding_waste(padded) == PaddingReport(13, 14)
    assert padding_waste(padded).waste_frac == pytest.approx(1 / 14)
    packed = collate_micro_batches(items, pad_token_id=0, micro_token_budget=8, max_seq_len=4, layout="packed")
    # packed chunks [2, 3] (5) and [4, 4] (8)
    assert [mb.num_items for mb in packed] == [2, 2]
    assert padding_waste(packed) == PaddingReport(13, 13) and padding_waste(packed).waste_frac == 0.0
    assert PaddingReport().waste_frac == 0.0


# --------------------------------------------------------------------------------- request strategy
def test_grpo_request_strategy():
    base = RolloutRequest(EnvSpec("e"), ProtocolSpec("p"), env_seed=None, sampling_seed=10, num_episodes=5,
                          meta={"prompt_id": 1})
    fixed = RolloutRequest(EnvSpec("e"), ProtocolSpec("p"), env_seed=7)
    out = GRPORequestStrategy(group_size=3, seed=0).expand([base, fixed])
    assert len(out) == 6
    first, second = out[:3], out[3:]
    assert len({r.env_seed for r in first}) == 1 and {r.env_seed for r in second} == {7}
    assert [r.sampling_seed for r in first] == [10, 11, 12]
    assert len({r.sampling_seed for r in second}) == 3
    assert {r.num_episodes for r in out} == {1}
    gids = [r.meta["group_id"] for r in out]
    assert len(set(gids[:3])) == 1 and len(set(gids[3:])) == 1 and gids[0] != gids[3]
    assert first[0].meta["prompt_id"] == 1 and "group_id" not in base.meta
    with pytest.raises(ValueError, match="group_size must be positive"):
        GRPORequestStrategy(group_size=0)


# ------------------------------------------------------------------------------------ properties
@st.composite
def _items_and_budget(draw):
    lengths = draw(st.lists(st.integers(1, 12), min_size=1, max_size=24))
    max_seq_len = draw(st.integers(1, 12))
    budget = draw(st.integers(max_seq_len, 40))
    items = [_item([t + 1] * n, meta={"uid": t}) for t, n in enumerate(lengths)]
    return items, max_seq_len, budget


@settings(max_examples=60, deadline=None)
@given(_items_and_budget(), st.sampled_from(["padded", "packed"]))
def test_packing_respects_budget_and_keeps_every_item_once(case, layout):
    items, max_seq_len, budget = case
    chunks = split_items_by_token_budget(items, micro_token_budget=budget, max_seq_len=max_seq_len, layout=layout)
    for chunk in chunks:
        lengths = [len(i) for i in chunk]
        assert chunk and max(lengths) <= max_seq_len
        assert (max(lengths) * len(chunk) if layout == "padded" else sum(lengths)) <= budget
    uids = sorted(i.meta["uid"] for c in chunks for i in c)
    assert uids == list(range(len(items)))
    flat = [len(i) for c in chunks for i in c]
    assert flat == sorted(min(len(i), max_seq_len) for i in items)


class _TinyLM(torch.nn.Module):
    """Token + position embeddings, a per-token MLP and a head: packing-safe, position-aware."""

    def __init__(self, vocab=11, dim=8, max_pos=16):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(max_pos, dim)
        self.mlp = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def hidden(self, input_ids, position_ids):
        return torch.tanh(self.mlp(self.tok(input_ids) + self.pos(position_ids)))

    def forward(self, input_ids, position_ids):
        return self.head(self.hidden(input_ids, position_ids))


def _packed_cispo(logits, batch, clip_eps_low=1e6, clip_eps_high=0.2):
    """CISPO (length-normalised) straight from the packed row: the shift never crosses a boundary."""
    ids, pos = batch["input_ids"][0], batch["position_ids"][0]
    logp = torch.log_softmax(logits[0, :-1].float(), -1).gather(-1, ids[1:, None]).squeeze(-1)
    mask = batch["action_mask"][0, 1:] * (pos[1:] != 0)
    seg = torch.searchsorted(batch["cu_seqlens"][1:].long(), torch.arange(1, ids.numel()), right=True)
    ratio = torch.exp(logp - batch["actor_logps"][0, 1:]).detach()
    w = torch.clamp(ratio, 1 - clip_eps_low, 1 + clip_eps_high)
    n_seq = batch["weight"].numel()
    per_seq = torch.zeros(n_seq).index_add(0, seg, w * batch["weight"][seg] * logp * mask)
    counts = torch.zeros(n_seq).index_add(0, seg, mask).clamp(min=1.0)
    return -(per_seq / counts).mean()


@st.composite
def _rl_items(draw):
    n = draw(st.integers(1, 5))
    items = []
    for _ in range(n):
        length = draw(st.integers(2, 9))
        prompt = draw(st.integers(1, length - 1))
        ids = draw(st.lists(st.integers(0, 10), min_size=length, max_size=length))
        mask = [0] * prompt + [1] * (length - prompt)
        logps = draw(st.lists(st.floats(-4.0, -0.05), min_size=length - prompt, max_size=length - prompt))
        weight = draw(st.floats(-2.0, 2.0))
        meta = {"request_meta": {"group_id": draw(st.sampled_from(["g0", "g1", "g2"]))}}
        items.append(_item(ids, mask, logps, weight=weight, meta=meta))
    return items


def _grads(loss, model):
    return torch.autograd.grad(loss, list(model.parameters()), allow_unused=True, materialize_grads=True)


@settings(max_examples=25, deadline=None)
@given(_rl_items(), st.integers(0, 2**16))
def test_packed_and_padded_collation_give_the_same_loss(items, seed):
    """Padded: reference.CISPOLoss on logits; packed: ludic_fast.losses on hidden states (fused head) and a
    CISPO written here on the packed row. Same loss and model gradients; ScaleRLLoss (group_id) too."""
    torch.manual_seed(seed)
    model = _TinyLM()
    padded = collate_saw_items(items, pad_token_id=0)
    positions = torch.arange(padded["input_ids"].shape[1]).expand_as(padded["input_ids"])
    ref_loss, _ = reference.CISPOLoss()(padded, logits=model(padded["input_ids"], positions))
    ref_grads = _grads(ref_loss, model)

    packed = collate_packed(items)
    packed_ids, packed_pos = packed["input_ids"], packed["position_ids"]
    candidates = {
        "here": _packed_cispo(model(packed_ids, packed_pos), packed),
        "fused": losses.CISPOLoss()(packed, hidden=model.hidden(packed_ids, packed_pos), weight=model.head.weight)[0],
    }
    for name, loss in candidates.items():
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
        for g, rg in zip(_grads(loss, model), ref_grads, strict=True):
            torch.testing.assert_close(g, rg, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")

    scalerl = losses.ScaleRLLoss()
    assert "group_id" in padded and "group_id" in packed
    torch.testing.assert_close(
        scalerl(packed, hidden=model.hidden(packed_ids, packed_pos), weight=model.head.weight)[0],
        scalerl(padded, hidden=model.hidden(padded["input_ids"], positions), weight=model.head.weight)[0],
        rtol=1e-5,
        atol=1e-6,
    )


def test_packed_rule_counts_real_tokens():
    items = [_of_len(1), _of_len(1), _of_len(1), _of_len(1), _of_len(8)]
    padded = split_items_by_token_budget(items, micro_token_budget=12, max_seq_len=8)
    packed = split_items_by_token_budget(items, micro_token_budget=12, max_seq_len=8, layout="packed")
    assert [len(c) for c in padded] == [4, 1]  # 8 * 5 = 40 > 12
    assert [len(c) for c in packed] == [5]  # 1 + 1 + 1 + 1 + 8 = 12


def test_macro_totals_by_hand():
    """A, B in group g (2 and 3 scored tokens), C ungrouped (1: position 0 is never scored): N = 3, Σ M = 6,
    prompts {g, C}."""
    a = _item([5, 6, 7], [0, 1, 1], meta={"group_id": "g"})
    b = _item([5, 6, 7, 8, 9], [0, 0, 1, 1, 1], meta={"group_id": "g"})
    c = _item([5, 6], [1, 1])
    macro = MacroTotals.of([a, b, c])
    assert (macro.n_items, macro.tokens, macro.prompts, macro.ranks) == (3, 6.0, 2, 1)
    assert dict(macro.prompt_tokens) == {"g": 5.0}
    batch = collate_saw_items([c, a], pad_token_id=0, macro=macro)
    assert batch["macro_prompt_tokens"].tolist() == [1.0, 5.0]
    assert float(batch["macro_tokens_per_seq"]) == 2.0
    assert float(batch["macro_prompts_per_seq"]) == pytest.approx(2 / 3) and batch["macro_prompts_per_seq"].ndim == 0
    packed = collate_packed([c, a], macro=macro)
    assert packed["macro_prompt_tokens"].tolist() == [1.0, 5.0]
    with pytest.raises(ValueError, match="at least one item"):
        MacroTotals.of([])


def test_collate_micro_batches_carries_the_totals_of_all_items():
    items = [_item([1] * n, meta={"group_id": f"g{n % 2}"}) for n in (2, 3, 4, 5)]  # n - 1 scored tokens each
    mbs = collate_micro_batches(items, pad_token_id=0, micro_token_budget=6, max_seq_len=5)
    assert len(mbs) > 1
    for mb in mbs:
        assert float(mb.tensors["macro_tokens_per_seq"]) == pytest.approx(10 / 4)
        sizes = {"g0": 1 + 3, "g1": 2 + 4}
        lengths = mb.tensors["attention_mask"].sum(-1).tolist()
        assert mb.tensors["macro_prompt_tokens"].tolist() == [float(sizes[f"g{n % 2}"]) for n in lengths]


@pytest.mark.parametrize("collate", [collate_packed, lambda items: collate_saw_items(items, pad_token_id=0)])
def test_a_mask_changed_after_the_item_was_made_is_refused(collate):
    """SAWItem checks its masks' lengths when made; collation reads the lists in one pass and refuses lists
    whose lengths no longer add up, instead of cutting or shifting them silently."""
    item = _item([1, 2, 3], [0, 1, 1])
    item.action_mask.append(1)
    with pytest.raises(ValueError, match="length differs from input_ids"):
        collate([_item([4, 5], [0, 1]), item])


@st.composite
def _masked_items(draw):
    """1-6 items of 2-9 tokens with any action mask (some without an action token, some with one at 0)."""
    items = []
    for _ in range(draw(st.integers(1, 6))):
        length = draw(st.integers(2, 9))
        mask = draw(st.lists(st.integers(0, 1), min_size=length, max_size=length))
        items.append(_item(list(range(1, length + 1)), mask, [-1.0] * sum(mask)))
    return items


@settings(max_examples=60, deadline=None)
@given(_masked_items(), st.sampled_from(["padded", "packed"]))
def test_collation_knows_where_each_sequence_starts_among_the_action_tokens(items, layout):
    """TokenBatch.sequence_starts of a collated batch (computed on the host) is where its device index's
    sequence id changes; a batch without its collation's rows, or changed since, knows none."""
    batch = collate_saw_items(items, pad_token_id=0) if layout == "padded" else collate_packed(items)
    tb = TokenBatch.from_batch(batch)
    assert tb.sequence_starts() == group_starts(tb.seq)
    assert TokenBatch.from_batch({k: v for k, v in batch.items() if k != ACTION_ROWS}).sequence_starts() is None
    assert tb.subset(slice(0, tb.n)).sequence_starts() is None
    batch["action_mask"].add_(0)  # an in-place change: the host's rows no longer hold
    assert TokenBatch.from_batch(batch).sequence_starts() is None


def test_gspo_on_a_collated_batch_runs_one_pass_over_whole_sequences():
    """The trainer's collation to GSPO's fused head: 4 sequences of 9 action tokens each (36 in all) in chunks
    of 16 rows hold whole sequences (one each: 9 + 9 > 16) and take one pass, 6NDV, as a FLOP counter sees it."""
    from torch.utils.flop_counter import FlopCounterMode

    items = [_item(list(range(1, 11)), [0] + [1] * 9, [-1.0 - 0.1 * k] * 9, weight=1.0 - k) for k in range(4)]
    batch = collate_packed(items)
    g = torch.Generator().manual_seed(0)
    D, V = 8, 37
    hidden = torch.randn(1, batch["input_ids"].shape[1], D, generator=g, requires_grad=True)
    weight = torch.randn(V, D, generator=g, requires_grad=True)
    with FlopCounterMode(display=False) as fc:
        loss, _ = losses.ClippedSurrogateLoss(0.1, 0.1)(batch, hidden=hidden, weight=weight, chunk_elements=16 * V)
        loss.backward()
    assert fc.get_total_flops() == 6 * 36 * D * V
