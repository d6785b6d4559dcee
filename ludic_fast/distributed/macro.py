"""A step's macro-batch totals (`batching.MacroTotals`) over the ranks of a data-parallel group.

Each rank holds its own items; the gradients of the ranks are averaged (DDP / FSDP). Over the group:
tokens = Σ_r tokens_r; prompt_tokens[g] = Σ_r prompt_tokens_r[g] for every group g, wherever its responses
landed; prompts = |∪_r groups_r| + Σ_r ungrouped_r. Group ids travel as 64-bit hashes (blake2b), so no
Python object is pickled; four collectives per step (sizes, hashes, token counts, two sums).
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch
import torch.distributed as dist

from ludic_fast.data.batching import MacroTotals
from ludic_fast.distributed.stats import collective_device


def _group_hash(group_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(group_id.encode(), digest_size=8).digest(), "big", signed=True)


def _gather_padded(t: torch.Tensor, width: int, sizes: list[torch.Tensor], group: object | None) -> torch.Tensor:
    """Every rank's 1-D `t` (rank r's of length sizes[r] <= width), concatenated in rank order."""
    padded = torch.zeros(width, dtype=t.dtype, device=t.device)
    padded[: t.numel()] = t
    out = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(out, padded, group=group)
    return torch.cat([o[: int(n)] for o, n in zip(out, sizes)])


def macro_totals_across_ranks(macro: MacroTotals, group: object | None = None) -> MacroTotals:
    """`macro` with tokens, prompts and each local group's token count summed over the ranks of `group`
    (collective: every rank calls it once per step); `ranks` = the group's size."""
    dev = collective_device(group)
    world = dist.get_world_size(group)
    ids = list(macro.prompt_tokens)
    keys = torch.tensor([_group_hash(g) for g in ids], dtype=torch.int64, device=dev)
    counts = torch.tensor([macro.prompt_tokens[g] for g in ids], dtype=torch.float64, device=dev)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(ids)], dtype=torch.int64, device=dev), group=group)
    width = max(int(s) for s in sizes)
    all_keys, all_counts = (_gather_padded(t, width, sizes, group) if width else t for t in (keys, counts))
    unique, slot = torch.unique(all_keys, return_inverse=True)
    per_group = torch.zeros(unique.numel(), dtype=torch.float64, device=dev).index_add_(0, slot, all_counts)
    ungrouped = macro.prompts - len(ids)
    sums = torch.tensor([macro.tokens, float(ungrouped)], dtype=torch.float64, device=dev)
    dist.all_reduce(sums, group=group)
    tokens, ungrouped_total = sums.tolist()
    local = per_group[torch.searchsorted(unique, keys)].tolist()
    return dataclasses.replace(
        macro,
        tokens=tokens,
        prompts=unique.numel() + round(ungrouped_total),
        prompt_tokens=dict(zip(ids, local)),
        ranks=world,
    )


__all__ = ["macro_totals_across_ranks"]
