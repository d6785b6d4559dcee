"""Sharded checkpoints: `torch.distributed.checkpoint` (DCP), every rank writing its own shards, readable by any
number of ranks (resharding on load), and the plain Hugging Face export at the end of a run.

Layout of `output_dir/step_{step:06d}/`:
    .metadata, __{rank}_0.distcp   DCP: {"model": the model's state dict, "optimizer": the optimizer's}, keyed by
                                   parameter names without wrapper prefixes (DDP's `module.`; FSDP2 shards are
                                   DTensors), so a checkpoint of K ranks loads on K' ranks, DDP, FSDP2 or none
    trainer_state.json             {"step", "world_size", **metadata} (scheduler, data position, ...), rank 0
    tensors.safetensors            extra tensors that every rank holds alike (value head, reference), rank 0
    rng_rank{r}.safetensors        rank r's RNG tensors (keys `rng.*`); a rank beyond the saved world starts
                                   from its own generators
and `output_dir/latest.json`, as `run.checkpoint.CheckpointManager` (whose discovery, resolution and pruning
this reuses). Parameters outside the model (a reward model's value head, `extra`) travel in the DCP state as
`extra.{i}` with their optimizer state.

Atomicity: the ranks write into `.tmp-step_XXXXXX` (a fixed name, as every rank must find it without pickling
a name across the group), a barrier, rank 0 fsyncs, renames it into place and replaces latest.json, a barrier.
Every rank must see the same `output_dir` (one machine, or a shared file system). Loading reads DCP's tensor
files, safetensors and JSON: nothing is unpickled.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ludic_fast.run.atomic_io import atomic_write_json
from ludic_fast.run.checkpoint import _TMP_PREFIX, CheckpointConfig, CheckpointManager, _fsync_dir

#: keys of the per-rank tensors (RNG states)
RANK_PREFIX = "rng."


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_world() -> tuple[int, int]:
    if _initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: that is the intent here."""
    with warnings.catch_warnings():
        if not _initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier() -> None:
    if _initialized():
        dist.barrier()


def _container(model: nn.Module, extra: Sequence[nn.Parameter]) -> nn.Module:
    """One module holding the model (`model.*`) and the parameters outside it (`extra.{i}`), so the optimizer's
    parameters all have names."""
    return nn.ModuleDict({"model": model, "extra": nn.ParameterList(list(extra))})


class ShardedCheckpointManager(CheckpointManager):
    """Saves and loads DCP checkpoints under `cfg.output_dir` (module docstring). Collective under
    torch.distributed: every rank calls `save` / `load` with its own model shards; works in one process too.
    extra: trainable parameters outside the model (a value head), saved and restored with the model."""

    def __init__(self, cfg: CheckpointConfig, *, extra: Sequence[nn.Parameter] = ()):
        super().__init__(cfg)
        self.extra = list(extra)

    def save(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        step: int,
        metadata: Mapping[str, Any] | None = None,
        tensors: Mapping[str, torch.Tensor] | None = None,
    ) -> Path:
        rank, world = _rank_world()
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f"{_TMP_PREFIX}{step:06d}"
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(_TMP_PREFIX + "*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        _barrier()
        holder = _container(model, self.extra)
        with_optim = optimizer is not None and self.cfg.save_optimizer
        if with_optim:
            model_sd, optim_sd = get_state_dict(holder, optimizer)
            state = {"model": model_sd, "optimizer": optim_sd}
        else:
            state = {"model": get_model_state_dict(holder)}
        with _single_process_quiet():
            dcp.save(state, checkpoint_id=str(tmp), no_dist=not _initialized())
        tensors = dict(tensors or {})
        mine = {k: v.detach().contiguous().cpu() for k, v in tensors.items() if k.startswith(RANK_PREFIX)}
        if mine:
            save_file(mine, str(tmp / f"rng_rank{rank}.safetensors"))
        if rank == 0:
            shared = {k: v.detach().contiguous().cpu() for k, v in tensors.items() if not k.startswith(RANK_PREFIX)}
            if shared:
                save_file(shared, str(tmp / "tensors.safetensors"))
            state_json = {**(metadata or {}), "step": step, "world_size": world, "optimizer_saved": with_optim}
            (tmp / "trainer_state.json").write_text(json.dumps(state_json, sort_keys=True), encoding="utf-8")
        _barrier()
        if rank == 0:
            for path in tmp.iterdir():
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
            _fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
            atomic_write_json(self.root / "latest.json", {"last_checkpoint": final.name, "step": step})
            self._prune()
        _barrier()
        return final

    def load(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        step: int | None = None,
        path: str | os.PathLike[str] | None = None,
    ) -> dict[str, Any]:
        """Restore the model, the parameters in `extra` and the optimizer from the resolved checkpoint (resharded
        to this run's ranks); returns trainer_state.json (`{"step": 0}` without a checkpoint) with this rank's
        RNG tensors and the shared ones under `"tensors"`."""
        ckpt = self.resolve(step=step, path=path)
        if ckpt is None:
            return {"step": 0}
        if not (ckpt / ".metadata").is_file():
            raise ValueError(f"checkpoint {ckpt} is not a sharded (torch.distributed.checkpoint) checkpoint")
        state = json.loads((ckpt / "trainer_state.json").read_text(encoding="utf-8"))
        holder = _container(model, self.extra)
        with_optim = optimizer is not None and state.get("optimizer_saved", False)
        if with_optim:
            model_sd, optim_sd = get_state_dict(holder, optimizer)
            target = {"model": model_sd, "optimizer": optim_sd}
        else:
            target = {"model": get_model_state_dict(holder)}
        with _single_process_quiet():
            dcp.load(target, checkpoint_id=str(ckpt), no_dist=not _initialized())
        if with_optim:
            set_state_dict(holder, optimizer, model_state_dict=target["model"], optim_state_dict=target["optimizer"])
        else:
            set_model_state_dict(holder, target["model"])
        rank, _ = _rank_world()
        tensors: dict[str, torch.Tensor] = {}
        for name in ("tensors.safetensors", f"rng_rank{rank}.safetensors"):
            if (ckpt / name).is_file():
                tensors.update(load_file(str(ckpt / name)))
        state["tensors"] = tensors
        state["path"] = str(ckpt)
        return state


def export_hf(model: nn.Module, path: str | os.PathLike[str], tokenizer: Any = None) -> Path | None:
    """Write a plain Hugging Face model directory (`save_pretrained`: config.json + model.safetensors, and the
    tokenizer when given) of a model that may be DDP-wrapped or FSDP2-sharded: the full state dict is gathered
    (collective: every rank calls it) and rank 0 writes. Returns the path on rank 0, None elsewhere."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    rank, _ = _rank_world()
    out = None
    if rank == 0:
        inner = model.module if isinstance(getattr(model, "module", None), nn.Module) else model
        if not callable(getattr(inner, "save_pretrained", None)):
            raise TypeError(f"export_hf needs a transformers model (save_pretrained), got {type(inner).__name__}")
        out = Path(path)
        inner.save_pretrained(out, state_dict=full)
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
    _barrier()
    return out


__all__ = ["ShardedCheckpointManager", "export_hf"]
