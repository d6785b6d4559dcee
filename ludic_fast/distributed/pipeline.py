"""Pipeline RL over Redis: actors push SAWItems, the learner's `PipelineBatchSource` pulls them.

Transport: one Redis stream (`<prefix>:items`) read through a consumer group (`<prefix>:learners`).

- Payloads are msgpack maps `{"format": 2, "id": str, "policy_version": int, "item": SAWItem.to_dict()}`;
  nothing is ever unpickled. A payload that does not decode to a valid SAWItem is dropped, counted
  (`counters["malformed"]`) and logged; it never raises in the learner.
- At-least-once delivery: an entry stays in the group's pending list until the learner acknowledges it,
  and the learner acknowledges (XACK + XDEL) the items of a batch only when it asks for the next batch,
  i.e. after it has trained on them; a checkpointed learner only once a checkpoint covering them is durable
  (`PipelineBatchSource`: exactly once in the final model's lineage across a SIGKILL and a resume).
  After any reconnect the learner re-reads its own pending entries, so
  an entry delivered by a read whose reply was lost is not lost. Run Redis with `--appendonly yes
  --appendfsync always` and a server restart loses nothing either.
- De-duplication by item id: an actor whose XADD failed with an ambiguous error re-sends the same payload;
  the learner keeps the ids it has delivered and drops repeats (`counters["duplicates"]`).
- Staleness: every item carries the policy version it was generated with; with `max_lag`, an item with
  `current_version - policy_version > max_lag` is dropped and counted (`counters["stale"]`). The current
  version is what the learner last published (`<prefix>:weights`, see `ludic_fast.distributed.publish`)
  unless the caller passes `current_version`.
- Actors: each round's items go onto the stream in one MULTI/EXEC (an actor killed mid-push leaves all of
  them or none); ids are `<actor_id>@<incarnation>:<n>`, unique across actor restarts.
- Back-pressure and shutdown: a producer waits while the stream holds `max_queued` entries no learner has
  read (1024 by default; checked under WATCH, so with any number of actors at most `max_queued + round
  size - 1`), so actors never run far ahead of the learner; a learner that has finished sets
  `<prefix>:done` (`PipelineBatchSource.mark_done`, cleared when a learner starts) and actors stop at
  their next round or while they wait. An actor asked to stop (`run_pipeline_actor(stop_requested=...)`,
  e.g. on SIGINT) finishes and pushes its current round, then stops; waiting at the bound, it stops at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

try:
    import msgpack
    import redis
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("pipeline RL over Redis needs redis and msgpack: pip install 'ludic-fast[redis]'") from exc

from ludic_fast.data.types import SAWBatch, SAWItem
from ludic_fast.distributed.redis_conn import ReconnectingRedis, ensure_group

log = logging.getLogger(__name__)

PAYLOAD_FORMAT = 2  # 2: SAWItem.to_dict nests its attachments ({"attachments": {"actor_logps": ...}})
_FIELD = b"payload"


class MalformedPayloadError(ValueError):
    """A pipeline payload that is not a valid encoded SAWItem."""


class LearnerDone(Exception):
    """The learner has marked the pipeline done (`<prefix>:done`): actors stop pushing."""


class StopRequested(Exception):
    """The actor was asked to stop while it waited for room in the stream."""


def _never() -> bool:
    return False


@dataclass(frozen=True)
class PipelineKeys:
    """Redis key names of one pipeline; actors and learner must use the same `prefix`."""

    prefix: str = "ludic"

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str) or not self.prefix:
            raise ValueError(f"prefix must be a non-empty str, got {self.prefix!r}")

    @property
    def stream(self) -> str:
        return f"{self.prefix}:items"

    @property
    def group(self) -> str:
        return f"{self.prefix}:learners"

    @property
    def weights(self) -> str:
        return f"{self.prefix}:weights"

    @property
    def done(self) -> str:
        return f"{self.prefix}:done"


DEFAULT_KEYS = PipelineKeys()


# ----------------------------------------------------------------------------------------------- codec
def encode_item(item: SAWItem, *, item_id: str, policy_version: int) -> bytes:
    """msgpack bytes of `item` tagged with its unique id and the policy version that generated it."""
    if not isinstance(item, SAWItem):
        raise TypeError(f"item must be a SAWItem, got {type(item).__name__}")
    if not isinstance(item_id, str) or not item_id:
        raise ValueError(f"item_id must be a non-empty str, got {item_id!r}")
    if isinstance(policy_version, bool) or not isinstance(policy_version, int) or policy_version < 0:
        raise ValueError(f"policy_version must be a non-negative int, got {policy_version!r}")
    body = {"format": PAYLOAD_FORMAT, "id": item_id, "policy_version": policy_version, "item": item.to_dict()}
    return msgpack.packb(body, use_bin_type=True)


def decode_item(payload: bytes) -> SAWItem:
    """Inverse of `encode_item`; the id and version land in `item.meta["item_id"]` and
    `item.meta["policy_version"]`. Anything else raises MalformedPayloadError."""
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise MalformedPayloadError(f"payload is not msgpack: {exc}") from exc
    if not isinstance(body, dict) or body.get("format") != PAYLOAD_FORMAT:
        raise MalformedPayloadError(f"payload is not a format-{PAYLOAD_FORMAT} map")
    item_id, version = body.get("id"), body.get("policy_version")
    if not isinstance(item_id, str) or not item_id:
        raise MalformedPayloadError("payload has no item id")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise MalformedPayloadError(f"payload has an invalid policy_version {version!r}")
    try:
        item = SAWItem.from_dict(body["item"])
    except (KeyError, TypeError, ValueError) as exc:
        raise MalformedPayloadError(f"payload item {item_id!r} is not a valid SAWItem: {exc}") from exc
    item.meta["item_id"] = item_id
    item.meta["policy_version"] = version
    return item


def published_version(conn: ReconnectingRedis, keys: PipelineKeys = DEFAULT_KEYS) -> int | None:
    """The policy version the learner last published under `keys.weights`, or None when none is."""
    raw = conn.call(lambda c: c.hget(keys.weights, "version"), "HGET version")
    return None if raw is None else int(raw)


# ----------------------------------------------------------------------------------------------- actor
class PipelineProducer:
    """Pushes SAWItems onto the stream, each round in one MULTI/EXEC transaction (all of its items or none,
    whatever kills the actor). Ids are `<actor_id>@<incarnation>:<n>`: a fresh random incarnation per
    producer, so an actor restarted under the same `actor_id` never repeats an id of its earlier life. A push
    survives Redis restarts (the same payloads are re-sent until acknowledged; the learner drops a repeat).

    Back-pressure: `queued()` counts the entries no learner has read yet (stream length minus the group's
    pending entries). A round is pushed only while `queued() < max_queued`, checked and written under WATCH,
    so however many actors push, the stream never holds more than `max_queued + round size - 1` unread
    entries. Waiting, `push_round` raises LearnerDone if the learner marks the pipeline done (StopRequested
    once its `stop_requested()` is true)."""

    def __init__(
        self,
        redis_url: str,
        *,
        keys: PipelineKeys = DEFAULT_KEYS,
        actor_id: str | None = None,
        max_queued: int | None = 1024,
        retry_timeout_s: float = 120.0,
    ):
        if max_queued is not None and max_queued < 1:
            raise ValueError(f"max_queued must be >= 1 or None, got {max_queued}")
        self.keys = keys
        self.actor_id = actor_id or uuid.uuid4().hex[:12]
        self.incarnation = uuid.uuid4().hex[:8]
        self.max_queued = max_queued
        self.conn = ReconnectingRedis(redis_url, retry_timeout_s=retry_timeout_s)
        ensure_group(self.conn, keys.stream, keys.group)
        self._seq = itertools.count()
        self.pushed = 0

    def push(self, item: SAWItem, policy_version: int, *, stop_requested: Callable[[], bool] = _never) -> str:
        """Push one item (a round of one); returns its id."""
        return self.push_round([item], policy_version, stop_requested=stop_requested)[0]

    def push_round(
        self, items: Iterable[SAWItem], policy_version: int, *, stop_requested: Callable[[], bool] = _never
    ) -> list[str]:
        """Encode the items and XADD them in one transaction once there is room; returns their ids."""
        ids, payloads = [], []
        for item in items:
            ids.append(f"{self.actor_id}@{self.incarnation}:{next(self._seq)}")
            payloads.append(encode_item(item, item_id=ids[-1], policy_version=policy_version))
        if not payloads:
            return ids
        waited = 0
        while not self.conn.call(lambda c: self._add_if_room(c, payloads), "XADD round"):
            if stop_requested():
                raise StopRequested(ids[0])
            if waited % 20 == 0 and self.learner_done():  # about once a second
                raise LearnerDone(self.keys.done)
            time.sleep(0.05)
            waited += 1
        self.pushed += len(ids)
        return ids

    def _add_if_room(self, client: redis.Redis, payloads: list[bytes]) -> bool:
        """XADD every payload in one MULTI/EXEC if fewer than `max_queued` entries are unread (checked under
        WATCH: a concurrent change of the stream retries); False when there is no room."""
        with client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(self.keys.stream)
                    if self.max_queued is not None and self._unread(pipe) >= self.max_queued:
                        pipe.unwatch()
                        return False
                    pipe.multi()
                    for payload in payloads:
                        pipe.xadd(self.keys.stream, {_FIELD: payload})
                    pipe.execute()
                    return True
                except redis.exceptions.WatchError:
                    continue

    def _unread(self, client: Any) -> int:
        try:
            pending = client.xpending(self.keys.stream, self.keys.group)["pending"]
        except redis.exceptions.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            ensure_group(self.conn, self.keys.stream, self.keys.group)  # Redis lost its data: as at start-up
            pending = 0
        return int(client.xlen(self.keys.stream)) - int(pending)

    def queued(self) -> int:
        """Entries in the stream that no learner has read yet."""
        return self.conn.call(self._unread, "XLEN")

    def learner_done(self) -> bool:
        """True once the learner has marked the pipeline done."""
        return bool(self.conn.call(lambda c: c.exists(self.keys.done), "EXISTS"))

    def close(self) -> None:
        self.conn.close()


def run_pipeline_actor(
    make_items: Callable[[int], Iterable[SAWItem]],
    producer: PipelineProducer,
    *,
    poll_weights: Callable[[], int | None] | None = None,
    num_rounds: int | None = None,
    wait_interval_s: float = 0.5,
    stop_requested: Callable[[], bool] = _never,
) -> int:
    """The actor loop: each round, `poll_weights()` (if given) loads newer published weights into the
    rollout policy and returns their version (None: nothing newer); then `make_items(policy_version)` runs
    rollouts + credit assignment and its SAWItems are pushed, each tagged with that version. With
    `poll_weights`, the first round waits until some weights have been published (items must carry the
    version of the weights that generated them); without it every item has version 0. Runs `num_rounds`
    rounds (None: until the learner marks the pipeline done), logging each round; returns the number of
    items pushed. Each round goes onto the stream whole, in one transaction (`PipelineProducer.push_round`).
    Once `stop_requested()` is true it stops after pushing the round in progress, or at once while it waits
    for the first weights or for room in the stream (that round is dropped whole)."""
    version = None if poll_weights is not None else 0
    rounds = itertools.count() if num_rounds is None else range(num_rounds)
    try:
        for r in rounds:
            if stop_requested():
                log.info("actor %s: stop requested; stopping after %d rounds", producer.actor_id, r)
                break
            if producer.learner_done():
                log.info("actor %s: the learner is done; stopping", producer.actor_id)
                break
            if poll_weights is not None:
                new = poll_weights()
                if new is None and version is None:
                    log.info("actor %s: waiting for the learner's first weights", producer.actor_id)
                while new is None and version is None:
                    if stop_requested():
                        raise StopRequested("waiting for the first weights")
                    time.sleep(wait_interval_s)
                    new = poll_weights()
                version = version if new is None else new
            n = len(producer.push_round(list(make_items(version)), version, stop_requested=stop_requested))
            log.info("actor %s round %d: pushed %d items of policy version %d (%d in total, %d queued)",
                     producer.actor_id, r + 1, n, version, producer.pushed, producer.queued())
    except LearnerDone:
        log.info("actor %s: the learner finished while this actor waited; stopping", producer.actor_id)
    except StopRequested as exc:
        log.info("actor %s: stop requested while waiting (%s); stopping", producer.actor_id, exc)
    return producer.pushed


# --------------------------------------------------------------------------------------------- learner
class PipelineBatchSource:
    """The learner's BatchSource: `await next_batch()` returns a SAWBatch of `batch_size` valid, fresh,
    first-seen items, acknowledging the previous batch's items first (see the module docstring).

    `current_version()` gives the learner's policy version for `max_lag` (default: the version last
    published under `keys.weights`). Once `stop_requested()` is true, a `next_batch` still waiting for items
    raises StopRequested (within `block_ms`); the entries it had read stay pending, and a learner restarted
    with the same `consumer` name reads them again. `counters` counts received entries and the malformed, duplicate and
    stale drops; they are also copied into each batch's meta as `pipeline_<name>` (cumulative).
    `on_deliver(ids)` is called with the item ids of each batch before it is returned.

    Checkpointed learner (`ack_after_checkpoint=True`): `next_batch` acknowledges nothing; the entries of the
    batches returned stay pending until a checkpoint covering them is durable (`state_dict` at its write,
    `checkpoint_saved` after it; the Trainer calls both). A learner killed at any moment and resumed from its
    last checkpoint (`load_state_dict`) re-reads its pending entries: those trained after the checkpoint are
    trained again (that training was lost with the process), those it covered are dropped by id. Every item
    is thus trained exactly once in the lineage of the final model.
    """

    def __init__(
        self,
        redis_url: str,
        *,
        keys: PipelineKeys = DEFAULT_KEYS,
        batch_size: int = 4,
        max_lag: int | None = None,
        current_version: Callable[[], int] | None = None,
        consumer: str = "learner-0",
        block_ms: int = 1000,
        retry_timeout_s: float = 120.0,
        max_remembered_ids: int = 1_000_000,
        stop_requested: Callable[[], bool] = _never,
        ack_after_checkpoint: bool = False,
        on_deliver: Callable[[list[str]], None] | None = None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_lag is not None and max_lag < 0:
            raise ValueError(f"max_lag must be >= 0 or None, got {max_lag}")
        if block_ms < 1:
            raise ValueError(f"block_ms must be >= 1, got {block_ms}")
        self.keys = keys
        self.batch_size = batch_size
        self.max_lag = max_lag
        self.consumer = consumer
        self.block_ms = block_ms
        self.conn = ReconnectingRedis(
            redis_url, retry_timeout_s=retry_timeout_s, socket_timeout_s=block_ms / 1000 + 30.0
        )
        self._current_version = current_version or self._published_version
        self._stop_requested = stop_requested
        self.ack_after_checkpoint = ack_after_checkpoint
        self._on_deliver = on_deliver
        self._covered: list[bytes] = []  # entries the checkpoint being written covers (`state_dict`)
        #: the policy version published when the checkpoint restored by `load_state_dict` was written
        self.checkpoint_version: int | None = None
        self._max_ids = max_remembered_ids
        self._seen: OrderedDict[str, None] = OrderedDict()  # delivered item ids, oldest first
        self._unacked: list[bytes] = []  # entries of batches already returned
        self._held: set[bytes] = set()  # entries read but not yet acknowledged (unacked + the batch in progress)
        # re-read our pending entries first (at start-up and after each reconnect); None: read new entries
        self._pending_cursor: bytes | None = b"0"
        self.counters = {"received": 0, "malformed": 0, "duplicates": 0, "stale": 0, "delivered": 0}
        ensure_group(self.conn, keys.stream, keys.group)
        self.conn.call(lambda c: c.delete(keys.done), "DEL done")  # a learner is running

    def mark_done(self) -> None:
        """Tell the actors to stop (sets `<prefix>:done`); call after the last `commit`."""
        self.conn.call(lambda c: c.set(self.keys.done, 1), "SET done")

    def _published_version(self) -> int:
        version = published_version(self.conn, self.keys)
        return 0 if version is None else version

    def commit(self) -> None:
        """Acknowledge and delete every entry of the batches returned so far (they have been trained on)."""
        self._ack(self._unacked)
        self._unacked = []

    # ------------------------------------------------------------------------------ checkpoint and resume
    def state_dict(self) -> dict[str, Any]:
        """JSON state for the learner's checkpoint: the delivered item ids (oldest first) and the policy
        version published now. The entries returned so far become those the checkpoint covers:
        `checkpoint_saved()` acknowledges them once it is durable."""
        self._covered = list(self._unacked)
        return {"delivered_ids": list(self._seen), "policy_version": self._current_version()}

    def checkpoint_saved(self) -> None:
        """The checkpoint of the last `state_dict()` is durable: acknowledge and delete the entries it covers
        (with `ack_after_checkpoint`; otherwise `next_batch` acknowledged them already)."""
        covered, self._covered = set(self._covered), []
        self._ack([e for e in self._unacked if e in covered])
        self._unacked = [e for e in self._unacked if e not in covered]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s delivered ids: a pending entry the checkpoint covered (acknowledgement lost
        in a crash) is then dropped as a duplicate, one trained after it is delivered again."""
        ids = state.get("delivered_ids")
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise ValueError("batch source state: delivered_ids must be a list of str")
        version = state.get("policy_version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"batch source state: policy_version must be a non-negative int, got {version!r}")
        self._seen = OrderedDict.fromkeys(ids[-self._max_ids:])
        self.checkpoint_version = version
        self._pending_cursor = b"0"

    def _ack(self, entry_ids: list[bytes]) -> None:
        if not entry_ids:
            return

        def ack(client):
            pipe = client.pipeline(transaction=True)
            pipe.xack(self.keys.stream, self.keys.group, *entry_ids)
            pipe.xdel(self.keys.stream, *entry_ids)
            return pipe.execute()

        self.conn.call(ack, "XACK")
        self._held.difference_update(entry_ids)

    def _read(self, count: int) -> list[tuple[bytes, dict]]:
        """New entries, or while `_pending_cursor` is set, this consumer's pending entries after the cursor
        (those not held in memory: delivered by a read whose reply was lost, or before a learner restart)."""
        reconnects = self.conn.reconnects
        cursor = self._pending_cursor
        streams = {self.keys.stream: ">" if cursor is None else cursor}
        try:
            reply = self.conn.call(
                lambda c: c.xreadgroup(self.keys.group, self.consumer, streams, count=count, block=self.block_ms),
                "XREADGROUP",
            )
        except redis.exceptions.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # Redis came back without its data (no persistence): whatever was queued is gone; start over
            log.error("pipeline stream or consumer group %s is gone (Redis lost its data?); recreating it", self.keys)
            ensure_group(self.conn, self.keys.stream, self.keys.group)
            self._pending_cursor = b"0"
            return []
        if self.conn.reconnects != reconnects:  # entries may have been delivered to us before the reply was lost
            self._pending_cursor = b"0"
            return []
        entries = reply[0][1] if reply else []
        if cursor is not None:
            self._pending_cursor = entries[-1][0] if entries else None  # None: pending list drained
        return [(eid, fields) for eid, fields in entries if eid not in self._held]

    def _accept(self, entry_id: bytes, fields: dict, version: int) -> SAWItem | None:
        """The decoded item, or None (counted, logged) when it is malformed, a duplicate or stale."""
        self.counters["received"] += 1
        try:
            item = decode_item(fields.get(_FIELD) if isinstance(fields, dict) else None)
        except MalformedPayloadError as exc:
            self.counters["malformed"] += 1
            log.warning("dropping malformed pipeline entry %s: %s", entry_id, exc)
            return None
        item_id = item.meta["item_id"]
        if item_id in self._seen:
            self.counters["duplicates"] += 1
            log.info("dropping duplicate pipeline item %s", item_id)
            return None
        if self.max_lag is not None and version - item.meta["policy_version"] > self.max_lag:
            self.counters["stale"] += 1
            log.info("dropping stale item %s (version %d, learner at %d, max_lag %d)",
                     item_id, item.meta["policy_version"], version, self.max_lag)
            return None
        self._seen[item_id] = None
        if len(self._seen) > self._max_ids:
            self._seen.popitem(last=False)
        return item

    def next_batch_sync(self) -> SAWBatch:
        """Blocking `next_batch`."""
        if not self.ack_after_checkpoint:
            self.commit()
        version = self._current_version()
        items: list[SAWItem] = []
        taken: list[bytes] = []  # acknowledged with the next batch, once trained on
        while len(items) < self.batch_size:
            if self._stop_requested():  # `taken` stays pending: a restart re-reads it
                for item in items:  # not delivered: a checkpoint written now must not count them
                    self._seen.pop(item.meta["item_id"], None)
                raise StopRequested(f"waiting for a batch ({len(items)} of {self.batch_size} items read)")
            dropped: list[bytes] = []
            for entry_id, fields in self._read(self.batch_size - len(items)):
                self._held.add(entry_id)
                item = self._accept(entry_id, fields, version)
                if item is None:
                    dropped.append(entry_id)
                else:
                    items.append(item)
                    taken.append(entry_id)
            self._ack(dropped)
        self._unacked.extend(taken)
        self.counters["delivered"] += len(items)
        if self._on_deliver is not None:
            self._on_deliver([i.meta["item_id"] for i in items])
        rewards = [float(i.meta.get("total_reward", 0.0)) for i in items]
        meta: dict[str, Any] = {
            "target_rollouts": len(items),
            "num_samples": len(items),
            "avg_total_reward": sum(rewards) / len(rewards),
            "source": "pipeline_redis",
            "policy_version": version,
            **{f"pipeline_{k}": v for k, v in self.counters.items()},
        }
        return SAWBatch(items=items, meta=meta)

    async def next_batch(self) -> SAWBatch:
        """Ludic's async BatchSource API; the blocking reads run in a worker thread."""
        return await asyncio.to_thread(self.next_batch_sync)

    def close(self) -> None:
        """Close the connection without acknowledging the last batch (it is re-delivered to this consumer)."""
        self.conn.close()
