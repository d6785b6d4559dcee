"""Pipeline RL over a real redis-server: codec, at-least-once delivery, de-duplication, staleness, weight
publishing, and an actor process + learner process run across a Redis restart (SIGKILL, AOF replay)."""

from __future__ import annotations

import ast
import asyncio
import json
import logging
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

redis = pytest.importorskip("redis", reason="needs the redis Python client")
pytest.importorskip("msgpack", reason="needs msgpack")

import _forked as forked  # noqa: E402
from _pipeline_examples import EXAMPLES, actor_and_learner_mains  # noqa: E402
from _redis import needs_server  # noqa: E402

from ludic_fast.data.types import ActorTokenLogps, SampleAttachments, SAWItem  # noqa: E402
from ludic_fast.distributed.pipeline import (  # noqa: E402
    MalformedPayloadError,
    PipelineBatchSource,
    PipelineKeys,
    PipelineProducer,
    StopRequested,
    decode_item,
    encode_item,
    run_pipeline_actor,
)
from ludic_fast.distributed.publish import RedisWeightPublisher, RedisWeightSubscriber, load_into  # noqa: E402
from ludic_fast.distributed.redis_conn import ReconnectingRedis, RedisUnreachableError  # noqa: E402
from ludic_fast.run.checkpoint import CheckpointConfig, CheckpointManager  # noqa: E402

# a regression in delivery shows up as a learner waiting forever for items: fail instead of hanging
pytestmark = pytest.mark.timeout(180)


def _item(i: int, n_tokens: int = 6) -> SAWItem:
    ids = [(7 * i + 3 * k) % 11 for k in range(n_tokens)]
    action = [0, 0] + [1] * (n_tokens - 2)
    logps = [-1.0 - 0.1 * k for k in range(n_tokens - 2)]
    return SAWItem(ids, [1] * n_tokens, action, weight=float(i % 3) - 1.0, meta={"total_reward": float(i)},
                   attachments=SampleAttachments(ActorTokenLogps(logps)))


# ------------------------------------------------------------------------------------------- codec
def test_codec_roundtrip_and_malformed_payloads():
    item = _item(4)
    back = decode_item(encode_item(item, item_id="a:1", policy_version=3))
    assert back.input_ids == item.input_ids and back.action_mask == item.action_mask
    assert back.actor_logps.token_logps == pytest.approx(item.actor_logps.token_logps)
    assert back.meta == {"total_reward": 4.0, "item_id": "a:1", "policy_version": 3}
    import msgpack

    good = msgpack.unpackb(encode_item(item, item_id="a:1", policy_version=3))
    bad_payloads = [
        b"\xc1 not msgpack",
        None,
        msgpack.packb([1, 2, 3]),
        msgpack.packb({**good, "format": 99}),
        msgpack.packb({**good, "id": ""}),
        msgpack.packb({**good, "policy_version": -1}),
        msgpack.packb({**good, "item": {**good["item"], "action_mask": [1]}}),
        msgpack.packb({**good, "item": {**good["item"], "weight": "x"}}),
        msgpack.packb({k: v for k, v in good.items() if k != "item"}),
    ]
    for payload in bad_payloads:
        with pytest.raises(MalformedPayloadError):
            decode_item(payload)
    with pytest.raises(ValueError, match="policy_version"):
        encode_item(item, item_id="x", policy_version=-2)
    with pytest.raises(ValueError, match="item_id"):
        encode_item(item, item_id="", policy_version=0)


# ------------------------------------------------------------------------ never reached vs lost later
def _closed_port_url() -> str:
    with socket.socket() as s:  # bound, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return f"redis://:secret@127.0.0.1:{s.getsockname()[1]}/0"


def test_a_server_never_reached_fails_at_once():
    """Nothing to wait for: each side raises RedisUnreachableError at its first command, not after its
    retry_timeout_s (60 s here), and the message hides the password."""
    url = _closed_port_url()
    t0 = time.monotonic()
    with pytest.raises(RedisUnreachableError, match=r"cannot reach Redis at redis://:\*\*\*@127\.0\.0\.1:") as exc:
        PipelineBatchSource(url, retry_timeout_s=60)
    assert "secret" not in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(RedisUnreachableError):
        PipelineProducer(url, max_queued=None, retry_timeout_s=60).push(_item(0), 0)
    with pytest.raises(RedisUnreachableError):
        RedisWeightPublisher(url, retry_timeout_s=60).publish({"w": torch.zeros(2)}, version=0)
    with pytest.raises(RedisUnreachableError):
        RedisWeightSubscriber(url, lambda state, version: None, retry_timeout_s=60).poll()
    assert time.monotonic() - t0 < 30  # not the 60 s retry wait (with room for a loaded machine)


