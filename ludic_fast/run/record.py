"""What a run directory records about how it was run (`run.json`): the command line, the resolved settings the
caller passes, and the environment: package versions, the git commit of the source tree (when it is one) and
the machine. Values that are not JSON (dataclasses, callables, devices) are written as plain data or names."""

from __future__ import annotations

import dataclasses
import enum
import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from ludic_fast.run.atomic_io import atomic_write_text

#: the distributions whose versions a run records (those installed)
PACKAGES = ("ludic-fast", "torch", "transformers", "triton", "numpy", "safetensors", "peft", "vllm", "liger-kernel",
            "trl", "deepspeed")


def package_versions() -> dict[str, str]:
    """Installed versions of `PACKAGES` (absent ones left out)."""
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def git_commit(path: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
    """{"commit": sha, "dirty": bool} of the git work tree holding `path` (default: this package's source), or
    None outside a git tree or without git."""
    where = Path(path) if path is not None else Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": sha, "dirty": bool(status.strip())}


def machine() -> dict[str, Any]:
    """The machine: OS, Python, CPU architecture and count, torch's threads, and the CUDA devices' names."""
    info: dict[str, Any] = {"platform": platform.platform(), "python": sys.version.split()[0],
                            "machine": platform.machine(), "cpu_count": os.cpu_count(),
                            "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["cuda"] = torch.version.cuda
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def plain(value: Any) -> Any:
    """`value` as JSON data: dataclasses field by field (with their type name), mappings and sequences item by
    item, enums by value, callables and classes by qualified name, anything else by `str`."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.repr}
        return {"type": type(value).__name__, **fields}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    if isinstance(value, enum.Enum):
        return plain(value.value)
    if isinstance(value, type) or callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__name__)}"
    return str(value)


def write_run_record(path: str | os.PathLike[str], **sections: Any) -> Path:
    """Write `run.json` at `path`: the given sections (as `plain` data) plus `versions`, `git` and `machine`."""
    import json

    record = {k: plain(v) for k, v in sections.items()}
    record.update(versions=package_versions(), git=git_commit(), machine=machine())
    path = Path(path)
    atomic_write_text(path, json.dumps(record, indent=1) + "\n")
    return path


__all__ = ["PACKAGES", "package_versions", "git_commit", "machine", "plain", "write_run_record"]
