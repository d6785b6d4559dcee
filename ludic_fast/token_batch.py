"""Flat batch of ACTION tokens: the only rows a loss sends through the LM head.

A Ludic batch scores token x[j+1] from position j (causal shift). Position j is an action position when
`action_mask[j+1] > 0` and j+1 lies in the same sequence as j. Two layouts:

- padded: `input_ids [B, T]`, sequence b = row b, positions b*T + j for j < T-1;
- packed: `input_ids [1, total]` with `cu_seqlens [S+1]`; the shift never crosses a boundary.

`TokenBatch` holds, for the n action positions in position order: `rows` (flat index into the rows of
`hidden`/`logits` reshaped to `[-1, D or V]`), `targets` (x[j+1]), `seq` (sequence id), `mask`
(action_mask[j+1], the token's weight M), and per-token values of `[B, T]` batch keys read at j+1 (as
Ludic's `actor_logps[:, 1:]`). Per-sequence constants: `counts` n_b = max(1, sum M), `raw_counts`,
the number of sequences S, and a dense prompt index built from `group_id`.

Macro-batch totals (optional batch keys, set by the trainer's collation, `batching.MacroTotals`): a
micro-batch of S sequences out of a macro-batch of N that the trainer weighs by S / N can carry
`macro_tokens_per_seq` (0-d: max(1, Σ M over the macro-batch) / N), `macro_prompts_per_seq` (0-d: prompts / N)
and `macro_prompt_tokens` ([S]: Σ M over the macro-batch sequences of each sequence's prompt). token_mean
and prompt_mean then divide by macro-batch counts, so Σ_k (S_k / N) loss_k is the macro-batch loss for
any split into micro-batches.

Per-token and per-sequence float values are float32, or float64 when the batch holds them in float64.

Building the index costs one host sync (`nonzero`, the number of action tokens), except for a batch from the
trainer's collation: it computes the action rows on the host and ships them with the batch (`ACTION_ROWS`,
recorded by `attach_action_rows` for the batch's input_ids, action_mask and cu_seqlens as collated), and
`from_batch` then reads nothing from the device. A batch whose tensors were replaced or changed in place since
is indexed by `nonzero` again. The host also knows the range of those rows' targets: `from_batch` notes it
(`_common.note_target_bounds`), so the head's input check compares it with the vocabulary on the host.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from ludic_fast._common import note_target_bounds

#: the batch key of the action rows that collation computed on the host (`attach_action_rows`)
ACTION_ROWS = "action_rows"
#: the tensors the action rows are computed from
_ROW_SOURCES = ("input_ids", "action_mask", "cu_seqlens")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm", "prompt_mean")


def _positions(batch: Mapping[str, Tensor]) -> tuple[Tensor, Tensor, int]:
    """(sequence id of every flat position, weight M of the token it scores (0 if none), number of sequences)."""
    ids = batch["input_ids"]
    if not isinstance(ids, Tensor) or ids.ndim != 2 or ids.dtype.is_floating_point:
        raise ValueError(f"input_ids must be an integer tensor [B, T], got {getattr(ids, 'shape', type(ids))}")
    amask = batch.get("action_mask")
    if not isinstance(amask, Tensor) or tuple(amask.shape) != tuple(ids.shape):
        raise ValueError(f"action_mask must be a tensor of the shape of input_ids {tuple(ids.shape)}")
    cu = batch.get("cu_seqlens")
    if cu is None:
        B, T = ids.shape
        if T < 2:
            raise ValueError("input_ids needs T >= 2 for the causal shift")
        seq = torch.arange(B, device=ids.device).repeat_interleave(T)
        n_seq = B
    else:
        if ids.shape[0] != 1:
            raise ValueError(f"packed layout needs input_ids of shape [1, total], got {tuple(ids.shape)}")
        if not isinstance(cu, Tensor) or cu.ndim != 1 or cu.numel() < 2 or cu.dtype.is_floating_point:
            raise ValueError("cu_seqlens must be a 1-D integer tensor [S+1] of sequence offsets")
        n_seq = cu.numel() - 1
        cu = cu.to(device=ids.device, dtype=torch.long)
        seq = torch.searchsorted(cu[1:], torch.arange(ids.shape[1], device=ids.device), right=True)
        seq = seq.clamp_(max=n_seq - 1)
    flat_mask = amask.reshape(-1).float()
    nxt = torch.zeros_like(flat_mask)
    nxt[:-1] = flat_mask[1:] * (seq[:-1] == seq[1:])  # the shift never crosses a sequence boundary
    return seq, nxt, n_seq


@dataclass(frozen=True)
class _HostRows:
    """What collation knew on the host about a batch's action rows: the tensors they were computed from (each
    with its version counter), the (min, max) of their targets (None: no action row) and the offsets in the
    rows' order where the sequence changes (None: not given)."""

    sources: tuple[tuple[str, weakref.ref | None, int], ...]
    target_bounds: tuple[int, int] | None
    sequence_starts: tuple[int, ...] | None

    def holds_for(self, batch: Mapping[str, Tensor]) -> bool:
        """Whether `batch` still has those very tensors, unchanged."""
        for key, ref, version in self.sources:
            value = batch.get(key)
            if ref is None:
                if value is not None:
                    return False
            elif value is not ref() or value._version != version:
                return False
        return True


