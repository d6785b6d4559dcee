"""OfflineBatchSource: seeded shuffling, epochs, rank sharding (DistributedSampler's rule), resume, chat SFT
items through a chat template, JSONL rollouts with credit."""

from __future__ import annotations

import asyncio
import json

import pytest
from _trainer_fixtures import TOKENIZER, make_items

from ludic_fast.data.credit import MonteCarloReturn
from ludic_fast.data.types import Rollout, Step, TokenTrace
from ludic_fast.rollout import OfflineBatchSource, chat_item


def _ids(batch):
    return [it.meta["rollout_id"] for it in batch.items]


def test_seeded_shuffle_epochs_and_resume():
    items = make_items(5, seed=0)
    a = OfflineBatchSource(items, batch_size=2, seed=3)
    served = [_ids(asyncio.run(a.next_batch())) for _ in range(6)]
    assert served == [_ids(asyncio.run(OfflineBatchSource(items, batch_size=2, seed=3).next_batch()))] + served[1:]
    first_epoch = sum(served[:3], [])
    assert sorted(first_epoch) == sorted(f"r{i}" for i in range(5))  # every item once per epoch
    assert sum(served[3:6], []) != first_epoch  # a new permutation each epoch
    b = OfflineBatchSource(items, batch_size=2, seed=3)
    asyncio.run(b.next_batch())
    c = OfflineBatchSource(items, batch_size=2, seed=3)
    c.load_state_dict(json.loads(json.dumps(b.state_dict())))
    assert [_ids(asyncio.run(c.next_batch())) for _ in range(5)] == served[1:]
    plain = OfflineBatchSource(items, batch_size=5, shuffle=False)
    assert _ids(asyncio.run(plain.next_batch())) == [f"r{i}" for i in range(5)]
    dropping = OfflineBatchSource(items, batch_size=2, shuffle=False, drop_last=True)
    assert [len(asyncio.run(dropping.next_batch()).items) for _ in range(3)] == [2, 2, 2]


def test_rank_sharding_is_disjoint_and_covers():
    items = make_items(7, seed=1)
    shards = [OfflineBatchSource(items, batch_size=10, seed=5, rank=r, world_size=3).epoch_indices(0) for r in range(3)]
    assert [len(s) for s in shards] == [3, 3, 3]  # padded by wrapping to a multiple of world_size
    assert set().union(*shards) == set(range(7))
    with pytest.raises(ValueError, match="rank"):
        OfflineBatchSource(items, rank=3, world_size=3)


def test_chat_items_mask_the_assistant_answer():
    item = chat_item(TOKENIZER, [{"role": "user", "content": "2+3="}, {"role": "assistant", "content": "5"}])
    assert item.input_ids == TOKENIZER("2+3=5")["input_ids"] + [TOKENIZER.eos_token_id]
    assert item.action_mask == [0, 0, 0, 0, 1, 1] and item.weight == 1.0
    with pytest.raises(ValueError, match="assistant"):
        chat_item(TOKENIZER, [{"role": "user", "content": "hi"}])
    src = OfflineBatchSource.from_chat([{"messages": [{"role": "user", "content": "1+1="},
                                                      {"role": "assistant", "content": "2"}], "tag": 1}], TOKENIZER)
    batch = asyncio.run(src.next_batch())
    assert batch.items[0].meta["tag"] == 1 and batch.meta["source"] == "offline"


def test_rollouts_jsonl_with_credit(tmp_path):
    trace = TokenTrace([5, 6], [7, 8], [-0.1, -0.2], "stop")
    r = Rollout(steps=[Step(0, "a", "b", None, 1.0, trace=trace), Step(1, "c", "d", None, 2.0, trace=trace)])
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(r.to_dict()) + "\n")
    src = OfflineBatchSource.from_rollouts_jsonl(path, MonteCarloReturn(), batch_size=4, shuffle=False)
    batch = asyncio.run(src.next_batch())
    assert [it.weight for it in batch.items] == [3.0, 2.0]
    assert batch.items[0].actor_logps.token_logps == [-0.1, -0.2]
