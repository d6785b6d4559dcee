"""Weight publishing through a real redis-server: the notice + chunks layout (hand-derived safetensors bytes,
SHA-256 and chunk counts), back-pressure (at most two stored sets, orphans of a killed publisher deleted),
readers that never load a torn or corrupted set (counted), and the file store."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch

redis = pytest.importorskip("redis", reason="needs the redis Python client")
pytest.importorskip("msgpack", reason="needs msgpack")

from _redis import needs_server  # noqa: E402

from ludic_fast.distributed.pipeline import PipelineKeys  # noqa: E402
from ludic_fast.distributed.publish import (  # noqa: E402
    RedisWeightPublisher,
    RedisWeightSubscriber,
    live_key,
    load_into,
    rechunk,
    safetensors_pieces,
)

pytestmark = pytest.mark.timeout(120)
W = torch.arange(6, dtype=torch.float32)  # the published tensor {"w": [0, 1, ..., 5]}


def _safetensors_bytes_by_hand() -> bytes:
    """The safetensors file of {"w": W}: u64 little-endian header length, the JSON header padded with spaces to
    a multiple of 8, then the 24 raw little-endian float32 bytes."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [6], "data_offsets": [0, 24]}}, separators=(",", ":"))
    header += " " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header.encode() + struct.pack("<6f", 0, 1, 2, 3, 4, 5)


def _stored_chunk_keys(client, keys: PipelineKeys) -> list[bytes]:
    return sorted(k for k in client.keys(f"{keys.weights}:*") if k != live_key(keys).encode())


def test_streamed_pieces_are_safetensors_own_file_and_rechunk_cuts_exactly():
    from safetensors.torch import save as st_save

    g = torch.Generator().manual_seed(0)
    params = {
        "w": torch.randn(3, 4, generator=g).t(),  # non-contiguous
        "h": torch.randn(5, generator=g).to(torch.bfloat16), "f": torch.randn(2, generator=g).half(),
        "i": torch.arange(4), "b": torch.tensor([True, False, True]), "s": torch.tensor(2.5),
        "e": torch.zeros(0, 3),
    }
    size, pieces = safetensors_pieces(params)
    blob = b"".join(bytes(p) for p in pieces)
    assert blob == st_save({k: v.contiguous() for k, v in params.items()}) and size == len(blob)
    assert safetensors_pieces({"w": W})[0] == 88 and b"".join(safetensors_pieces({"w": W})[1]) == (
        _safetensors_bytes_by_hand())
    assert list(rechunk(iter([b"abc", b"", memoryview(b"defgh"), b"i"]), 3)) == [b"abc", b"def", b"ghi"]
    assert list(rechunk(iter([b"abcd"]), 3)) == [b"abc", b"d"] and list(rechunk(iter([b""]), 3)) == []
    with pytest.raises(TypeError, match="dtype"):
        safetensors_pieces({"z": torch.zeros(2, dtype=torch.complex64)})


@needs_server
def test_notice_and_chunks_hold_the_hand_derived_bytes(redis_server):
    keys, client = PipelineKeys("n1"), redis.Redis.from_url(redis_server.url)
    blob = _safetensors_bytes_by_hand()
    assert len(blob) == 8 + 56 + 24  # the 55-byte header padded to 56
    RedisWeightPublisher(redis_server.url, keys=keys, part_bytes=40).publish({"w": W}, version=7)
    notice = client.hgetall(keys.weights)
    location = notice[b"location"].decode()
    assert location.startswith("n1:weights:7:")
    assert {k: notice[k] for k in (b"format", b"version", b"store", b"size", b"chunks", b"chunk_bytes")} == {
        b"format": b"3", b"version": b"7", b"store": b"redis", b"size": b"88", b"chunks": b"3", b"chunk_bytes": b"40"}
    assert notice[b"sha256"].decode() == hashlib.sha256(blob).hexdigest()
    assert sum(len(v) for v in notice.values()) < 200  # a notice, not the weights
    assert [client.get(f"{location}:{i}") for i in range(3)] == [blob[:40], blob[40:80], blob[80:]]
    got = []
    sub = RedisWeightSubscriber(redis_server.url, lambda s, v: got.append((s, v)), keys=keys)
    assert sub.poll() == 7 and sub.poll() is None
    assert len(got) == 1 and got[0][1] == 7 and torch.equal(got[0][0]["w"], W)
    assert sub.counters == {"loaded": 1}