_HOST_ROWS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def attach_action_rows(batch: MutableMapping[str, Tensor], rows: Tensor, target_bounds: tuple[int, int] | None,
                       sequence_starts: Sequence[int] | None = None) -> None:
    """Set batch[ACTION_ROWS] = rows, the action rows of `batch` computed on the host (`nonzero(nxt > 0)` of
    `from_batch`, ascending, long, on the batch's device), `target_bounds` = (min, max) of x[j+1] over those
    rows (None when there are none) and `sequence_starts`, the offsets in that order where the sequence changes
    (`TokenBatch.sequence_starts`; None: unknown). They hold for the batch's current input_ids, action_mask and
    cu_seqlens; `from_batch` uses them while those tensors are the same objects, unchanged in place. Not
    attached to inference tensors (they keep no version counter)."""
    values = [batch.get(key) for key in _ROW_SOURCES]
    if any(v is not None and v.is_inference() for v in values):  # no version counter: nothing to hold them to
        return
    sources = tuple((key, None, 0) if v is None else (key, weakref.ref(v), v._version)
                    for key, v in zip(_ROW_SOURCES, values))
    batch[ACTION_ROWS] = rows
    starts = None if sequence_starts is None else tuple(int(i) for i in sequence_starts)
    _HOST_ROWS[rows] = _HostRows(sources, target_bounds, starts)


def _host_rows(batch: Mapping[str, Tensor]) -> _HostRows | None:
    rows = batch.get(ACTION_ROWS)
    info = None if rows is None else _HOST_ROWS.get(rows)
    return info if info is not None and info.holds_for(batch) else None


def action_rows(batch: Mapping[str, Tensor]) -> Tensor:
    """The batch's action rows, as `TokenBatch.from_batch(batch).rows`: its collation's (no host sync) while they
    hold for the batch, else `nonzero` (one host sync)."""
    if _host_rows(batch) is not None:
        return batch[ACTION_ROWS]
    return torch.nonzero(_positions(batch)[1] > 0).squeeze(1)


def widen(x: Tensor) -> Tensor:
    """x as float32, or float64 when it is float64 (float64 inputs are carried through, never narrowed)."""
    return x if x.dtype == torch.float64 else x.float()


def _dense_groups(group_id: Tensor) -> tuple[Tensor, Tensor]:
    """(dense prompt index in [0, G) per sequence, G as a 0-d tensor) without a host sync."""
    order = torch.argsort(group_id, stable=True)
    g_sorted = group_id[order]
    new = torch.ones_like(g_sorted, dtype=torch.long)
    new[1:] = (g_sorted[1:] != g_sorted[:-1]).long()
    dense = torch.empty_like(new)
    dense[order] = new.cumsum(0) - 1
    return dense, new.sum()


MACRO_KEYS = ("macro_tokens_per_seq", "macro_prompts_per_seq", "macro_prompt_tokens")