@needs_server
def test_a_server_lost_after_it_was_reached_is_waited_for(redis_server):
    conn = ReconnectingRedis(redis_server.url, retry_timeout_s=0.5)
    conn.ping()
    redis_server.kill()
    t0 = time.monotonic()
    with pytest.raises(redis.exceptions.ConnectionError) as exc:
        conn.ping()
    assert not isinstance(exc.value, RedisUnreachableError) and time.monotonic() - t0 >= 0.5
    redis_server.start()
    ReconnectingRedis(redis_server.url, retry_timeout_s=0.5).ping()  # the URL was reached: a new connection retries too


@pytest.mark.parametrize("script", ["learner.py", "actor.py"])
def test_example_scripts_without_redis_exit_2_within_seconds(script):
    url = _closed_port_url()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), "--redis-url", url], capture_output=True,
                          text=True, env=env, timeout=110)
    # not the 120 s retry wait; the bound leaves room for torch's import on a loaded machine
    assert proc.returncode == 2 and time.monotonic() - t0 < 60, proc.stderr
    assert proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"examples/pipeline_rl/{script}: error: --redis-url: cannot reach Redis (")
    assert "start redis-server there or fix the URL" in proc.stderr and "secret" not in proc.stderr


# ------------------------------------------------------------------------------- back-pressure, shutdown
@needs_server
def test_actor_waits_at_the_queue_bound_and_stops_when_the_learner_is_done(redis_server, caplog):
    import threading

    caplog.set_level(logging.INFO, logger="ludic_fast.distributed.pipeline")
    keys = PipelineKeys("bound")
    assert PipelineProducer(redis_server.url, keys=keys).max_queued == 1024  # bounded by default
    src = PipelineBatchSource(redis_server.url, keys=keys, batch_size=2, block_ms=50)
    prod = PipelineProducer(redis_server.url, keys=keys, actor_id="A", max_queued=3)
    result = {}
    actor = threading.Thread(target=lambda: result.update(pushed=run_pipeline_actor(lambda v: [_item(0), _item(1)],
                                                                                    prod)))
    actor.start()  # no num_rounds: it runs until the learner is done
    deadline = time.monotonic() + 20
    while prod.pushed < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    # rounds of 2 go whole while fewer than 3 are unread: 0 -> 2 -> 4, then it waits (max_queued + 2 - 1)
    assert prod.pushed == 4 and prod.queued() == 4
    assert len(src.next_batch_sync().items) == 2  # read: two fewer unread, the actor fills up again
    while prod.pushed < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    assert prod.pushed == 6 and prod.queued() == 4
    src.commit()  # acknowledging read entries frees no room: they were no longer counted
    time.sleep(0.5)
    assert prod.pushed == 6
    src.mark_done()
    actor.join(timeout=10)
    assert not actor.is_alive() and result["pushed"] == 6
    assert "the learner finished while this actor waited" in caplog.text and "round 1: pushed 2 items" in caplog.text
    PipelineBatchSource(redis_server.url, keys=keys, batch_size=2)  # a new learner clears the mark
    assert not prod.learner_done()


@needs_server
def test_actor_and_learner_stop_on_request(redis_server):
    """The actor pushes the round in progress, then stops; waiting for weights or at the bound it stops at
    once. The learner's source raises StopRequested while it waits, and what it had read stays pending."""
    import threading

    stop = threading.Event()
    rounds = []

    def make_items(version):
        rounds.append(version)
        if len(rounds) == 2:
            stop.set()  # the request arrives during the second round's rollouts
        return [_item(0), _item(1)]

    keys = PipelineKeys("stop")
    prod = PipelineProducer(redis_server.url, keys=keys, actor_id="S", max_queued=3)
    assert run_pipeline_actor(make_items, prod, stop_requested=stop.is_set) == 4  # round 2 pushed whole, then stop
    assert len(rounds) == 2
    stop.clear()
    threading.Timer(0.3, stop.set).start()
    t0 = time.monotonic()  # never published weights: waits until the request
    assert run_pipeline_actor(make_items, prod, poll_weights=lambda: None, wait_interval_s=0.05,
                              stop_requested=stop.is_set) == 4
    assert time.monotonic() - t0 < 5 and len(rounds) == 2
    stop.clear()
    threading.Timer(0.3, stop.set).start()
    t0 = time.monotonic()  # 4 unread >= max_queued 3: round 3 waits at the bound until the request, then is dropped
    assert run_pipeline_actor(make_items, prod, stop_requested=stop.is_set) == 4
    assert time.monotonic() - t0 < 5 and len(rounds) == 3 and prod.queued() == 4
    src = PipelineBatchSource(redis_server.url, keys=keys, batch_size=5, block_ms=50,
                              stop_requested=lambda: src.counters["received"] == 4)  # once it has read all 4
    with pytest.raises(StopRequested, match="4 of 5 items read"):
        src.next_batch_sync()
    src.commit()  # nothing trained: nothing acknowledged
    src.close()
    again = PipelineBatchSource(redis_server.url, keys=keys, batch_size=4, block_ms=50)
    assert len(again.next_batch_sync().items) == 4  # the same consumer name reads its pending entries again


