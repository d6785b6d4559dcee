"""Atomic, pickle-free checkpoints: safetensors model + optimizer, JSON trainer state.

Layout of `output_dir/step_{step:06d}/`:
    model.safetensors       the model's state dict (shared/tied tensors stored once; `safetensors.torch.save_model`)
    config.json             the transformers config, when the model has one
    optimizer.safetensors   every tensor of `optimizer.state_dict()["state"]`, keyed `state.{param}.{name}`
    optimizer.json          the rest of the optimizer state (param_groups, non-tensor state values)
    tensors.safetensors     extra named tensors of the trainer (RNG states, reference model, ...)
    trainer_state.json      {"step": step, **metadata} (scheduler, curriculum history, batch source, ...)
and `output_dir/latest.json = {"last_checkpoint": "step_XXXXXX", "step": step}`.

Atomicity: a checkpoint is written into a hidden temp directory beside the final one, every file and
the directory are fsync'ed, then the directory is renamed into place (`os.rename`, atomic on POSIX) and
the parent fsync'ed; `latest.json` is replaced atomically afterwards. A process killed at any moment
leaves the previous checkpoints intact; a leftover temp directory is ignored and removed by the next
save. Loading resolves, in order: an explicit path, `step_{step:06d}`, `latest.json` (if its directory
exists), the highest complete `step_*`. Loading reads only safetensors and JSON: it never unpickles.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import nn

from ludic_fast.run.atomic_io import atomic_write_json

_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp-step_"


@dataclass
class CheckpointConfig:
    """Where and how often to checkpoint: every `every_n_steps` (0 = only explicit saves), keep the newest
    `max_to_keep` (None = all), with the optimizer state unless `save_optimizer=False`. sharded: the engine
    writes `run.sharded_checkpoint`'s format (each rank its shards) instead of this module's whole-model files;
    None = sharded exactly when the model is data-parallel (DDP / FSDP)."""

    output_dir: str
    every_n_steps: int = 0
    max_to_keep: int | None = 2
    save_optimizer: bool = True
    sharded: bool | None = None

    def __post_init__(self) -> None:
        if self.every_n_steps < 0:
            raise ValueError(f"every_n_steps must be >= 0, got {self.every_n_steps}")
        if self.max_to_keep is not None and self.max_to_keep < 1:
            raise ValueError(f"max_to_keep must be None or >= 1, got {self.max_to_keep}")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _write_json(path: Path, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, sort_keys=True)


# ------------------------------------------------------------------------------ optimizer <-> files
def _is_tensor_list(value: Any) -> bool:
    """A list holding tensors and empty slots (LBFGS's `al` starts as [None] * history_size)."""
    return (isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value)
            and all(v is None or isinstance(v, torch.Tensor) for v in value))


def _json_ready(value: Any, where: str) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"optimizer state {where} = {type(value).__name__} cannot be checkpointed: only tensors, "
                        "lists of tensors and JSON values (numbers, strings, bools, None, lists, dicts) can") from exc
    return value


