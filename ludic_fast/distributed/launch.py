"""Running the engine on every rank of a `torchrun` launch: the process group from torchrun's environment
(gloo on the CPU, NCCL on CUDA, the same code), the model wrapped in DDP or sharded by FSDP2, each rank's
share of the data, and the decisions every rank must take at the same step (stop on a signal, give up on a
non-finite loss), agreed by an all-reduce.

    torchrun --nproc-per-node K -m ludic_fast.cli train --parallel ddp ...     (or --parallel fsdp2)

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; `init_from_env` reads them. Rank r of
W keeps items r, r + W, r + 2W, ... of each global batch (`rank_share`), so the union over the ranks is the
one-process batch and a checkpoint's data position does not depend on W.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ludic_fast.distributed.stats import collective_device
from ludic_fast.engine.stop import StopOnSignal

#: the values of `--parallel`
PARALLEL_MODES = ("ddp", "fsdp2")
T = TypeVar("T")


@dataclass(frozen=True)
class RankInfo:
    """This process's place in the launch: global rank, world size, rank on its machine."""

    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def torchrun_env(environ: Mapping[str, str] | None = None) -> RankInfo | None:
    """The RankInfo of torchrun's RANK / WORLD_SIZE / LOCAL_RANK, or None when WORLD_SIZE is unset; a value
    that is not a valid integer is a ValueError naming the variable."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" not in env:
        return None
    values = {}
    for name, default in (("WORLD_SIZE", None), ("RANK", None), ("LOCAL_RANK", "0")):
        text = env.get(name, default)
        if text is None or not text.isdigit():
            raise ValueError(f"{name}={text!r}: torchrun sets it to a non-negative integer")
        values[name] = int(text)
    info = RankInfo(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"])
    if info.world_size < 1 or info.rank >= info.world_size:
        raise ValueError(f"RANK={info.rank} must lie in [0, WORLD_SIZE={info.world_size})")
    return info


def backend_for(device: str | torch.device) -> str:
    """The collective backend of a device: NCCL for CUDA, gloo for the CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_from_env(device: str) -> tuple[RankInfo, str]:
    """Join the process group torchrun describes (`env://`) with `backend_for(device)`; a CUDA device becomes
    this rank's `cuda:LOCAL_RANK`. Returns (RankInfo, the rank's device)."""
    info = torchrun_env()
    if info is None:
        raise ValueError("no torchrun environment (WORLD_SIZE unset): launch with torchrun --nproc-per-node K")
    if torch.device(device).type == "cuda":
        device = f"cuda:{info.local_rank}"
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend_for(device), init_method="env://", rank=info.rank,
                                world_size=info.world_size)
    return info, device


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks of a transformers causal LM (`model.model.layers`, `transformer.h`, ...)."""
    for path in ("model.layers", "model.model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, nn.ModuleList):
            return list(obj)
    return []


def wrap_model(model: nn.Module, mode: str, device: str | torch.device, *,
               find_unused_parameters: bool = False) -> nn.Module:
    """`model` under DDP, or sharded by FSDP2 (`fully_shard` on each decoder block, then on the root) over all
    ranks. find_unused_parameters: DDP's, for a loss that leaves parameters out (a reward model's LM head)."""
    if mode not in PARALLEL_MODES:
        raise ValueError(f"mode must be one of {PARALLEL_MODES}, got {mode!r}")
    device = torch.device(device)
    model.to(device)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, find_unused_parameters=find_unused_parameters)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The module a DDP wrapper holds (it lacks `generate`); any other model itself."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


@contextlib.contextmanager
def full_parameters(model: nn.Module) -> Iterator[None]:
    """Sampling from an FSDP2 model: every FSDP unit's parameters gathered once on entry (collective) and kept
    whole through any number of forwards, so ranks may run different numbers of decoding steps; sharded again on
    exit (collective-free). A no-op for any other model."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
        unit.set_reshard_after_forward(False)
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(True)


def rank_share(items: Sequence[T], rank: int, world_size: int) -> list[T]:
    """Items rank, rank + W, rank + 2W, ... of a global batch: this rank's share."""
    return list(items[rank::world_size])


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_ranks(flag: bool) -> bool:
    """Whether `flag` holds on every rank (collective; the flag itself without a process group)."""
    if not _initialized():
        return flag
    t = torch.tensor([0 if flag else 1], dtype=torch.int64, device=collective_device(None))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t) == 0


def global_sum(value: float) -> float:
    """Σ over the ranks of `value` (collective; `value` itself without a process group)."""
    if not _initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=collective_device(None))
    dist.all_reduce(t)
    return float(t)


def global_max(value: float) -> float:
    """max over the ranks of `value` (collective; `value` itself without a process group)."""
    if not _initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=collective_device(None))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def average_gradients(params: Sequence[nn.Parameter]) -> None:
    """Average `.grad` over the ranks for parameters no wrapper reduces (a value head beside the model);
    a missing gradient counts as zero, so every rank joins the same collectives."""
    if not _initialized() or not params:
        return
    world = dist.get_world_size()
    dev = collective_device(None)
    for p in params:
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        buf = g.detach().to(dev)
        dist.all_reduce(buf)
        p.grad = (buf / world).to(p.device)


class EngineVersion:
    """The publisher of an in-process rollout engine that samples from the trainer's own model on every rank
    (transformers `generate` on the DDP module or the FSDP2 model): there is nothing to copy, so a push only
    moves the engine's policy version, on every rank (`every_rank`: the engine does not wrap it in
    Rank0Publisher)."""

    every_rank = True

    def __init__(self, engine: Any):
        self.engine = engine

    def publish(self, params: Mapping[str, torch.Tensor], version: int) -> None:
        del params
        self.engine.version = int(version)


class RankShareSource:
    """This rank's share (`rank_share`) of each SAWBatch of a batch source that serves the global batches;
    `num_samples` counts the share, the other batch values stay the global batch's. Its state is the inner
    source's, the same on every rank."""

    def __init__(self, inner: Any, rank: int, world_size: int):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must lie in [0, world_size={world_size}), got {rank}")
        self.inner, self.rank, self.world_size = inner, rank, world_size

    async def next_batch(self) -> Any:
        from ludic_fast.data.types import SAWBatch

        batch = await self.inner.next_batch()
        items = rank_share(batch.items, self.rank, self.world_size)
        return SAWBatch(items=items, meta={**batch.meta, "num_samples": len(items)})

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.inner.load_state_dict(state)


class AgreedStop(StopOnSignal):
    """StopOnSignal whose request every rank sees at the same step: each read of `requested` (the engine reads it
    once per step, every rank at the same point) all-reduces the signal numbers (MAX) and answers from that sum
    alone, so SIGINT sent to one rank stops all of them after the same step, each with that signal's exit code.
    A signal that lands while the all-reduce is in flight is counted at the next read, on every rank."""

    @property
    def requested(self) -> bool:
        if not _initialized():
            return self.signum is not None
        t = torch.tensor([self.signum or 0], dtype=torch.int64, device=collective_device(None))
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        agreed = int(t)
        if agreed:
            self.signum = agreed
        return agreed != 0


__all__ = [
    "PARALLEL_MODES",
    "AgreedStop",
    "EngineVersion",
    "RankInfo",
    "RankShareSource",
    "all_ranks",
    "average_gradients",
    "backend_for",
    "decoder_layers",
    "full_parameters",
    "global_max",
    "global_sum",
    "init_from_env",
    "rank_share",
    "torchrun_env",
    "unwrap",
    "wrap_model",
]