# ------------------------------------------------------------------------------- delivery semantics
@needs_server
def test_batch_source_drops_malformed_duplicate_and_stale_and_acks_after_training(redis_server, caplog):
    caplog.set_level(logging.INFO, logger="ludic_fast.distributed.pipeline")
    keys = PipelineKeys("t1")
    client = redis.Redis.from_url(redis_server.url)
    prod = PipelineProducer(redis_server.url, keys=keys, actor_id="A")
    src = PipelineBatchSource(redis_server.url, keys=keys, batch_size=3, max_lag=1, current_version=lambda: 5,
                              block_ms=50)
    first = encode_item(_item(0), item_id="dup", policy_version=5)
    client.xadd(keys.stream, {b"payload": first})
    client.xadd(keys.stream, {b"payload": b"\x00garbage"})  # malformed
    client.xadd(keys.stream, {b"payload": first})  # a re-sent copy of the same item id
    client.xadd(keys.stream, {b"other": b"field"})  # no payload field: malformed
    prod.push(_item(1), policy_version=3)  # lag 2 > max_lag: stale
    ids = [prod.push(_item(i), policy_version=4) for i in (2, 3)]
    batch = src.next_batch_sync()
    assert [i.meta["item_id"] for i in batch.items] == ["dup", *ids]
    assert src.counters == {"received": 7, "malformed": 2, "duplicates": 1, "stale": 1, "delivered": 3}
    assert batch.meta["num_samples"] == 3 and batch.meta["pipeline_malformed"] == 2
    logged = [r.getMessage() for r in caplog.records]
    assert sum("malformed" in m for m in logged) == 2 and sum("duplicate" in m for m in logged) == 1
    assert sum("stale" in m for m in logged) == 1
    # the delivered items stay pending until the next fetch; the dropped ones are gone
    assert client.xpending(keys.stream, keys.group)["pending"] == 3
    assert client.xlen(keys.stream) == 3
    prod.push(_item(9), policy_version=5)
    prod.push(_item(10), policy_version=5)
    prod.push(_item(11), policy_version=5)
    src.next_batch_sync()
    assert client.xpending(keys.stream, keys.group)["pending"] == 3  # only the new batch
    src.commit()
    assert client.xpending(keys.stream, keys.group)["pending"] == 0 and client.xlen(keys.stream) == 0


@needs_server
def test_learner_restart_redelivers_the_unacknowledged_batch(redis_server):
    keys = PipelineKeys("t2")
    prod = PipelineProducer(redis_server.url, keys=keys, actor_id="A")
    ids = [prod.push(_item(i), 0) for i in range(4)]
    src = PipelineBatchSource(redis_server.url, keys=keys, batch_size=2, block_ms=50)
    assert [i.meta["item_id"] for i in src.next_batch_sync().items] == ids[:2]
    src.close()  # crashed before training on it: nothing acknowledged
    again = PipelineBatchSource(redis_server.url, keys=keys, batch_size=3, block_ms=50)
    batch = asyncio.run(again.next_batch())  # Ludic's async BatchSource API
    assert [i.meta["item_id"] for i in batch.items] == ids[:3]


@needs_server
def test_entries_delivered_by_a_read_whose_reply_was_lost_are_not_lost(redis_server):
    keys = PipelineKeys("t4")
    prod = PipelineProducer(redis_server.url, keys=keys, actor_id="A")
    ids = [prod.push(_item(i), 0) for i in range(4)]
    src = PipelineBatchSource(redis_server.url, keys=keys, batch_size=4, block_ms=50)
    src._pending_cursor = None  # past start-up: reading new entries
    real = src.conn.client.xreadgroup
    calls = []

    def lossy(*args, **kwargs):  # the first read reaches Redis (entries now pending to us), its reply is lost
        reply = real(*args, **kwargs)
        calls.append(reply)
        if len(calls) == 1:
            raise redis.exceptions.ConnectionError("reply lost")
        return reply

    src.conn.client.xreadgroup = lossy
    batch = src.next_batch_sync()
    assert len(calls[0][0][1]) == 4  # all four were delivered by the lost read
    assert [i.meta["item_id"] for i in batch.items] == ids
    assert src.counters["duplicates"] == 0 and src.conn.reconnects == 1