@needs_server
def test_at_most_two_sets_alive_and_a_killed_publishers_orphan_is_deleted(redis_server):
    keys, client = PipelineKeys("n2"), redis.Redis.from_url(redis_server.url)
    pub = RedisWeightPublisher(redis_server.url, keys=keys, part_bytes=40)  # 3 chunks a set
    for v in range(1, 5):
        pub.publish({"w": W + v}, version=v)
        assert client.llen(live_key(keys)) == min(v, 2)
        assert len(_stored_chunk_keys(client, keys)) == 3 * min(v, 2)
    noticed = client.hget(keys.weights, "location").decode()
    assert {k.decode().rsplit(":", 1)[0] for k in _stored_chunk_keys(client, keys)} >= {noticed}
    assert not any(k.startswith(b"n2:weights:1:") or k.startswith(b"n2:weights:2:")
                   for k in _stored_chunk_keys(client, keys))

    calls = {"n": 0}
    real_call = pub.conn.call

    def dies_after_one_chunk(fn, what="redis command"):
        if what == "SET weight chunk":
            calls["n"] += 1
            if calls["n"] == 2:
                raise KeyboardInterrupt  # the learner killed mid-write
        return real_call(fn, what)

    pub.conn.call = dies_after_one_chunk
    with pytest.raises(KeyboardInterrupt):
        pub.publish({"w": W + 5}, version=5)
    assert client.hget(keys.weights, "version") == b"4"  # the notice still names the whole v4
    # v3 was deleted before v5's write began; v5's one written chunk is listed as alive
    orphan = [e for e in client.lrange(live_key(keys), 0, -1) if b"n2:weights:5:" in e]
    assert len(orphan) == 1 and len(_stored_chunk_keys(client, keys)) == 3 + 1
    fresh = RedisWeightPublisher(redis_server.url, keys=keys, part_bytes=40)  # the restarted learner
    fresh.publish({"w": W + 5}, version=5)
    assert client.llen(live_key(keys)) == 2 and len(_stored_chunk_keys(client, keys)) == 3 * 2
    assert orphan[0] not in client.lrange(live_key(keys), 0, -1)
    assert client.get(orphan[0].decode().split("|", 2)[2] + ":0") is None
    target = torch.nn.Module()
    target.register_buffer("w", torch.zeros(6))
    assert RedisWeightSubscriber(redis_server.url, load_into(target), keys=keys).poll() == 5
    assert torch.equal(target.w, W + 5)


@needs_server
def test_a_set_deleted_while_read_is_counted_torn_and_the_newest_loaded(redis_server):
    keys = PipelineKeys("n3")
    pub = RedisWeightPublisher(redis_server.url, keys=keys, part_bytes=40)
    pub.publish({"w": W + 1}, version=1)
    got = []
    sub = RedisWeightSubscriber(redis_server.url, lambda s, v: got.append((v, s["w"].clone())), keys=keys)
    real_get = sub.conn.call
    state = {"overtaken": False}

    def overtaken_mid_read(fn, what="redis command"):
        out = real_get(fn, what)
        if what == "GET weight chunk" and not state["overtaken"]:
            state["overtaken"] = True  # after the first chunk of v1: two publishes delete v1
            pub.publish({"w": W + 2}, version=2)
            pub.publish({"w": W + 3}, version=3)
        return out

    sub.conn.call = overtaken_mid_read
    assert sub.poll() == 3
    assert [v for v, _ in got] == [3] and torch.equal(got[0][1], W + 3)
    assert sub.counters == {"torn": 1, "loaded": 1}


