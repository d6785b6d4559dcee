"""Weight publishing from the learner to pipeline actors through Redis (safetensors bytes, never pickle).

`RedisWeightPublisher.publish(params, version)` is the Trainer's publisher interface (Ludic's
`publisher.publish(params, version=step)`): it serialises the state dict with safetensors, splits the bytes
into parts of at most `part_bytes` (Redis strings are capped at 512 MB) and replaces the hash
`<prefix>:weights` = {version, parts, 0, 1, ...} in one MULTI/EXEC transaction, so a reader sees either the
old or the new weights, never a mix. `RedisWeightSubscriber.poll()` on the actor loads a newer version
into its model. Redis carries the weights of small policies;
for large ones on GPUs, publish to the rollout server's own weight-update path instead and keep Redis
for the items and the version number. On several learner ranks wrap the publisher in
`ludic_fast.distributed.rank0.Rank0Publisher`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from ludic_fast.distributed.pipeline import DEFAULT_KEYS, PipelineKeys
from ludic_fast.distributed.redis_conn import ReconnectingRedis

DEFAULT_PART_BYTES = 64 * 2**20


class RedisWeightPublisher:
    """Learner side: `publish(params, version)` stores the weights and their version under `keys.weights`."""

    def __init__(
        self,
        redis_url: str,
        *,
        keys: PipelineKeys = DEFAULT_KEYS,
        part_bytes: int = DEFAULT_PART_BYTES,
        retry_timeout_s: float = 120.0,
    ):
        if part_bytes < 1 or part_bytes > 512 * 2**20:
            raise ValueError(f"part_bytes must lie in [1, 512 MiB], got {part_bytes}")
        self.keys = keys
        self.part_bytes = part_bytes
        self.conn = ReconnectingRedis(redis_url, retry_timeout_s=retry_timeout_s)

    def publish(self, params: Mapping[str, Tensor], version: int) -> None:
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be a non-negative int, got {version!r}")
        if not isinstance(params, Mapping) or not all(isinstance(v, Tensor) for v in params.values()):
            raise TypeError("params must be a mapping of names to tensors")
        blob = st_save({k: v.detach().to("cpu").contiguous() for k, v in params.items()})
        parts = [blob[i : i + self.part_bytes] for i in range(0, len(blob), self.part_bytes)] or [b""]
        mapping: dict[str, bytes | int] = {"version": version, "parts": len(parts)}
        mapping.update({str(i): p for i, p in enumerate(parts)})

        def write(client):
            pipe = client.pipeline(transaction=True)
            pipe.delete(self.keys.weights)
            pipe.hset(self.keys.weights, mapping=mapping)
            return pipe.execute()

        self.conn.call(write, "publish weights")

    def close(self) -> None:
        self.conn.close()


class RedisWeightSubscriber:
    """Actor side: `poll()` returns the version now in use, loading newer published weights with
    `apply(state_dict, version)` first; None when nothing newer was published."""

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
        self.conn = ReconnectingRedis(redis_url, retry_timeout_s=retry_timeout_s)

    def poll(self) -> int | None:
        raw = self.conn.call(lambda c: c.hget(self.keys.weights, "version"), "HGET version")
        if raw is None or int(raw) <= self.version:
            return None
        data = self.conn.call(lambda c: c.hgetall(self.keys.weights), "HGETALL weights")  # one atomic snapshot
        version, n_parts = int(data[b"version"]), int(data[b"parts"])
        state = st_load(b"".join(data[str(i).encode()] for i in range(n_parts)))
        self.apply(state, version)
        self.version = version
        return version

    def close(self) -> None:
        self.conn.close()


def load_into(model: torch.nn.Module) -> Callable[[dict[str, Tensor], int], None]:
    """An `apply` callback that copies the published tensors into `model` (strict: names must match)."""

    def apply(state: dict[str, Tensor], version: int) -> None:
        with torch.no_grad():
            model.load_state_dict(state, strict=True)

    return apply