@needs_server
def test_learner_survives_redis_losing_its_data(redis_server):
    keys = PipelineKeys("t5")
    src = PipelineBatchSource(redis_server.url, keys=keys, batch_size=2, block_ms=50)
    prod = PipelineProducer(redis_server.url, keys=keys, actor_id="A")
    first = [prod.push(_item(0), 0), prod.push(_item(9), 0)]
    assert first == [f"A@{prod.incarnation}:0", f"A@{prod.incarnation}:1"]
    assert [i.meta["item_id"] for i in src.next_batch_sync().items] == first
    redis.Redis.from_url(redis_server.url).flushall()  # as a restart without persistence would
    second = [prod.push(_item(1), 0), prod.push(_item(2), 0)]  # the producer recreates the stream and group
    ids = [i.meta["item_id"] for i in src.next_batch_sync().items]
    assert ids == second, ids  # the group is recreated from the stream's start; nothing raised


@needs_server
def test_weights_roundtrip_in_parts_and_versions(redis_server):
    keys = PipelineKeys("t3")
    model = torch.nn.Linear(5, 3)
    target = torch.nn.Linear(5, 3)
    pub = RedisWeightPublisher(redis_server.url, keys=keys, part_bytes=64)  # many parts
    seen = []
    sub = RedisWeightSubscriber(redis_server.url, lambda s, v: (load_into(target)(s, v), seen.append(v)), keys=keys)
    assert sub.poll() is None
    pub.publish(model.state_dict(), version=1)
    assert sub.poll() == 1 and sub.poll() is None
    torch.testing.assert_close(target.weight, model.weight, rtol=0, atol=0)
    with torch.no_grad():
        model.weight.add_(1.0)
    pub.publish(model.state_dict(), version=2)
    assert sub.poll() == 2 and seen == [1, 2]
    torch.testing.assert_close(target.weight, model.weight, rtol=0, atol=0)
    src = PipelineBatchSource(redis_server.url, keys=keys, batch_size=1, max_lag=0, block_ms=50)
    assert src._current_version() == 2  # the default learner version is the published one
    with pytest.raises(ValueError, match="version"):
        pub.publish(model.state_dict(), version=-1)


# ------------------------------------------------------------------------- actor + learner processes
V, D = 11, 8
BATCH, STEPS, MAX_LAG = 4, 12, 6


def _tiny_model() -> torch.nn.Module:
    from ludic_fast.embedded import build_tiny_model

    return build_tiny_model(V, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=2, seed=0)


def _checksum(model: torch.nn.Module) -> float:
    return float(sum(p.double().sum() for p in model.state_dict().values()))


class _RecordingSource:
    """The learner's PipelineBatchSource, remembering the item ids it handed to the Trainer."""

    def __init__(self, source: PipelineBatchSource):
        self.source, self.fetched = source, []

    async def next_batch(self):
        batch = await self.source.next_batch()
        self.fetched.extend(i.meta["item_id"] for i in batch.items)
        return batch


def _write(f, **record) -> None:
    f.write(json.dumps(record) + "\n")
    f.flush()


def _learner_main(url: str, out: str) -> None:
    """The learner: the bundled Trainer (CISPO preset, fused head) on a PipelineBatchSource, publishing its
    weights to Redis after every step."""
    from ludic_fast.algorithm import make_cispo
    from ludic_fast.trainer import Trainer, TrainerConfig

    torch.set_num_threads(1)
    pub = RedisWeightPublisher(url, retry_timeout_s=60)
    src = PipelineBatchSource(url, batch_size=BATCH, max_lag=MAX_LAG, block_ms=200, retry_timeout_s=60)
    recording = _RecordingSource(src)
    cfg = TrainerConfig(model_device="cpu", pad_token_id=0, lr=1e-2, max_seq_len=16, micro_token_budget=64,
                        sync_every_steps=1, max_lag=MAX_LAG)
    trainer = Trainer(model=_tiny_model(), algo=make_cispo(group_size=1), batch_source=recording, cfg=cfg,
                      publisher=pub)
    pub.publish({n: p.detach() for n, p in trainer.model.named_parameters()}, version=0)
    with open(out, "w") as f:
        for _ in range(STEPS):
            stats = trainer.train_step_sync()
            _write(f, step=trainer.step_idx, ids=recording.fetched, loss=stats["train/loss"],
                   checksum=_checksum(trainer.model))
            recording.fetched = []
        src.commit()
        _write(f, counters=src.counters, reconnects=src.conn.reconnects + pub.conn.reconnects)


