"""The weight push from the engine to a rollout engine: `PolicyPublisher`, what the engine calls every
`sync_every_steps`, and `policy_params`, the tensors it hands over."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn


@runtime_checkable
class PolicyPublisher(Protocol):
    """Takes the policy's new weights: `publish(params, version)` receives {parameter name: tensor} (the names
    of the model's `named_parameters()`, wrapper prefixes included; `distributed.rank0.Rank0Publisher` strips
    them) and the policy version, the engine's step count. The rollout engines of `ludic_fast.rollout` and
    `distributed.publish` implement it."""

    def publish(self, params: dict[str, Tensor], version: int) -> None: ...


@torch.no_grad()
def policy_params(model: nn.Module, device: torch.device,
                  param_filter: Callable[[str, Tensor], bool] | None = None) -> dict[str, Tensor]:
    """{name: tensor on `device`} of the trainable parameters `param_filter` keeps (all when None). A PEFT model's
    adapters are merged, its weights copied, then unmerged, so every base weight is sent with the adapters applied
    (a copy: the unmerge happens in place)."""
    peft = callable(getattr(model, "merge_adapter", None)) and callable(getattr(model, "unmerge_adapter", None))
    if peft:
        model.merge_adapter()
    try:
        return {
            name: p.detach().to(device, copy=peft)
            for name, p in model.named_parameters()
            if (peft or p.requires_grad) and (param_filter is None or param_filter(name, p))
        }
    finally:
        if peft:
            model.unmerge_adapter()


__all__ = ["PolicyPublisher", "policy_params"]
