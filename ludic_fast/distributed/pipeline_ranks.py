"""The pipeline learner on every rank of a torchrun launch: rank 0 alone reads the Redis stream (one consumer of
the group, as a one-process learner) and broadcasts each global batch; every rank trains its `rank_share`.

    torchrun --nproc-per-node K examples/pipeline_rl/learner.py --parallel ddp ...

The batch crosses the process group as bytes: the items' msgpack payloads (`pipeline.encode_item`, decoded with
`pipeline.decode_item`; nothing is unpickled) and the batch meta, in a uint8 tensor after its int64 length
(-1: rank 0 stopped waiting for a batch, every rank raises StopRequested). Rank 0's source alone holds the
delivered ids and the unacknowledged entries, so the checkpoint's batch-source state (written by rank 0) is the
one-process learner's, and a checkpoint of K ranks resumes on any K' with every item trained once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from ludic_fast.data.types import SAWBatch
from ludic_fast.distributed.launch import rank_share
from ludic_fast.distributed.pipeline import PipelineBatchSource, StopRequested, decode_item, encode_item
from ludic_fast.distributed.stats import collective_device

_STOPPED = -1


def encode_batch(batch: SAWBatch) -> bytes:
    """msgpack bytes of a pipeline batch: its items' payloads and its meta."""
    payloads = [encode_item(i, item_id=i.meta["item_id"], policy_version=i.meta["policy_version"])
                for i in batch.items]
    return msgpack.packb({"items": payloads, "meta": dict(batch.meta)}, use_bin_type=True)


def decode_batch(data: bytes) -> SAWBatch:
    """Inverse of `encode_batch`."""
    body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    return SAWBatch(items=[decode_item(p) for p in body["items"]], meta=body["meta"])


class BroadcastBatchSource:
    """Each rank's share of the global batches that rank 0's PipelineBatchSource `inner` reads (None on the other
    ranks). `next_batch` is collective: every rank calls it at the same step, as the Trainer does. State and
    acknowledgements are rank 0's (`state_dict` is {} elsewhere, and `load_state_dict` is ignored there)."""

    def __init__(self, inner: PipelineBatchSource | None, rank: int, world_size: int):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must lie in [0, world_size={world_size}), got {rank}")
        if (inner is None) != (rank != 0):
            raise ValueError(f"inner must be a PipelineBatchSource on rank 0 and None elsewhere (rank {rank})")
        self.inner, self.rank, self.world_size = inner, rank, world_size

    def _broadcast(self, data: bytes | None) -> bytes | None:
        """Rank 0's bytes (None: stopped) on every rank."""
        if self.world_size == 1:
            return data
        dev = collective_device(None)
        size = torch.tensor([_STOPPED if data is None else len(data)], dtype=torch.int64, device=dev)
        dist.broadcast(size, src=0)
        if int(size) == _STOPPED:
            return None
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev) if self.rank == 0
               else torch.empty(int(size), dtype=torch.uint8, device=dev))
        dist.broadcast(buf, src=0)
        return data if self.rank == 0 else buf.cpu().numpy().tobytes()

    def next_batch_sync(self) -> SAWBatch:
        data, stopped = None, None
        if self.inner is not None:
            try:
                data = encode_batch(self.inner.next_batch_sync())
            except StopRequested as exc:
                stopped = exc
        data = self._broadcast(data)
        if data is None:
            raise stopped or StopRequested("rank 0 stopped waiting for a batch")
        batch = decode_batch(data)
        items = rank_share(batch.items, self.rank, self.world_size)
        # counts are the share's (the stats reduction sums them over the ranks), the other values the batch's
        return SAWBatch(items=items, meta={**batch.meta, "num_samples": len(items), "target_rollouts": len(items)})

    async def next_batch(self) -> SAWBatch:
        return await asyncio.to_thread(self.next_batch_sync)

    def state_dict(self) -> dict[str, Any]:
        return {} if self.inner is None else self.inner.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.inner is not None:
            self.inner.load_state_dict(dict(state))

    def checkpoint_saved(self) -> None:
        if self.inner is not None:
            self.inner.checkpoint_saved()


__all__ = ["BroadcastBatchSource", "decode_batch", "encode_batch"]