def _actor_main(url: str, out: str, rounds: int) -> None:
    """Actor: polls weights into its policy copy, 'generates' BATCH items per round with behaviour logprobs
    from that policy, pushes them tagged with its policy version."""
    torch.set_num_threads(1)
    model = _tiny_model()
    with open(out, "w") as f:
        def apply(state, version):
            load_into(model)(state, version)
            _write(f, applied=version, checksum=_checksum(model))

        sub = RedisWeightSubscriber(url, apply, retry_timeout_s=60)
        prod = PipelineProducer(url, actor_id="actor0", max_queued=2 * BATCH, retry_timeout_s=60)
        counter = iter(range(10**6))

        def make_items(version: int) -> list[SAWItem]:
            time.sleep(0.15)  # the rollout
            items = []
            for _ in range(BATCH):
                base = _item(next(counter))
                with torch.no_grad():
                    logp = torch.log_softmax(model(torch.tensor([base.input_ids])).logits[0], -1)
                    token_lp = logp[:-1].gather(1, torch.tensor(base.input_ids[1:])[:, None])[:, 0]
                acts = [float(token_lp[t - 1]) for t, m in enumerate(base.action_mask) if m]
                items.append(SAWItem(base.input_ids, base.attention_mask, base.action_mask, base.weight,
                                     base.meta, SampleAttachments(ActorTokenLogps(acts))))
            return items

        original_push = prod.push_round

        def push_round(items, version, **kwargs):
            ids = original_push(items, version, **kwargs)
            for item_id in ids:
                _write(f, pushed=item_id, version=version)
            return ids

        prod.push_round = push_round
        run_pipeline_actor(make_items, prod, poll_weights=sub.poll, num_rounds=rounds)
        _write(f, reconnects=prod.conn.reconnects + sub.conn.reconnects)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait(cond, what: str, timeout: float = 150.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@needs_server
def test_actor_and_learner_processes_survive_redis_restart(redis_server, tmp_path):
    ctx = multiprocessing.get_context("fork")  # the processes inherit this one's imports (torch, the pipeline)
    learner_log, actor_log = tmp_path / "learner.jsonl", tmp_path / "actor.jsonl"
    learner = ctx.Process(target=_learner_main, args=(redis_server.url, str(learner_log)))
    actor = ctx.Process(target=_actor_main, args=(redis_server.url, str(actor_log), STEPS))
    learner.start()
    actor.start()
    try:
        steps = lambda: [r for r in _records(learner_log) if "step" in r]  # noqa: E731
        _wait(lambda: len(steps()) >= 3, "3 learner steps")
        redis_server.kill()  # crash: whatever Redis acknowledged is in the fsync'd AOF
        time.sleep(0.5)
        redis_server.start()
        client = redis.Redis.from_url(redis_server.url)
        client.xadd(PipelineKeys().stream, {b"payload": b"\x93 definitely not an item"})
        _wait(lambda: len(steps()) >= MAX_LAG + 1, f"{MAX_LAG + 1} learner steps")
        stale_ids = [f"stale:{i}" for i in range(3)]
        for i, sid in enumerate(stale_ids):  # generated by policy version 0, now > MAX_LAG versions old
            client.xadd(PipelineKeys().stream, {b"payload": encode_item(_item(100 + i), item_id=sid,
                                                                        policy_version=0)})
        actor.join(120)
        learner.join(120)
        assert actor.exitcode == 0 and learner.exitcode == 0
    finally:
        for p in (actor, learner):
            if p.is_alive():
                p.kill()

    lrec, arec = _records(learner_log), _records(actor_log)
    trained = [i for r in lrec if "step" in r for i in r["ids"]]
    pushed = [r["pushed"] for r in arec if "pushed" in r]
    final = lrec[-1]
    assert len(pushed) == STEPS * BATCH
    assert len(trained) == len(set(trained)), "an item was trained on twice"
    assert sorted(trained) == sorted(pushed), "an item was lost (or a stale/foreign one was trained on)"
    assert final["counters"]["malformed"] == 1
    assert final["counters"]["stale"] == len(stale_ids)
    assert final["counters"]["duplicates"] == 0
    assert final["reconnects"] >= 1 and arec[-1]["reconnects"] >= 1, "both sides should have reconnected"
    steps_done = [r for r in lrec if "step" in r]
    assert [r["step"] for r in steps_done] == list(range(1, STEPS + 1)), "the learner kept training"
    assert len({r["checksum"] for r in steps_done}) == STEPS and all(r["loss"] != 0 for r in steps_done)
    # the actor generated with published weights: each version it applied matches the learner's checksum
    learner_sums = {r["step"]: r["checksum"] for r in lrec if "step" in r}
    applied = [r for r in arec if "applied" in r]
    assert len(applied) >= 3 and [r["applied"] for r in applied] == sorted({r["applied"] for r in applied})
    for r in applied:
        if r["applied"] > 0:
            assert r["checksum"] == pytest.approx(learner_sums[r["applied"]], rel=1e-12)


@needs_server
def test_example_actor_and_learner_scripts_run(redis_server):
    """examples/pipeline_rl: one actor and the learner (Trainer, HF generate rollouts) on the embedded default."""
    root = EXAMPLES
    common = ["--redis-url", redis_server.url, "--prefix", "ex", "--prompts-per-batch", "2", "--group-size", "2",
              "--threads", "1", "--max-lag", "4", "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    learner = subprocess.Popen(
        [sys.executable, str(root / "learner.py"), *common, "--sft-steps", "0", "--rl-steps", "2",
         "--eval-every", "0", "--logger", "none"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    # no --rounds: the actor runs until the learner is done, never more than --max-queued (default 4 x 2 x 2)
    # items ahead of it
    actor = subprocess.run(
        [sys.executable, str(root / "actor.py"), *common, "--actor-id", "ex0"],
        capture_output=True, text=True, env=env, timeout=150,
    )
    out, _ = learner.communicate(timeout=150)
    assert actor.returncode == 0, actor.stdout + actor.stderr
    assert learner.returncode == 0, out
    pushed = int(re.search(r"\[actor ex0\] pushed (\d+) items", actor.stdout).group(1))
    assert 8 <= pushed <= 8 + 16, actor.stdout  # what the learner took, plus at most the bound
    assert "round 1: pushed 4 items" in actor.stderr and "the learner" in actor.stderr
    assert "done: 2 steps" in out and "'delivered': 8" in out and "'malformed': 0" in out


def _stderr_until(proc: subprocess.Popen, marker: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    for line in proc.stderr:
        if marker in line:
            return
        assert time.monotonic() < deadline, f"no {marker!r} line in time"
    raise AssertionError(f"the process ended before a {marker!r} line")


@needs_server
def test_example_scripts_stop_on_sigint_and_sigterm(redis_server):
    """The learner waiting for its first batch (no actor) stops on SIGINT: exit 130, the actors told to stop,
    one closing line, no traceback; the actor waiting for the first weights (no learner) stops on SIGTERM: 143.
    Both run at once, forked from this process (tests/_forked.py); test_example_actor_and_learner_scripts_run
    starts the scripts in fresh interpreters."""
    common = ["--redis-url", redis_server.url, "--prompts-per-batch", "2", "--group-size", "2", "--threads", "1",
              "--device", "cpu", "--logger", "none"]
    actor_main, learner_main = actor_and_learner_mains()
    client = redis.Redis.from_url(redis_server.url)
    refused = forked.run(lambda: learner_main([*common, "--checkpoint-every", "5"]), timeout=120)
    assert refused.returncode == 2 and refused.stdout == "" and refused.stderr.count("\n") == 1, refused.stderr
    assert "--checkpoint-every/--resume need --output-dir" in refused.stderr
    actor = forked.start(lambda: actor_main([*common, "--prefix", "sig-a", "--actor-id", "a0"]), stdout=forked.PIPE,
                         stderr=forked.PIPE)
    learner = forked.start(lambda: learner_main([*common, "--prefix", "sig-l", "--sft-steps", "0", "--rl-steps", "5",
                                                 "--eval-every", "0"]), stdout=forked.PIPE, stderr=forked.PIPE)
    try:
        _stderr_until(actor, "waiting for the learner's first weights")
        actor.send_signal(signal.SIGTERM)
        out, err = actor.communicate(timeout=30)
        assert actor.returncode == 143, err
        assert "Traceback" not in err
        assert err.splitlines()[-1].startswith("[actor a0] stopped by SIGTERM: pushed 0 items")
        deadline = time.monotonic() + 120
        while client.hget("sig-l:weights", "version") is None:  # published version 0: now waiting for a batch
            assert time.monotonic() < deadline and learner.poll() is None, "the learner never published"
            time.sleep(0.05)
        learner.send_signal(signal.SIGINT)
        out, err = learner.communicate(timeout=60)  # it does not wait for the batch that no actor sends
        assert learner.returncode == 130, err
        assert "Traceback" not in err and "[learner] stopped by SIGINT after RL step 0" in err.splitlines()[-1]
        assert client.exists("sig-l:done")
    finally:
        for proc in (actor, learner):
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------------- checkpointed learner, soak
@needs_server
def test_checkpointed_source_acks_only_what_a_durable_checkpoint_covers(redis_server):
    """ack_after_checkpoint: entries stay pending until checkpoint_saved(); a source restored from the
    checkpoint's state drops the covered entries still pending (the crash came before their XACK) and
    delivers the later ones again (their training was lost)."""
    keys = PipelineKeys("ck")
    client = redis.Redis.from_url(redis_server.url)
    prod = PipelineProducer(redis_server.url, keys=keys, actor_id="A")
    ids = prod.push_round([_item(i) for i in range(6)], 0)
    src = PipelineBatchSource(redis_server.url, keys=keys, batch_size=2, block_ms=50, ack_after_checkpoint=True,
                              current_version=lambda: 3)
    assert [i.meta["item_id"] for i in src.next_batch_sync().items] == ids[:2]
    state = src.state_dict()  # a checkpoint after step 1 is being written...
    assert state == {"delivered_ids": ids[:2], "policy_version": 3}
    assert [i.meta["item_id"] for i in src.next_batch_sync().items] == ids[2:4]  # step 2: nothing acknowledged
    assert client.xpending(keys.stream, keys.group)["pending"] == 4
    src.close()  # ...SIGKILL: the checkpoint of step 1 is on disk, checkpoint_saved() never ran
    again = PipelineBatchSource(redis_server.url, keys=keys, batch_size=2, block_ms=50, ack_after_checkpoint=True)
    again.load_state_dict(state)
    assert again.checkpoint_version == 3
    assert [i.meta["item_id"] for i in again.next_batch_sync().items] == ids[2:4]  # trained again, once
    assert again.counters["duplicates"] == 2  # ids[:2]: covered by the checkpoint, dropped
    again.state_dict()
    again.checkpoint_saved()
    assert client.xpending(keys.stream, keys.group)["pending"] == 0 and client.xlen(keys.stream) == 2
    with pytest.raises(ValueError, match="delivered_ids"):
        again.load_state_dict({"delivered_ids": "A", "policy_version": 0})


def _versions_seen(log: str) -> list[int]:
    return [int(v) for v in re.findall(r"pushed \d+ items of policy version (\d+)", log)]


@needs_server
@pytest.mark.timeout(300)
def test_soak_four_actors_learner_sigkilled_and_resumed(redis_server, tmp_path):
    """Four actor processes and the learner (examples/pipeline_rl) on loopback Redis: one actor is SIGKILLed
    mid-run, the learner is SIGKILLed after a step its last checkpoint does not cover and resumed with --resume.
    Every item is trained exactly once in the final model's lineage (trained_ids.jsonl), none is lost (the
    pushed ids of each actor life, trained or still queued, are whole rounds 0..n-1), versions only go up, and
    no surviving actor loaded a weight set whose checksum failed (publish.py's counters)."""
    out = tmp_path / "run"
    round_size, steps, every = 4, 30, 5
    common = ["--redis-url", redis_server.url, "--prefix", "soak", "--prompts-per-batch", "2", "--group-size", "2",
              "--threads", "1", "--device", "cpu", "--logger", "none"]
    learner_argv = [*common, "--sft-steps", "0", "--rl-steps", str(steps), "--eval-every", "0", "--output-dir",
                    str(out), "--checkpoint-every", str(every)]
    actor_main, learner_main = actor_and_learner_mains()
    logs = {}

    def start(name, main, argv):  # forked from this process: the scripts' imports are done once, here
        logs[name] = tmp_path / f"{name}.log"
        return forked.start(lambda: main(argv), stdout=logs[name], stderr=forked.STDOUT)

    def trained_steps():
        return [r["step"] for r in _records(out / "trained_ids.jsonl")]

    actors = {f"a{k}": start(f"a{k}", actor_main, [*common, "--actor-id", f"a{k}", "--seed", str(k), "--max-queued",
                                                    "6"]) for k in range(4)}
    procs = list(actors.values())
    try:  # the learner starts once every actor is up, so that all four take part
        _wait(lambda: all("first weights" in logs[name].read_text() for name in actors), "four actors up")
        learner = start("learner", learner_main, learner_argv)
        procs.append(learner)
        _wait(lambda: len(_versions_seen(logs["a1"].read_text())) >= 1, "actor a1's first round")
        actors["a1"].send_signal(signal.SIGKILL)  # pushing round after round: killed wherever it is
        actors["a1"].wait()
        ckpt = CheckpointManager(CheckpointConfig(str(out / "rl")))  # the learner's, as --resume reads them
        _wait(lambda: (ckpt.latest_step() or 0) >= every and max(trained_steps(), default=0) >= ckpt.latest_step() + 2,
              "a step two past the learner's last checkpoint")
        learner.send_signal(signal.SIGKILL)
        learner.wait()
        killed_at = (ckpt.latest_step(), max(trained_steps()))
        assert killed_at[1] > killed_at[0], killed_at  # steps trained after the checkpoint: lost, to retrain
        seen_before = max(v for name in actors for v in _versions_seen(logs[name].read_text()))
        learner = start("learner2", learner_main, [*learner_argv, "--resume"])
        procs.append(learner)
        assert learner.wait(timeout=150) == 0, logs["learner2"].read_text()[-3000:]
        for name, proc in actors.items():
            if name != "a1":
                assert proc.wait(timeout=60) == 0, logs[name].read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    records = _records(out / "trained_ids.jsonl")
    assert sorted({r["step"] for r in records}) == list(range(1, steps + 1))
    trained = [i for r in records for i in r["ids"]]
    assert len(trained) == len(set(trained)), "an item was trained twice in the final model's lineage"
    client = redis.Redis.from_url(redis_server.url)
    queued = [decode_item(f[b"payload"]).meta["item_id"] for _, f in client.xrange("soak:items")]
    assert not set(trained) & set(queued), "a trained item is still queued"
    lives: dict[str, list[int]] = {}
    for item_id in trained + queued:
        life, seq = item_id.rsplit(":", 1)
        lives.setdefault(life, []).append(int(seq))
    assert {life.split("@")[0] for life in lives} == set(actors)
    for life, seqs in lives.items():  # nothing lost, no round half-pushed (the killed actor's included)
        assert sorted(seqs) == list(range(len(seqs))) and len(seqs) % round_size == 0, (life, sorted(seqs))
    resumed = re.search(r"resumed at step (\d+): publishing version (\d+)", logs["learner2"].read_text())
    assert resumed and int(resumed.group(1)) == killed_at[0] and int(resumed.group(2)) > seen_before
    for name in actors:
        seen = _versions_seen(logs[name].read_text())
        assert seen == sorted(seen), (name, seen)  # each actor's policy versions only go up
        if name != "a1":  # the survivors' weight loads: every one checksum-verified, none refused
            loads = re.search(r"weight loads (\{.*\})", logs[name].read_text())
            counters = ast.literal_eval(loads.group(1))
            assert counters.get("loaded", 0) >= 2 and counters.get("checksum_mismatch", 0) == 0, (name, counters)
    metrics = [r["step"] for r in _records(out / "metrics.jsonl")]
    assert metrics == list(range(1, steps + 1))
    assert client.hget("soak:weights", "version") is not None


def test_versions_only_go_up_across_a_resume():
    from ludic_fast.distributed.versions import OffsetPublisher, start_version

    assert start_version(None, None) == 0  # a fresh pipeline: version = step
    assert start_version(5, None) == 6  # Redis lost its data: above the checkpoint's
    assert start_version(5, 9) == 10  # actors may have loaded 9 (steps after the checkpoint): above it
    with pytest.raises(ValueError, match="versions"):
        start_version(-1, None)
    published = []
    pub = OffsetPublisher(type("P", (), {"publish": lambda self, p, v: published.append(v)})(), offset=10 - 5)
    for step in (5, 6, 7):  # resumed at step 5
        pub.publish({}, step)
    assert published == [10, 11, 12]
    with pytest.raises(TypeError, match="publish"):
        OffsetPublisher(object())


@needs_server
def test_a_concurrent_push_between_room_check_and_push_is_seen(redis_server):
    """Two actors race for the last room: B pushes a round after A has found room but before A writes. A's
    transaction runs under WATCH, so it is refused, A checks again, finds the bound reached and waits; without
    WATCH both rounds would land (6 unread at a bound of 3)."""
    keys = PipelineKeys("race")
    a = PipelineProducer(redis_server.url, keys=keys, actor_id="A", max_queued=3)
    b = PipelineProducer(redis_server.url, keys=keys, actor_id="B", max_queued=3)
    real, raced = a._unread, []

    def check_then_race(client):
        unread = real(client)
        if not raced:
            raced.append(b.push_round([_item(0), _item(1), _item(2)], 0))  # lands between A's check and A's EXEC
        return unread

    a._unread = check_then_race
    with pytest.raises(StopRequested):
        a.push_round([_item(3), _item(4), _item(5)], 0, stop_requested=lambda: True)
    assert raced and a.pushed == 0 and b.pushed == 3 and a.queued() == 3
