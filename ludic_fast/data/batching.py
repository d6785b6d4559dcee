"""From SAW items to tensors: Ludic's token-budget micro-batching, padded and packed collation.

`split_items_by_token_budget` (Ludic master's rule): if any item is longer than `max_seq_len`, truncate
every item to `max_seq_len` (with truncation metadata); stable-sort by length; pack greedily in that
order. Padded layout: a chunk of c items of max length ℓ costs ℓ·c tokens; packed layout: it costs the
sum of its lengths. A chunk never costs more than `micro_token_budget`.

Padded collation (`collate_saw_items`), right padding, T = longest item, B = number of items:
    input_ids long [B,T] (pad_token_id), attention_mask long [B,T], action_mask float32 [B,T],
    weight float32 [B];
    actor_logps float32 [B,T] (behaviour logprobs at action positions, 0 elsewhere) and
    old_logp_action float32 [B] (their sum), when items carry them (all or none);
    group_id long [B] when items carry GRPO group ids (ints by first appearance in `group_index`;
    an item without one gets an id of its own); zvp_direction long [B] when any item's meta has it
    (missing = 0).
Packed collation (`collate_packed`): the same keys with every per-token tensor of shape [1, total]
(sequences back to back, no padding, total = Σ lengths), per-sequence tensors [S], plus
    cu_seqlens int32 [S+1] (sequence s occupies [cu[s], cu[s+1])) and position_ids long [1, total]
    (restarting at 0 for every sequence), and `cu_seqlens_host` (CU_SEQLENS_HOST), the same offsets left on
    the host, from which the packed attention paths read the sequence bounds without a device sync.
Both also carry `action_rows` (`token_batch.ACTION_ROWS`): the flat positions j whose next token x[j+1] (same
sequence) has M > 0, computed from the items on the host with the (min, max) of those targets, so that
`TokenBatch.from_batch` and the head's input check read nothing from the device (token_batch.py). On a CUDA
device the tensors go through pinned host memory without blocking (a blocking host-to-device copy synchronises
the stream); elsewhere `.to(device)` as before.
Losses on the packed layout must not let the causal shift cross a boundary: the token at cu[s] is
never scored (as position 0 of a padded row is not).
Both take `macro=MacroTotals.of(all items of the step)`: then every micro-batch also carries the
macro-batch totals `macro_tokens_per_seq`, `macro_prompts_per_seq` (0-d) and `macro_prompt_tokens` [B]
(token_batch.py), so token_mean / prompt_mean losses weighted by items / N sum to the macro-batch loss.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import random
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from ludic_fast.data.types import (
    ActorTokenLogps,
    Rollout,
    RolloutRequest,
    SampleAttachments,
    SAWItem,
    Step,
    group_id_of,
)
from ludic_fast.token_batch import ACTION_ROWS, attach_action_rows

Layout = Literal["padded", "packed"]
_LAYOUTS = ("padded", "packed")
#: the packed batch's key of its sequence offsets kept on the host (a CPU copy of cu_seqlens)
CU_SEQLENS_HOST = "cu_seqlens_host"
_INPUT_IDS = operator.attrgetter("input_ids")
_ATTENTION_MASK = operator.attrgetter("attention_mask")
_ACTION_MASK = operator.attrgetter("action_mask")
_ACTOR_LOGPS = operator.attrgetter("actor_logps.token_logps")
_TRACE_KEYS = ("prompt_token_ids", "completion_token_ids", "completion_logprobs")


def _check_layout(layout: str) -> None:
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be one of {_LAYOUTS}, got {layout!r}")


# -------------------------------------------------------------------------------------- item building
def saw_item_from_step(rollout: Rollout, step: Step, weight: float) -> SAWItem:
    """Ludic's SAWItem for one step: prompt + completion ids, action mask on the completion, `weight`.

    Meta = {rollout_id, step_index, reward, prev_obs, action, total_reward, completion_length,
    prompt_length, truncated, terminated, finish_reason} updated with `rollout.meta` (so group ids,
    `zvp_direction` and `policy_version` reach the item) and then with `step.info` minus token fields.
    """
    trace = step.trace
    if trace is None:
        raise ValueError(f"step {step.index} of rollout id={rollout.id} has no trace (token ids are required)")
    return_spec = rollout.meta.get("engine", {}).get("return_spec", {})
    if return_spec.get("return_chosen_logprobs") and trace.completion_logprobs is None:
        raise ValueError(
            f"rollout id={rollout.id} step {step.index}: return_chosen_logprobs=True but the trace has no "
            "completion_logprobs"
        )
    prompt, completion = trace.prompt_token_ids, trace.completion_token_ids
    meta: dict[str, Any] = {
        "rollout_id": rollout.id,
        "step_index": step.index,
        "reward": step.reward,
        "prev_obs": step.prev_obs,
        "action": step.action,
        "total_reward": rollout.total_reward,
        "completion_length": len(completion),
        "prompt_length": len(prompt),
        "truncated": step.truncated,
        "terminated": step.terminated,
        "finish_reason": trace.finish_reason,
    }
    meta.update(rollout.meta)
    meta.update({k: v for k, v in step.info.items() if k not in _TRACE_KEYS})
    logps = None if trace.completion_logprobs is None else ActorTokenLogps(trace.completion_logprobs)
    return SAWItem(
        input_ids=prompt + completion,
        attention_mask=[1] * (len(prompt) + len(completion)),
        action_mask=[0] * len(prompt) + [1] * len(completion),
        weight=weight,
        meta=meta,
        attachments=SampleAttachments(logps),
    )


# ------------------------------------------------------------------------------------ micro-batching
def _truncate_item(item: SAWItem, max_seq_len: int) -> SAWItem:
    length = len(item.input_ids)
    if length <= max_seq_len:
        return item
    kept_actions = sum(item.action_mask[:max_seq_len])
    logps = item.actor_logps
    attachments = item.attachments
    if logps is not None:
        attachments = SampleAttachments(ActorTokenLogps(logps.token_logps[:kept_actions]))
    meta = dict(item.meta)
    meta.update(
        seq_len_truncated=True,
        seq_len_original=length,
        seq_len_retained=max_seq_len,
        seq_len_retained_frac=max_seq_len / length,
        truncated=True,
    )
    if meta.get("truncation_reason") is None:
        meta["truncation_reason"] = "max_seq_len"
    if "completion_length" in meta:
        meta["completion_length"] = kept_actions
    if "prompt_length" in meta:
        meta["prompt_length"] = max_seq_len - kept_actions
    return SAWItem(
        input_ids=item.input_ids[:max_seq_len],
        attention_mask=item.attention_mask[:max_seq_len],
        action_mask=item.action_mask[:max_seq_len],
        weight=item.weight,
        meta=meta,
        attachments=attachments,
    )


def split_items_by_token_budget(
    items: Sequence[SAWItem], *, micro_token_budget: int, max_seq_len: int, layout: Layout = "padded"
) -> list[list[SAWItem]]:
    """Truncate -> stable sort by length -> greedy pack; every chunk costs ≤ micro_token_budget tokens.

    The next item (length ℓ) joins the current chunk unless the chunk is non-empty and its cost with the
    item would exceed the budget: max length × count (padded) or Σ lengths (packed).
    """
    _check_layout(layout)
    if not items:
        return []
    if micro_token_budget <= 0:
        raise ValueError(f"micro_token_budget must be positive, got {micro_token_budget}")
    if max_seq_len <= 0:
        raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
    if micro_token_budget < max_seq_len:
        raise ValueError(
            f"micro_token_budget ({micro_token_budget}) must be >= max_seq_len ({max_seq_len}) "
            "so that a single sequence fits in a micro-batch"
        )
    if any(len(i.input_ids) > max_seq_len for i in items):
        items = [_truncate_item(i, max_seq_len) for i in items]
    ordered = sorted(items, key=lambda i: len(i.input_ids))
    chunks: list[list[SAWItem]] = []
    current: list[SAWItem] = []
    cost_max = cost_sum = 0
    for item in ordered:
        length = len(item.input_ids)
        if length > max_seq_len:
            raise ValueError(f"item of length {length} exceeds max_seq_len={max_seq_len}")
        if layout == "padded":
            cost = max(cost_max, length) * (len(current) + 1)
        else:
            cost = cost_sum + length
        if current and cost > micro_token_budget:
            chunks.append(current)
            current, cost_max, cost_sum = [], 0, 0
        current.append(item)
        cost_max, cost_sum = max(cost_max, length), cost_sum + length
    chunks.append(current)
    return chunks


# ------------------------------------------------------------------------------------------ collation
def _action_tokens(item: SAWItem) -> float:
    """Σ M over the tokens a loss scores (position 0 never is: nothing precedes it)."""
    return float(sum(item.action_mask[1:]))


@dataclass(frozen=True)
class MacroTotals:
    """Counts of a whole macro-batch (the items of one trainer step) for its micro-batches.

    n_items: this rank's items N; tokens: Σ M, prompts: P (an item without a group id is a prompt of its
    own), prompt_tokens[g]: Σ M over the items of group g, each over all `ranks` data-parallel ranks whose
    gradients are averaged (`distributed.macro.macro_totals_across_ranks`; 1 rank here). A micro-batch carries
    tokens_per_seq = max(1, tokens) / (ranks N) and prompts_per_seq = prompts / (ranks N), so that
    Σ_k (n_k / N) loss_k, averaged over the ranks, is the token / prompt mean over every rank's items.
    """

    n_items: int
    tokens: float
    prompts: int
    prompt_tokens: Mapping[str, float]
    ranks: int = 1

    @classmethod
    def of(cls, items: Sequence[SAWItem]) -> MacroTotals:
        if not items:
            raise ValueError("MacroTotals.of needs at least one item")
        prompt_tokens: dict[str, float] = {}
        tokens, ungrouped = 0.0, 0
        for item in items:
            n, gid = _action_tokens(item), group_id_of(item.meta)
            tokens += n
            if gid is None:
                ungrouped += 1
            else:
                prompt_tokens[gid] = prompt_tokens.get(gid, 0.0) + n
        return cls(len(items), tokens, len(prompt_tokens) + ungrouped, prompt_tokens)

    def tensors(self, items: Sequence[SAWItem], device: torch.device | str | None) -> dict[str, Tensor]:
        """The macro-batch keys of a micro-batch holding `items` (token_batch.py)."""
        sizes = [
            self.prompt_tokens[gid] if (gid := group_id_of(i.meta)) is not None else _action_tokens(i) for i in items
        ]
        seqs = self.ranks * self.n_items
        return {
            "macro_tokens_per_seq": torch.tensor(max(1.0, self.tokens) / seqs, dtype=torch.float32, device=device),
            "macro_prompts_per_seq": torch.tensor(self.prompts / seqs, dtype=torch.float32, device=device),
            "macro_prompt_tokens": torch.tensor(sizes, dtype=torch.float32, device=device),
        }


def group_index_of(items: Sequence[SAWItem]) -> dict[str, int]:
    """{group id: int} in order of first appearance (use one index for every micro-batch of a step)."""
    index: dict[str, int] = {}
    for item in items:
        gid = group_id_of(item.meta)
        if gid is not None and gid not in index:
            index[gid] = len(index)
    return index


def _sequence_tensors(
    items: Sequence[SAWItem],
    device: torch.device | str | None,
    group_index: Mapping[str, int] | None,
    macro: MacroTotals | None,
) -> dict[str, Tensor]:
    """Per-sequence tensors shared by both layouts: weight, old_logp_action, group_id, zvp_direction, and the
    macro-batch totals when given."""
    out = {"weight": torch.tensor([float(i.weight) for i in items], dtype=torch.float32, device=device)}
    if macro is not None:
        out.update(macro.tensors(items, device))
    has_logps = [i.actor_logps is not None for i in items]
    if any(has_logps):
        if not all(has_logps):
            raise ValueError(
                "Mixed presence of actor_logps: either every item in a micro-batch carries "
                "SampleAttachments.actor_logps or none does"
            )
        for idx, item in enumerate(items):
            n_actions = sum(item.action_mask)
            if len(item.actor_logps.token_logps) != n_actions:
                raise ValueError(
                    f"Length mismatch: item {idx} has {len(item.actor_logps.token_logps)} actor logps for "
                    f"{n_actions} action tokens"
                )
        out["old_logp_action"] = torch.tensor(
            [sum(i.actor_logps.token_logps) for i in items], dtype=torch.float32, device=device
        )
    gids = [group_id_of(i.meta) for i in items]
    if any(g is not None for g in gids):
        index = dict(group_index) if group_index is not None else group_index_of(items)
        next_id = max(index.values(), default=-1) + 1
        ids = []
        for g in gids:
            if g is None or g not in index:
                key = g if g is not None else f"__ungrouped__/{next_id}"
                index[key] = next_id
                next_id += 1
                ids.append(index[key])
            else:
                ids.append(index[g])
        out["group_id"] = torch.tensor(ids, dtype=torch.long, device=device)
    if any("zvp_direction" in i.meta for i in items):
        directions = [int(i.meta.get("zvp_direction", 0)) for i in items]
        if any(d not in (-1, 0, 1) for d in directions):
            raise ValueError(f"zvp_direction must be -1, 0 or +1, got {sorted(set(directions))}")
        out["zvp_direction"] = torch.tensor(directions, dtype=torch.long, device=device)
    return out


def _flat(items: Sequence[SAWItem], lists: Callable[[SAWItem], Sequence[Any]], dtype: type, count: int
          ) -> np.ndarray:
    """The items' `lists` concatenated into one array, which must hold `count` elements (numpy reads a Python
    list at C speed; `torch.tensor` of a list converts element by element, several times slower)."""
    parts = list(map(lists, items))
    if sum(map(len, parts)) != count:
        raise ValueError(f"the items' lists hold {sum(map(len, parts))} elements where the batch has {count} "
                         "positions for them (a mask whose length differs from input_ids?)")
    return np.fromiter(itertools.chain.from_iterable(parts), dtype=dtype, count=count)


def _actor_logps(items: Sequence[SAWItem], action_mask: np.ndarray) -> Tensor:
    """The items' behaviour logprobs at the collated layout's action positions (action_mask > 0, in order), 0
    elsewhere: a float32 tensor of action_mask's shape."""
    actor, acting = np.zeros(action_mask.shape, dtype=np.float32), action_mask > 0
    actor[acting] = _flat(items, _ACTOR_LOGPS, np.float32, int(acting.sum()))
    return torch.from_numpy(actor)


