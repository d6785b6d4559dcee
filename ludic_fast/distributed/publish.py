"""Weight publishing from the learner to pipeline actors: a small notice through Redis, the bytes in bounded
chunks (or a file on a shared disk), a SHA-256 checksum checked before anything is loaded. Never pickle.

`RedisWeightPublisher.publish(params, version)` is the Trainer's publisher interface (Ludic's
`publisher.publish(params, version=step)`). It writes the state dict's safetensors bytes as they are produced,
one tensor's CPU copy at a time (never the whole file in memory), to one of two places:

- `store="redis"` (default): chunks of at most `part_bytes` bytes, each its own Redis string
  `<prefix>:weights:<version>:<token>:<i>` (`token` is new on every publish, so two publishes never share a key);
- `store="file"`: one file `<store_dir>/<prefix>-v<version>-<token>.safetensors` on a disk every actor reads
  (written under a temporary name, then renamed), and only the notice goes through Redis.

Then it replaces the notice, the small hash `<prefix>:weights` = {format, version, store, location, size,
sha256, chunks, chunk_bytes}, in one MULTI/EXEC (the learner's staleness check reads its `version` field).
Back-pressure: before writing version v+1 it deletes every stored set but the one the notice points to, so at
most two sets are alive (the noticed one and the one being written) and a reader of the previous set has a
whole publish interval to finish. A publisher killed mid-write leaves its set listed in `<prefix>:weights:live`,
and the next publish deletes it.

`RedisWeightSubscriber.poll()` on the actor reads the notice and, for a newer version, the bytes; it loads
them only when their size and SHA-256 match the notice. A set deleted under the reader (a missing chunk or
file: a newer publish overtook it) is counted as `counters["torn"]` and the poll starts again from the new
notice; bytes that do not match their checksum are counted as `counters["checksum_mismatch"]` and never loaded
(that notice is not read again); `counters["loaded"]` counts the versions applied. On several learner ranks
wrap the publisher in `ludic_fast.distributed.rank0.Rank0Publisher`. To a vLLM server the weights go by
`ludic_fast.rollout.vllm_server.VLLMServerSampler.publish` instead (NCCL or a reload from disk).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from torch import Tensor

from ludic_fast.distributed.pipeline import DEFAULT_KEYS, PipelineKeys
from ludic_fast.distributed.redis_conn import ReconnectingRedis

log = logging.getLogger(__name__)

DEFAULT_PART_BYTES = 16 * 2**20
NOTICE_FORMAT = 3  # 1-2: the whole blob in the `<prefix>:weights` hash; 3: this notice
STORES = ("redis", "file")
_MAX_RESTARTS = 8  # polls restarted after a set was deleted under the reader, before giving up until the next poll


def live_key(keys: PipelineKeys) -> str:
    """The Redis list of the stored weight sets (`<store>|<chunks>|<location>`) not yet deleted."""
    return f"{keys.weights}:live"


def chunk_key(location: str, index: int) -> str:
    """The Redis key of chunk `index` of the set stored at `location`."""
    return f"{location}:{index}"


#: safetensors' dtype codes of the tensors a publish carries, in the order safetensors lays tensors out
SAFETENSORS_DTYPES = {
    torch.int64: "I64", torch.float64: "F64", torch.float32: "F32", torch.int32: "I32", torch.bfloat16: "BF16",
    torch.float16: "F16", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
_DTYPE_RANK = {dtype: rank for rank, dtype in enumerate(SAFETENSORS_DTYPES)}


def safetensors_pieces(params: Mapping[str, Tensor]) -> tuple[int, Iterator[bytes | memoryview]]:
    """The safetensors file of `params`, piece by piece: (its size, an iterator over the 8-byte little-endian
    header length, the JSON header padded with spaces to a multiple of 8, then each tensor's raw bytes), in
    safetensors' own order (by dtype as `SAFETENSORS_DTYPES` lists them, then by name), so for ASCII names the
    joined pieces equal `safetensors.torch.save(params)` byte for byte (other names are JSON-escaped, which
    safetensors reads alike). Only one tensor's CPU copy exists at a time."""
    if not isinstance(params, Mapping) or not all(isinstance(v, Tensor) for v in params.values()):
        raise TypeError("params must be a mapping of names to tensors")
    bad = sorted(k for k, v in params.items() if v.dtype not in SAFETENSORS_DTYPES)
    if bad:
        raise TypeError(f"params: {bad[0]!r} has dtype {params[bad[0]].dtype}, not one safetensors stores here")
    names = sorted(params, key=lambda k: (_DTYPE_RANK[params[k].dtype], k))
    header, offset = {}, 0
    for name in names:
        t = params[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":"))
    text += " " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text.encode()

    def pieces() -> Iterator[bytes | memoryview]:
        yield head
        for name in names:
            with torch.no_grad():
                t = params[name].detach().to("cpu").contiguous()
            if t.numel():
                yield memoryview(t.reshape(-1).view(torch.uint8).numpy())  # no copy; the array keeps t alive

    return len(head) + offset, pieces()