def optimizer_to_flat(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split `optimizer.state_dict()` into safetensors-ready tensors and a JSON-ready rest: a tensor is
    `state.{pid}.{name}`, a list of tensors and Nones (LBFGS's history) `list.{pid}.{name}.{i}` with which
    slots hold a tensor in the rest, every other value JSON (TypeError naming it otherwise)."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    lists: dict[str, dict[str, list[bool]]] = {}
    for pid, pstate in state["state"].items():
        for name, value in pstate.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{pid}.{name}"] = value.detach().contiguous().cpu()
            elif _is_tensor_list(value):
                for i, item in enumerate(value):
                    if item is not None:
                        tensors[f"list.{pid}.{name}.{i}"] = item.detach().contiguous().cpu()
                lists.setdefault(str(pid), {})[name] = [item is not None for item in value]
            else:
                scalars.setdefault(str(pid), {})[name] = _json_ready(value, f"[{pid}][{name!r}]")
    return tensors, {
        "param_groups": state["param_groups"],
        "scalars": scalars,
        "tensor_lists": lists,
        "param_ids": [str(p) for p in state["state"]],
    }


def optimizer_from_flat(tensors: Mapping[str, torch.Tensor], rest: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of `optimizer_to_flat` (parameter ids back to ints)."""
    state: dict[int, dict[str, Any]] = {int(p): {} for p in rest["param_ids"]}
    for key, value in tensors.items():
        kind, pid, name = key.split(".", 2)
        if kind == "state":
            state.setdefault(int(pid), {})[name] = value
    for pid, names in rest.get("tensor_lists", {}).items():
        for name, filled in names.items():
            state.setdefault(int(pid), {})[name] = [tensors[f"list.{pid}.{name}.{i}"] if full else None
                                                    for i, full in enumerate(filled)]
    for pid, values in rest["scalars"].items():
        state.setdefault(int(pid), {}).update(values)
    groups = [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()}
              for g in rest["param_groups"]]  # JSON turned tuples (betas) into lists
    return {"state": state, "param_groups": groups}


class CheckpointManager:
    """Saves and loads checkpoints under `cfg.output_dir` (layout and guarantees in the module docstring)."""

    def __init__(self, cfg: CheckpointConfig):
        self.cfg = cfg
        self.root = Path(cfg.output_dir)

    # ----------------------------------------------------------------------------------------- paths
    def checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints as (step, dir), oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for child in self.root.iterdir():
            m = _STEP_DIR.match(child.name)
            if m and child.is_dir():
                found.append((int(m.group(1)), child))
        return sorted(found)

    def resolve(self, step: int | None = None, path: str | os.PathLike[str] | None = None) -> Path | None:
        """The checkpoint directory to load (explicit path, step, latest.json, highest step), or None."""
        if path is not None:
            p = Path(path)
            if not p.is_dir():
                raise FileNotFoundError(f"checkpoint path {p} does not exist")
            return p
        if step is not None:
            p = self.root / f"step_{int(step):06d}"
            if not p.is_dir():
                raise FileNotFoundError(f"no checkpoint for step {step} under {self.root}")
            return p
        latest = self.root / "latest.json"
        if latest.is_file():
            name = json.loads(latest.read_text(encoding="utf-8")).get("last_checkpoint")
            if name and (self.root / name).is_dir():
                return self.root / name
        ckpts = self.checkpoints()
        return ckpts[-1][1] if ckpts else None

    def latest_step(self) -> int | None:
        """The step of the checkpoint `resolve()` loads by default, or None when there is none."""
        ckpt = self.resolve()
        m = None if ckpt is None else _STEP_DIR.match(ckpt.name)
        return None if m is None else int(m.group(1))

    # ------------------------------------------------------------------------------------------ save
    def maybe_save(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        step: int,
        state: Callable[[], tuple[Mapping[str, Any], Mapping[str, torch.Tensor]]] | None = None,
    ) -> Path | None:
        """`save` when `every_n_steps > 0` and `step % every_n_steps == 0`; `state()` gives its (metadata,
        tensors) and is called only then (building them copies state a step does not need otherwise)."""
        if self.cfg.every_n_steps > 0 and step % self.cfg.every_n_steps == 0:
            metadata, tensors = state() if state is not None else ({}, {})
            return self.save(model, optimizer, step=step, metadata=metadata, tensors=tensors)
        return None

    def save(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        step: int,
        metadata: Mapping[str, Any] | None = None,
        tensors: Mapping[str, torch.Tensor] | None = None,
    ) -> Path:
        """Write `step_{step:06d}` atomically, update latest.json, prune beyond max_to_keep."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(_TMP_PREFIX + "*"):
            shutil.rmtree(stale, ignore_errors=True)
        final = self.root / f"step_{step:06d}"
        tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{step:06d}-", dir=self.root))
        try:
            self._write(tmp, model, optimizer, step, metadata or {}, tensors or {})
            _fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        atomic_write_json(self.root / "latest.json", {"last_checkpoint": final.name, "step": step})
        self._prune()
        return final

    def _write(
        self,
        out: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        step: int,
        metadata: Mapping[str, Any],
        tensors: Mapping[str, torch.Tensor],
    ) -> None:
        inner = model.module if isinstance(getattr(model, "module", None), nn.Module) else model
        save_model(inner, str(out / "model.safetensors"))
        written = [out / "model.safetensors"]
        config = getattr(inner, "config", None)
        if config is not None and hasattr(config, "to_json_string"):
            (out / "config.json").write_text(config.to_json_string(), encoding="utf-8")
            written.append(out / "config.json")
        if optimizer is not None and self.cfg.save_optimizer:
            opt_tensors, rest = optimizer_to_flat(optimizer.state_dict())
            save_file(opt_tensors, str(out / "optimizer.safetensors"))
            _write_json(out / "optimizer.json", rest)
            written += [out / "optimizer.safetensors", out / "optimizer.json"]
        if tensors:
            save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(out / "tensors.safetensors"))
            written.append(out / "tensors.safetensors")
        _write_json(out / "trainer_state.json", {**metadata, "step": step})
        written.append(out / "trainer_state.json")
        for path in written:
            _fsync_file(path)

    def _prune(self) -> None:
        if self.cfg.max_to_keep is None:
            return
        ckpts = self.checkpoints()
        for _, path in ckpts[: max(0, len(ckpts) - self.cfg.max_to_keep)]:
            shutil.rmtree(path, ignore_errors=True)

    # ------------------------------------------------------------------------------------------ load
    def load(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        step: int | None = None,
        path: str | os.PathLike[str] | None = None,
    ) -> dict[str, Any]:
        """Restore model (and optimizer) from the resolved checkpoint; returns trainer_state.json
        (`{"step": 0}` when there is no checkpoint). Extra tensors are under the key `"tensors"`."""
        ckpt = self.resolve(step=step, path=path)
        if ckpt is None:
            return {"step": 0}
        inner = model.module if isinstance(getattr(model, "module", None), nn.Module) else model
        missing, unexpected = load_model(inner, str(ckpt / "model.safetensors"), strict=False)
        if unexpected or [k for k in missing if not _is_tied_alias(inner, k)]:
            raise ValueError(f"checkpoint {ckpt} does not match the model: missing={missing}, unexpected={unexpected}")
        if optimizer is not None and (ckpt / "optimizer.safetensors").is_file():
            rest = json.loads((ckpt / "optimizer.json").read_text(encoding="utf-8"))
            optimizer.load_state_dict(optimizer_from_flat(load_file(str(ckpt / "optimizer.safetensors")), rest))
        state_path = ckpt / "trainer_state.json"
        state = json.loads(state_path.read_text(encoding="utf-8")) if state_path.is_file() else {"step": 0}
        extra = ckpt / "tensors.safetensors"
        state["tensors"] = load_file(str(extra)) if extra.is_file() else {}
        state["path"] = str(ckpt)
        return state


def rng_tensors(device: torch.device | str) -> dict[str, torch.Tensor]:
    """torch's RNG state for a checkpoint: the CPU generator's, and that of `device`'s CUDA generator when the
    model lives on CUDA (a CPU run never touches CUDA, even on a GPU machine)."""
    device = torch.device(device)
    tensors = {"rng.torch_cpu": torch.get_rng_state()}
    if device.type == "cuda":
        tensors["rng.torch_cuda"] = torch.cuda.get_rng_state(device)
    return tensors


def restore_rng(tensors: Mapping[str, torch.Tensor], device: torch.device | str) -> None:
    """Set the generators `rng_tensors(device)` saved; a CUDA state is restored only onto a CUDA `device`."""
    device = torch.device(device)
    if "rng.torch_cpu" in tensors:
        torch.set_rng_state(tensors["rng.torch_cpu"])
    if "rng.torch_cuda" in tensors and device.type == "cuda":
        torch.cuda.set_rng_state(tensors["rng.torch_cuda"], device)


def random_state(rng: Any = random) -> list[Any]:
    """The state of a `random.Random` (or of the `random` module) as JSON-ready lists."""
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def set_random_state(state: list[Any], rng: Any = random) -> None:
    """Restore what `random_state(rng)` returned."""
    version, internal, gauss = state
    rng.setstate((version, tuple(internal), gauss))


def _is_tied_alias(model: nn.Module, name: str) -> bool:
    """True when `name` is a tensor shared with another state-dict entry (stored once by save_model)."""
    sd = model.state_dict()
    t = sd.get(name)
    return t is not None and any(k != name and v.data_ptr() == t.data_ptr() for k, v in sd.items())


__all__ = ["CheckpointConfig", "CheckpointManager", "optimizer_to_flat", "optimizer_from_flat", "rng_tensors",
           "restore_rng", "random_state", "set_random_state"]
