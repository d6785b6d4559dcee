"""Weight publishing from a trainer that runs on every rank of a process group (DDP, FSDP2)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import Tensor


class Rank0Publisher:
    """A publisher for a trainer that runs on every rank (DDP, FSDP2): `publish(params, version)` gathers
    DTensor parameters (FSDP2/TP shards, `full_tensor()`: collective, so every rank must call it, as the
    Trainer does), strips wrapper prefixes (`module.` of DDP and `.module` wrappers) from the names, and
    passes the full tensors to `inner.publish` on `src_rank` only. Without torch.distributed it forwards."""

    def __init__(
        self, inner: Any, *, src_rank: int = 0, group: dist.ProcessGroup | None = None, strip_prefix: str = "module."
    ):
        if not callable(getattr(inner, "publish", None)):
            raise TypeError("inner must have a publish(params, version) method")
        self.inner, self.src_rank, self.group, self.strip_prefix = inner, src_rank, group, strip_prefix

    def publish(self, params: Mapping[str, Tensor], version: int) -> None:
        full = {}
        for name, tensor in params.items():
            if hasattr(tensor, "full_tensor") and hasattr(tensor, "placements"):
                tensor = tensor.full_tensor()
            while self.strip_prefix and name.startswith(self.strip_prefix):
                name = name[len(self.strip_prefix) :]
            full[name] = tensor
        if not (dist.is_available() and dist.is_initialized()) or dist.get_rank(self.group) == self.src_rank:
            self.inner.publish(full, version)