def _host_action_rows(ids: np.ndarray, mask: np.ndarray, starts: np.ndarray
                      ) -> tuple[Tensor, tuple[int, int] | None, list[int]]:
    """The action rows of a collated layout, from its flat host arrays: row p - 1 for every flat position p
    with M[p] > 0 that is not a sequence's first token (`starts`: padded b T, packed the offsets), i.e.
    `TokenBatch.from_batch`'s `nonzero(nxt > 0)`; the (min, max) of their targets x[p] (None: no action row);
    and the offsets in that row order where the sequence changes."""
    action = mask > 0
    action[starts] = False
    picked = np.flatnonzero(action)
    targets = ids[picked]
    bounds = (int(targets.min()), int(targets.max())) if picked.size else None
    seq = np.searchsorted(starts, picked, side="right") - 1
    return torch.from_numpy(picked - 1), bounds, (np.flatnonzero(seq[1:] != seq[:-1]) + 1).tolist()


def _to_device(tensors: dict[str, Tensor], device: torch.device | str | None) -> dict[str, Tensor]:
    """The host tensors on `device`: to a CUDA device from pinned memory without blocking (torch's caching host
    allocator keeps a pinned buffer until its copy has run), elsewhere by a plain `.to` (None: unchanged)."""
    if device is None:
        return tensors
    target = torch.device(device)
    if target.type == "cuda" and torch.cuda.is_available():
        return {k: v.pin_memory().to(target, non_blocking=True) for k, v in tensors.items()}
    return {k: v.to(target) for k, v in tensors.items()}


