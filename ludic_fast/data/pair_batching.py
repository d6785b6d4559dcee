"""Batches for preference and distillation objectives: pairs, KTO examples, prompt/completion sequences.

`collate_pairs` puts the chosen and the rejected response of a prompt next to each other, so both go
through one forward: sequence 2i = prompt_i + chosen_i, sequence 2i+1 = prompt_i + rejected_i, the
response tokens are the action tokens (`action_mask` 1). Layouts as `ludic_fast.data.batching`: padded
(`input_ids [2P, T]`, right padding) or packed (`input_ids [1, total]`, `cu_seqlens [2P+1]`), with the
same keys (`input_ids`, `attention_mask`, `action_mask`, `weight`, and `position_ids` when packed).

`collate_kto` adds `kto_label [S]` (1 desirable, 0 undesirable) and, with `kl_samples=True`, one KL sample
per example (label -1): prompt_i with the completion of example i+1 (mod S), KTO's mismatched pairs
from which the reference point z_0 is estimated.

`collate_completions` collates plain prompt/completion sequences (distillation, reward scoring).

`max_length` truncates a sequence from its end (the prompt is kept first), as TRL does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ludic_fast.data.batching import Layout, collate_packed, collate_saw_items
from ludic_fast.data.types import SAWItem


@dataclass(frozen=True)
class PreferencePair:
    """Token ids of a prompt and of its chosen and rejected responses."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


@dataclass(frozen=True)
class KTOExample:
    """Token ids of a prompt and a completion with a desirable (True) or undesirable (False) label."""

    prompt: list[int]
    completion: list[int]
    desirable: bool


def _item(prompt: Sequence[int], completion: Sequence[int], max_length: int | None) -> SAWItem:
    if not completion:
        raise ValueError("a completion must have at least one token")
    ids = [int(t) for t in (*prompt, *completion)]
    action = [0] * len(prompt) + [1] * len(completion)
    if max_length is not None:
        ids, action = ids[:max_length], action[:max_length]
    return SAWItem(input_ids=ids, attention_mask=[1] * len(ids), action_mask=action, weight=1.0)


def _collate(items: list[SAWItem], layout: Layout, pad_token_id: int, device) -> dict[str, Tensor]:
    if layout == "padded":
        return collate_saw_items(items, pad_token_id=pad_token_id, device=device)
    if layout == "packed":
        return collate_packed(items, device=device)
    raise ValueError(f"layout must be 'padded' or 'packed', got {layout!r}")


def _check_max_length(max_length: int | None) -> None:
    if max_length is not None and max_length < 2:
        raise ValueError(f"max_length must be >= 2 (or None), got {max_length}")


def collate_pairs(
    pairs: Sequence[PreferencePair],
    *,
    layout: Layout = "padded",
    pad_token_id: int = 0,
    max_length: int | None = None,
    device: torch.device | str | None = None,
) -> dict[str, Tensor]:
    """The pair batch of `pairs` (module docstring): sequences 2i chosen, 2i+1 rejected."""
    if not pairs:
        raise ValueError("collate_pairs needs at least one pair")
    _check_max_length(max_length)
    items = []
    for pair in pairs:
        items += [_item(pair.prompt, pair.chosen, max_length), _item(pair.prompt, pair.rejected, max_length)]
    return _collate(items, layout, pad_token_id, device)


def collate_kto(
    examples: Sequence[KTOExample],
    *,
    kl_samples: bool = True,
    layout: Layout = "padded",
    pad_token_id: int = 0,
    max_length: int | None = None,
    device: torch.device | str | None = None,
) -> dict[str, Tensor]:
    """The KTO batch of `examples` plus (with `kl_samples`, at least 2 examples) their mismatched KL samples."""
    if not examples:
        raise ValueError("collate_kto needs at least one example")
    _check_max_length(max_length)
    items = [_item(e.prompt, e.completion, max_length) for e in examples]
    labels = [1 if e.desirable else 0 for e in examples]
    if kl_samples and len(examples) > 1:
        for i, e in enumerate(examples):
            items.append(_item(e.prompt, examples[(i + 1) % len(examples)].completion, max_length))
            labels.append(-1)
    out = _collate(items, layout, pad_token_id, device)
    out["kto_label"] = torch.tensor(labels, dtype=torch.long, device=device)
    return out


def collate_completions(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    layout: Layout = "padded",
    pad_token_id: int = 0,
    max_length: int | None = None,
    device: torch.device | str | None = None,
) -> dict[str, Tensor]:
    """Prompt + completion sequences, the completion tokens as action tokens."""
    if len(prompts) != len(completions) or not prompts:
        raise ValueError(f"prompts and completions must be non-empty and of one length, got {len(prompts)}, "
                         f"{len(completions)}")
    _check_max_length(max_length)
    return _collate([_item(p, c, max_length) for p, c in zip(prompts, completions)], layout, pad_token_id, device)


__all__ = ["PreferencePair", "KTOExample", "collate_pairs", "collate_kto", "collate_completions"]