def rechunk(pieces: Iterator[bytes | memoryview], size: int) -> Iterator[bytes]:
    """The concatenation of `pieces` cut into chunks of `size` bytes (the last one shorter; none when empty)."""
    buf = bytearray()
    for piece in pieces:
        view = memoryview(piece)
        while len(view):
            take = min(size - len(buf), len(view))
            buf += view[:take]
            view = view[take:]
            if len(buf) == size:
                yield bytes(buf)
                buf = bytearray()
    if buf:
        yield bytes(buf)


class RedisWeightPublisher:
    """Learner side: `publish(params, version)` stores the weights (`store="redis"`: chunks of `part_bytes`;
    `store="file"`: a file in `store_dir`) and then the notice `keys.weights`."""

    def __init__(
        self,
        redis_url: str,
        *,
        keys: PipelineKeys = DEFAULT_KEYS,
        part_bytes: int = DEFAULT_PART_BYTES,
        store: str = "redis",
        store_dir: str | os.PathLike | None = None,
        retry_timeout_s: float = 120.0,
    ):
        if isinstance(part_bytes, bool) or not isinstance(part_bytes, int) or not 1 <= part_bytes <= 512 * 2**20:
            raise ValueError(f"part_bytes must be an int in [1, 512 MiB], got {part_bytes!r}")
        if store not in STORES:
            raise ValueError(f"store must be one of {STORES}, got {store!r}")
        if (store == "file") != (store_dir is not None):
            raise ValueError("store_dir: give it with store='file' (a folder every actor can read), and only then")
        self.keys = keys
        self.part_bytes = part_bytes
        self.store = store
        self.store_dir = None if store_dir is None else Path(store_dir)
        if self.store_dir is not None:
            self.store_dir.mkdir(parents=True, exist_ok=True)
        self.conn = ReconnectingRedis(redis_url, retry_timeout_s=retry_timeout_s)

    def publish(self, params: Mapping[str, Tensor], version: int) -> None:
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be a non-negative int, got {version!r}")
        size, pieces = safetensors_pieces(params)
        self._drop_all_but_noticed()
        token = uuid.uuid4().hex[:12]
        if self.store == "redis":
            location = f"{self.keys.weights}:{version}:{token}"
            chunks = max(1, -(-size // self.part_bytes))
        else:
            location = str(self.store_dir / f"{self.keys.prefix}-v{version}-{token}.safetensors")
            chunks = 1
        entry = f"{self.store}|{chunks}|{location}"
        self.conn.call(lambda c: c.rpush(live_key(self.keys), entry), "RPUSH live")  # listed before written
        digest = hashlib.sha256()
        if self.store == "redis":
            for i, part in enumerate(rechunk(pieces, self.part_bytes)):
                digest.update(part)
                self.conn.call(lambda c, i=i, part=part: c.set(chunk_key(location, i), part), "SET weight chunk")
        else:
            tmp = Path(location + ".tmp")
            with open(tmp, "wb") as f:
                for piece in pieces:
                    digest.update(piece)
                    f.write(piece)
            os.replace(tmp, location)
        notice = {
            "format": NOTICE_FORMAT, "version": version, "store": self.store, "location": location,
            "size": size, "sha256": digest.hexdigest(), "chunks": chunks,
            "chunk_bytes": self.part_bytes,
        }

        def write(client):
            pipe = client.pipeline(transaction=True)
            pipe.delete(self.keys.weights)
            pipe.hset(self.keys.weights, mapping=notice)
            return pipe.execute()

        self.conn.call(write, "publish weights notice")

    def _drop_all_but_noticed(self) -> None:
        """Delete every stored set except the one the notice points to (readers of a deleted set restart)."""
        noticed = self.conn.call(lambda c: c.hget(self.keys.weights, "location"), "HGET location")
        for raw in self.conn.call(lambda c: c.lrange(live_key(self.keys), 0, -1), "LRANGE live"):
            store, chunks, location = raw.decode().split("|", 2)
            if noticed is not None and location == noticed.decode():
                continue
            if store == "redis":
                keys = [chunk_key(location, i) for i in range(int(chunks))]
                for start in range(0, len(keys), 1024):
                    self.conn.call(lambda c, k=keys[start : start + 1024]: c.unlink(*k), "UNLINK weight chunks")
            else:  # and the temporary file of a publisher killed mid-write
                Path(location).unlink(missing_ok=True)
                Path(location + ".tmp").unlink(missing_ok=True)
            self.conn.call(lambda c, raw=raw: c.lrem(live_key(self.keys), 0, raw), "LREM live")

    def close(self) -> None:
        self.conn.close()


class _SetGone(Exception):
    """A chunk or file of the noticed set is missing: a newer publish deleted it while it was read."""


class RedisWeightSubscriber:
    """Actor side: `poll()` returns the version now in use, loading newer published weights with
    `apply(state_dict, version)` first (only after their checksum matched); None when nothing newer was loaded.
    `counters`: "loaded", "torn" (set deleted while read; the poll restarted), "checksum_mismatch" (refused),
    "malformed" (a notice of another format, refused)."""

    def __init__(
        self,
        redis_url: str,
        apply: Callable[[dict[str, Tensor], int], None],
        *,
        keys: PipelineKeys = DEFAULT_KEYS,
        retry_timeout_s: float = 120.0,
    ):
        self.keys = keys
        self.apply = apply
        self.version = -1
        self.counters: Counter[str] = Counter()
        self._refused: tuple[bytes, ...] | None = None  # the last notice refused, not read again
        self.conn = ReconnectingRedis(redis_url, retry_timeout_s=retry_timeout_s)

    def poll(self) -> int | None:
        for _ in range(_MAX_RESTARTS):
            notice = self.conn.call(lambda c: c.hgetall(self.keys.weights), "HGETALL notice")
            if not notice or int(notice[b"version"]) <= self.version:
                return None
            ident = tuple(notice.get(f, b"") for f in (b"version", b"location", b"sha256"))
            if ident == self._refused:
                return None
            if notice.get(b"format") != str(NOTICE_FORMAT).encode():
                return self._refuse(ident, "malformed", f"notice format {notice.get(b'format')!r}, not {NOTICE_FORMAT}")
            try:
                blob = self._read(notice)
            except _SetGone:
                self.counters["torn"] += 1
                log.info("weights v%s were deleted while read (a newer publish); reading the new notice",
                         notice[b"version"].decode())
                continue
            if len(blob) != int(notice[b"size"]) or hashlib.sha256(blob).hexdigest() != notice[b"sha256"].decode():
                return self._refuse(ident, "checksum_mismatch", "size or sha256 differs from the notice; not loaded")
            version = int(notice[b"version"])
            self.apply(st_load(blob), version)
            self.version = version
            self.counters["loaded"] += 1
            return version
        return None

    def _refuse(self, ident: tuple[bytes, ...], counter: str, why: str) -> None:
        self.counters[counter] += 1
        self._refused = ident
        log.warning("weights v%s refused: %s", ident[0].decode(), why)
        return None

    def _read(self, notice: dict[bytes, bytes]) -> bytes:
        location = notice[b"location"].decode()
        if notice[b"store"] == b"file":
            try:
                return Path(location).read_bytes()
            except FileNotFoundError:
                raise _SetGone(location) from None
        parts = []
        for i in range(int(notice[b"chunks"])):
            part = self.conn.call(lambda c, i=i: c.get(chunk_key(location, i)), "GET weight chunk")
            if part is None:
                raise _SetGone(location)
            parts.append(part)
        return b"".join(parts)

    def close(self) -> None:
        self.conn.close()


def load_into(model: torch.nn.Module) -> Callable[[dict[str, Tensor], int], None]:
    """An `apply` callback that copies the published tensors into `model` (strict: names must match)."""

    def apply(state: dict[str, Tensor], version: int) -> None:
        with torch.no_grad():
            model.load_state_dict(state, strict=True)

    return apply