def collate_saw_items(
    items: Sequence[SAWItem],
    *,
    pad_token_id: int,
    device: torch.device | str | None = None,
    group_index: Mapping[str, int] | None = None,
    macro: MacroTotals | None = None,
) -> dict[str, Tensor]:
    """Right-padded [B, T] tensors of a micro-batch (keys in the module docstring)."""
    if not items:
        raise ValueError("collate_saw_items needs at least one item")
    lengths = np.array([len(i.input_ids) for i in items])
    B, T, total = len(items), int(lengths.max()), int(lengths.sum())
    real = np.arange(T)[None, :] < lengths[:, None]  # [B, T]: row b's first len_b positions, row-major
    input_ids = np.full((B, T), int(pad_token_id), dtype=np.int64)
    attention_mask = np.zeros((B, T), dtype=np.int64)
    action_mask = np.zeros((B, T), dtype=np.float32)
    input_ids[real] = _flat(items, _INPUT_IDS, np.int64, total)
    attention_mask[real] = _flat(items, _ATTENTION_MASK, np.int64, total)
    action_mask[real] = _flat(items, _ACTION_MASK, np.float32, total)
    rows, bounds, seq_starts = _host_action_rows(input_ids.reshape(-1), action_mask.reshape(-1), np.arange(B) * T)
    out = {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(attention_mask),
           "action_mask": torch.from_numpy(action_mask), **_sequence_tensors(items, None, group_index, macro),
           ACTION_ROWS: rows}
    if "old_logp_action" in out:
        out["actor_logps"] = _actor_logps(items, action_mask)
    out = _to_device(out, device)
    attach_action_rows(out, out[ACTION_ROWS], bounds, seq_starts)
    return out