@needs_server
def test_corrupted_bytes_are_refused_before_loading_and_not_read_again(redis_server):
    keys, client = PipelineKeys("n4"), redis.Redis.from_url(redis_server.url)
    pub = RedisWeightPublisher(redis_server.url, keys=keys, part_bytes=40)
    pub.publish({"w": W}, version=1)
    location = client.hget(keys.weights, "location").decode()
    last = bytearray(client.get(f"{location}:2"))
    last[-1] ^= 0x01  # one bit of the last float: still a valid safetensors file
    client.set(f"{location}:2", bytes(last))
    got = []
    sub = RedisWeightSubscriber(redis_server.url, lambda s, v: got.append(v), keys=keys)
    assert sub.poll() is None and sub.poll() is None and got == []
    assert sub.counters == {"checksum_mismatch": 1} and sub.version == -1
    pub.publish({"w": W}, version=2)
    assert sub.poll() == 2 and got == [2]


@needs_server
def test_a_notice_of_the_old_whole_blob_format_is_refused(redis_server):
    keys, client = PipelineKeys("n5"), redis.Redis.from_url(redis_server.url)
    client.hset(keys.weights, mapping={"version": 1, "parts": 1, "0": _safetensors_bytes_by_hand()})
    got = []
    sub = RedisWeightSubscriber(redis_server.url, lambda s, v: got.append(v), keys=keys)
    assert sub.poll() is None and got == [] and sub.counters == {"malformed": 1}


@needs_server
def test_file_store_sends_only_the_notice_through_redis(redis_server, tmp_path):
    keys, client = PipelineKeys("n6"), redis.Redis.from_url(redis_server.url)
    store = tmp_path / "weights"
    pub = RedisWeightPublisher(redis_server.url, keys=keys, store="file", store_dir=store)
    got = []
    sub = RedisWeightSubscriber(redis_server.url, lambda s, v: got.append((v, s["w"].clone())), keys=keys)
    for v in (1, 2, 3):
        pub.publish({"w": W + v}, version=v)
    assert _stored_chunk_keys(client, keys) == [] and len(list(store.iterdir())) == 2
    path = client.hget(keys.weights, "location").decode()
    assert path.startswith(str(store / "n6-v3-")) and open(path, "rb").read()[:8] == struct.pack("<Q", 56)
    assert sub.poll() == 3 and torch.equal(got[0][1], W + 3)
    with open(path, "r+b") as f:
        f.seek(-1, 2)
        f.write(b"\x00")
    pub.publish({"w": W + 4}, version=4)
    newest = client.hget(keys.weights, "location").decode()
    with open(newest, "r+b") as f:
        f.seek(-1, 2)
        f.write(b"\x01")
    assert sub.poll() is None and sub.counters["checksum_mismatch"] == 1 and sub.version == 3


@needs_server
def test_file_store_deletes_the_temporary_file_of_a_publisher_killed_mid_write(redis_server, tmp_path, monkeypatch):
    import ludic_fast.distributed.publish as publish

    store = tmp_path / "weights"
    pub = RedisWeightPublisher(redis_server.url, keys=PipelineKeys("n7"), store="file", store_dir=store)
    pub.publish({"w": W}, version=1)

    def killed(src, dst):
        raise KeyboardInterrupt  # the learner killed between writing and renaming

    monkeypatch.setattr(publish.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        pub.publish({"w": W + 2}, version=2)
    monkeypatch.undo()
    assert sorted(p.suffix for p in store.iterdir()) == [".safetensors", ".tmp"]
    pub.publish({"w": W + 3}, version=3)
    assert sorted(p.name.split("-")[1] for p in store.iterdir()) == ["v1", "v3"]


@needs_server
def test_bad_arguments_are_refused(redis_server, tmp_path):
    with pytest.raises(ValueError, match="store must be"):
        RedisWeightPublisher(redis_server.url, store="s3")
    with pytest.raises(ValueError, match="store_dir"):
        RedisWeightPublisher(redis_server.url, store="file")
    with pytest.raises(ValueError, match="store_dir"):
        RedisWeightPublisher(redis_server.url, store_dir=tmp_path)
    with pytest.raises(ValueError, match="part_bytes"):
        RedisWeightPublisher(redis_server.url, part_bytes=0)
    with pytest.raises(TypeError, match="params"):
        RedisWeightPublisher(redis_server.url).publish({"w": [1.0]}, version=0)