def _check_macro_totals(batch: Mapping[str, Tensor], n_seq: int) -> None:
    present = [k for k in MACRO_KEYS if k in batch]
    if present and len(present) != len(MACRO_KEYS):
        raise ValueError(f"macro-batch totals come together: got {present}, need all of {MACRO_KEYS}")
    if present:
        for key in MACRO_KEYS[:2]:
            if not isinstance(batch[key], Tensor) or batch[key].ndim != 0:
                raise ValueError(f"batch[{key!r}] must be a 0-d tensor")
        if tuple(batch["macro_prompt_tokens"].shape) != (n_seq,):
            raise ValueError(f"batch['macro_prompt_tokens'] must have shape [{n_seq}] (per sequence)")


@dataclass(frozen=True)
class TokenBatch:
    """Action tokens of a batch in flat form (see the module docstring). `tokens` holds every per-token
    tensor (sliced by `subset`); `seqs` the per-sequence ones, which a subset keeps whole."""

    rows: Tensor
    tokens: dict[str, Tensor]
    seqs: dict[str, Tensor]
    n_seq: int
    total_mask: Tensor  # sum of M over the whole batch (0-d)
    batch: Mapping[str, Tensor]
    parent: TokenBatch | None = None  # the whole batch, for a subset

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_batch(cls, batch: Mapping[str, Tensor]) -> TokenBatch:
        """Select the action positions of a padded or packed Ludic batch (one host sync; none for a batch with
        its collation's action rows)."""
        seq_of_pos, nxt, n_seq = _positions(batch)
        host = _host_rows(batch)
        rows = torch.nonzero(nxt > 0).squeeze(1) if host is None else batch[ACTION_ROWS]
        ids = batch["input_ids"].reshape(-1)
        seq = seq_of_pos[rows]
        mask = nxt[rows]
        tokens = {"targets": ids[rows + 1].long(), "seq": seq, "mask": mask}
        if host is not None and host.target_bounds is not None:
            note_target_bounds(tokens["targets"], *host.target_bounds)
        shape = tuple(batch["input_ids"].shape)
        for key in ("actor_logps", "ref_logps", "is_weights", "advantages", "log_sum_sq_probs"):
            if key in batch:
                val = batch[key]
                if tuple(val.shape) != shape:
                    raise ValueError(f"batch[{key!r}] must have the shape of input_ids {shape}, got {tuple(val.shape)}")
                tokens[key] = widen(val.reshape(-1)[rows + 1])
        raw = torch.zeros(n_seq, device=rows.device).index_add_(0, seq, mask)
        seqs = {"raw_counts": raw, "counts": raw.clamp(min=1.0)}
        for key in ("weight", "old_logp_action", "zvp_direction", "group_id"):
            if key in batch:
                val = batch[key]
                if tuple(val.shape) != (n_seq,):
                    raise ValueError(f"batch[{key!r}] must have shape [{n_seq}] (per sequence), got {tuple(val.shape)}")
                seqs[key] = val if key == "group_id" else widen(val)
        if "group_id" in seqs:
            seqs["prompt"], seqs["n_prompts"] = _dense_groups(seqs["group_id"])
        _check_macro_totals(batch, n_seq)
        return cls(rows, tokens, seqs, n_seq, mask.sum(), batch)

    def sequence_starts(self) -> list[int] | None:
        """Offsets in the flat token order where the sequence id changes, as the batch's collation computed them
        on the host (no host sync); None when it did not (a batch without its collation's action rows, or
        changed since) and for a subset."""
        host = _host_rows(self.batch) if self.parent is None else None
        return None if host is None or host.sequence_starts is None else list(host.sequence_starts)

    def subset(self, sel: slice) -> TokenBatch:
        """The tokens `sel` (a slice of the flat order) with every per-sequence constant unchanged."""
        tokens = {k: v[sel] for k, v in self.tokens.items()}
        return replace(self, rows=self.rows[sel], tokens=tokens, parent=self.whole)

    @property
    def whole(self) -> TokenBatch:
        """The whole batch this is a subset of (itself when it is whole): per-sequence reductions of
        per-token CONSTANTS (e.g. a sequence IS weight) must see every token."""
        return self if self.parent is None else self.parent

    # ------------------------------------------------------------------ accessors
    @property
    def n(self) -> int:
        return self.rows.shape[0]

    @property
    def seq(self) -> Tensor:
        return self.tokens["seq"]

    @property
    def mask(self) -> Tensor:
        return self.tokens["mask"]

    @property
    def targets(self) -> Tensor:
        return self.tokens["targets"]

    def token(self, key: str, owner: str) -> Tensor:
        """Per-token values of batch[key] ([B, T], read at the scored position j+1)."""
        if key not in self.tokens:
            raise KeyError(f"{owner} requires batch[{key!r}] (shape of input_ids)")
        return self.tokens[key]

    def per_seq(self, key: str, owner: str) -> Tensor:
        """Per-sequence values [S] of batch[key]."""
        if key not in self.seqs:
            if key in self.batch:  # a caller-chosen key (e.g. old_logp_key)
                return widen(self.batch[key])
            raise KeyError(f"{owner} requires batch[{key!r}] (one value per sequence)")
        return self.seqs[key]

    def seq_sum(self, x: Tensor) -> Tensor:
        """[S] per-sequence sums of the per-token vector x."""
        return torch.zeros(self.n_seq, device=x.device, dtype=x.dtype).index_add_(0, self.seq, x)

    def seq_max(self, x: Tensor) -> Tensor:
        """[S] per-sequence max of x over the sequence's action tokens (0 for a sequence without any)."""
        out = torch.zeros(self.n_seq, device=x.device, dtype=x.dtype)
        return out.scatter_reduce_(0, self.seq, x, reduce="amax", include_self=False)

    def advantages(self, owner: str) -> Tensor:
        """Per-token advantage: batch['advantages'] at j+1 when given, else batch['weight'][seq]."""
        if "advantages" in self.tokens:
            return self.tokens["advantages"]
        return self.per_seq("weight", owner)[self.seq]

    def agg_coef(self, aggregation: str, normalizer: float | None = None, norm_length: float | None = None) -> Tensor:
        """Per-token coefficient c_t with loss = sum_t c_t M_t l_t for the aggregation:

        token_mean               c = 1 / (normalizer or max(1, sum M))
        seq_mean_token_mean      c = 1 / (n_b * (normalizer or S))
        seq_mean_token_sum       c = 1 / (normalizer or S)
        seq_mean_token_sum_norm  c = 1 / ((normalizer or S) * norm_length)     (Dr. GRPO constant)
        prompt_mean              c = 1 / (sum of n_b over the prompt's sequences * (normalizer or #prompts))

        With macro-batch totals in the batch (module docstring): max(1, sum M) -> S macro_tokens_per_seq,
        #prompts -> S macro_prompts_per_seq, the prompt's token sum -> macro_prompt_tokens.
        """
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
        if normalizer is not None and normalizer <= 0:
            raise ValueError(f"normalizer must be > 0, got {normalizer}")
        one = torch.ones_like(self.mask)
        if aggregation == "token_mean":
            if normalizer is None:
                per_seq = self.batch.get("macro_tokens_per_seq")
                normalizer = self.total_mask.clamp(min=1.0) if per_seq is None else self.n_seq * per_seq
            return one / normalizer
        if aggregation == "prompt_mean":
            if "prompt" not in self.seqs:
                raise KeyError("aggregation='prompt_mean' requires batch['group_id'] (one prompt id per sequence)")
            prompt = self.seqs["prompt"]
            size = self.batch.get("macro_prompt_tokens")
            if size is None:
                size = torch.zeros_like(self.seqs["raw_counts"]).index_add_(0, prompt, self.seqs["raw_counts"])[prompt]
            if normalizer is None:
                per_seq = self.batch.get("macro_prompts_per_seq")
                normalizer = self.seqs["n_prompts"].clamp(min=1) if per_seq is None else self.n_seq * per_seq
            return one / (size.float().clamp(min=1.0)[self.seq] * normalizer)
        denom = float(normalizer if normalizer is not None else self.n_seq)
        if aggregation == "seq_mean_token_mean":
            return one / (self.seqs["counts"][self.seq] * denom)
        if aggregation == "seq_mean_token_sum_norm":
            if norm_length is None or norm_length <= 0:
                raise ValueError("aggregation='seq_mean_token_sum_norm' needs norm_length > 0 (e.g. max length)")
            return one / (denom * float(norm_length))
        return one / denom


__all__ = ["TokenBatch", "AGGREGATIONS", "ACTION_ROWS", "MACRO_KEYS", "action_rows", "attach_action_rows", "widen"]