def collate_packed(
    items: Sequence[SAWItem],
    *,
    device: torch.device | str | None = None,
    group_index: Mapping[str, int] | None = None,
    macro: MacroTotals | None = None,
) -> dict[str, Tensor]:
    """One packed row of S sequences, no padding (keys in the module docstring)."""
    if not items:
        raise ValueError("collate_packed needs at least one item")
    lengths = np.array([len(i.input_ids) for i in items])
    total = int(lengths.sum())
    offsets = np.zeros(len(items) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(lengths)
    starts = offsets[:-1]
    cu_seqlens = torch.from_numpy(offsets.astype(np.int32))
    input_ids = _flat(items, _INPUT_IDS, np.int64, total)
    action_mask = _flat(items, _ACTION_MASK, np.float32, total)
    out = {
        "input_ids": torch.from_numpy(input_ids)[None],
        "attention_mask": torch.from_numpy(_flat(items, _ATTENTION_MASK, np.int64, total))[None],
        "action_mask": torch.from_numpy(action_mask)[None],
        "position_ids": torch.from_numpy(np.arange(total) - np.repeat(starts, lengths))[None],
        "cu_seqlens": cu_seqlens,
        **_sequence_tensors(items, None, group_index, macro),
    }
    if "old_logp_action" in out:
        out["actor_logps"] = _actor_logps(items, action_mask)[None]
    rows, bounds, seq_starts = _host_action_rows(input_ids, action_mask, starts)
    out = _to_device({**out, ACTION_ROWS: rows}, device)
    out[CU_SEQLENS_HOST] = cu_seqlens
    attach_action_rows(out, out[ACTION_ROWS], bounds, seq_starts)
    return out


# ------------------------------------------------------------------------------------ micro-batches
@dataclass(frozen=True)
class PaddingReport:
    """Tokens that carry data vs tokens allocated; `waste_frac` = 1 − real / allocated."""

    real_tokens: int = 0
    allocated_tokens: int = 0

    @property
    def waste_frac(self) -> float:
        return 1.0 - self.real_tokens / self.allocated_tokens if self.allocated_tokens else 0.0

    def __add__(self, other: PaddingReport) -> PaddingReport:
        return PaddingReport(self.real_tokens + other.real_tokens, self.allocated_tokens + other.allocated_tokens)

    @classmethod
    def of(cls, chunk: Sequence[SAWItem], layout: Layout = "padded") -> PaddingReport:
        _check_layout(layout)
        lengths = [len(i.input_ids) for i in chunk]
        real = sum(lengths)
        return cls(real, max(lengths, default=0) * len(lengths) if layout == "padded" else real)


@dataclass(frozen=True)
class MicroBatch:
    """Collated tensors of one chunk, its item count (the trainer scales its loss by num_items / N)."""

    tensors: dict[str, Tensor]
    num_items: int
    padding: PaddingReport = PaddingReport()


def collate_micro_batches(
    items: Sequence[SAWItem],
    *,
    pad_token_id: int,
    device: torch.device | str | None = None,
    micro_token_budget: int,
    max_seq_len: int,
    layout: Layout = "padded",
) -> list[MicroBatch]:
    """Split by token budget and collate each chunk; group ids are numbered and macro-batch totals taken over
    all (truncated) items at once."""
    chunks = split_items_by_token_budget(
        items, micro_token_budget=micro_token_budget, max_seq_len=max_seq_len, layout=layout
    )
    index = group_index_of(items)
    macro = MacroTotals.of([it for chunk in chunks for it in chunk]) if chunks else None
    out = []
    for chunk in chunks:
        if layout == "padded":
            tensors = collate_saw_items(
                chunk, pad_token_id=pad_token_id, device=device, group_index=index, macro=macro
            )
        else:
            tensors = collate_packed(chunk, device=device, group_index=index, macro=macro)
        out.append(MicroBatch(tensors=tensors, num_items=len(chunk), padding=PaddingReport.of(chunk, layout)))
    return out


def padding_waste(micro_batches: Sequence[MicroBatch]) -> PaddingReport:
    """The padding report summed over micro-batches."""
    return sum((mb.padding for mb in micro_batches), PaddingReport())


# ---------------------------------------------------------------------------------- request strategy
@dataclass
class IdentityStrategy:
    """Requests unchanged."""

    def expand(self, requests: Sequence[RolloutRequest]) -> list[RolloutRequest]:
        return list(requests)


@dataclass
class GRPORequestStrategy:
    """Each base request becomes `group_size` single-episode requests sharing env_seed and a uuid4 group_id.

    env_seed: the base's, else one random int in [0, 2³²−1] for the group; sampling_seed: base (or random)
    + i for member i; meta = {**base.meta, 'group_id': gid}. `seed` makes the random draws reproducible
    (Ludic uses an unseeded generator).
    """

    group_size: int
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size <= 0:
            raise ValueError(f"group_size must be positive, got {self.group_size!r}")
        self._rng = random.Random(self.seed)

    def expand(self, requests: Sequence[RolloutRequest]) -> list[RolloutRequest]:
        out = []
        for base in requests:
            env_seed = base.env_seed if base.env_seed is not None else self._rng.randint(0, 2**32 - 1)
            sampling = base.sampling_seed if base.sampling_seed is not None else self._rng.randint(0, 2**32 - 1)
            gid = str(uuid.UUID(int=self._rng.getrandbits(128), version=4))
            out.extend(
                dataclasses.replace(
                    base,
                    env_seed=env_seed,
                    sampling_seed=sampling + i,
                    num_episodes=1,
                    meta={**base.meta, "group_id": gid},
                )
                for i in range(self.group_size)
            )
        return out


__all__ = [
    "Layout",
    "saw_item_from_step",
    "split_items_by_token_budget",
    "group_index_of",
    "MacroTotals",
    "collate_saw_items",
    "collate_packed",
    "PaddingReport",
    "MicroBatch",
    "collate_micro_batches",
    "padding_waste",
    "IdentityStrategy",
    "GRPORequestStrategy",
]
