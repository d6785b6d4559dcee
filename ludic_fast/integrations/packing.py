"""Padding-free (packed) forwards of transformers causal LMs that never attend across sequences.

A packed row holds S sequences back to back, `input_ids [1, total]`, with `cu_seqlens [S+1]` (sequence s
occupies `[cu[s], cu[s+1])`) and restarting `position_ids`. Restarting positions alone do not stop a query of
sequence s from attending keys of sequence s-1 under transformers' eager or sdpa attention: the row is one
causal sequence to them. Exactness needs the attention to be block-diagonal causal,

    allowed(q, k) = doc(q) == doc(k) and k <= q,

which this module provides per attention implementation (`config._attn_implementation`):

- `varlen`  flash-attention (`flash_attention_2/3`, kernels-hub flash): no mask, `cu_seq_lens_q/k` and
            `max_length_q/k` keyword arguments; the varlen kernel runs each sequence on its own
            (Dao, "FlashAttention-2", arXiv 2307.08691).
- `sdpa_varlen`  `ludic_sdpa_varlen` (`integrations.sdpa_varlen`, any device, no flash-attn): PyTorch's SDPA
            run causally on each sequence of `cu_seq_lens_q/k`, Σ len² work, and an all-ones 2D mask (no mask
            is built from it). Sliding windows are applied
            per sequence.
- `flex`    `flex_attention`: a `BlockMask` of the rule above (torch.nn.attention.flex_attention), built from
            each 128-token tile's first and last document (O(total + tiles²), no total² mask); fully masked
            tiles are skipped. CUDA only: PyTorch's flex attention has no backward on CPU, and its compiled
            CPU forward fails at the second sequence length it meets (Inductor's C++ code for dynamic shapes).
- `mask`    `eager` / `sdpa`: a dense `[1, 1, total, total]` mask of the rule above (bool for sdpa, additive
            0 / dtype-min for eager). O(total²) memory: 64 MiB (bool) at 8192 tokens.
- `position_ids`  restarting positions only: for models whose own attention separates sequences by them.

`resolve_packed_attention` picks the path (or refuses with `PackedAttentionError`, a ValueError) and
`check_packed_attention` proves it on the model with a two-sequence probe. The dense mask costs O(total²)
attention work, more than the padded batch it replaces; `auto_attention` therefore first moves an eager / sdpa
model to flash-attention-2 (CUDA, flash-attn installed, half-precision compute), else flex attention (CUDA),
else `ludic_sdpa_varlen` (CPU, or when neither applies on CUDA).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ludic_fast.data.batching import CU_SEQLENS_HOST
from ludic_fast.integrations.sdpa_varlen import SDPA_VARLEN, packed_row_mask
from ludic_fast.integrations.transformers import call_in_forward, final_hidden_states, unwrap_model

PACKED_ATTENTION_PATHS = ("auto", "varlen", "sdpa_varlen", "flex", "mask", "position_ids")


class PackedAttentionError(ValueError):
    """The model's attention cannot run a packed row exactly (sequences would attend each other)."""


def attention_implementation(model: nn.Module) -> str | None:
    """`config._attn_implementation` of the (unwrapped) model, or None when it has no transformers config."""
    config = getattr(unwrap_model(model), "config", None)
    impl = getattr(config, "_attn_implementation", None)
    return impl if isinstance(impl, str) else None


def _auto_path(impl: str | None) -> str:
    if impl is None:
        raise PackedAttentionError(
            "layout='packed': the model has no transformers config._attn_implementation, so the trainer cannot "
            "make its attention block-diagonal; use layout='padded', or packed_attention='position_ids' if the "
            "model's attention separates sequences by restarting position_ids itself"
        )
    if "flash" in impl:
        return "varlen"
    if impl == SDPA_VARLEN:
        return "sdpa_varlen"
    if impl == "flex_attention":
        return "flex"
    if impl in ("eager", "sdpa"):
        return "mask"
    raise PackedAttentionError(
        f"layout='packed': attention implementation {impl!r} is not one the trainer can make block-diagonal "
        "(eager, sdpa, flex_attention, flash_attention_*); use layout='padded' or one of those"
    )


def _limited_window(config: Any, *, sliding: bool = True) -> int | None:
    """The smallest sliding-window (unless not `sliding`) / chunk size any layer of the model uses, or None."""
    windows = []
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    uses_window = (
        "sliding_attention" in layer_types
        if isinstance(layer_types, (list, tuple))
        else getattr(config, "use_sliding_window", True)
    )
    if sliding and isinstance(window, int) and uses_window:
        windows.append(window)
    chunk = getattr(config, "attention_chunk_size", None)
    if isinstance(chunk, int):
        windows.append(chunk)
    return min(windows) if windows else None


@dataclass(frozen=True)
class PackedAttention:
    """How packed rows reach one model's attention: `path` (module docstring), the model's implementation,
    and the additive mask's dtype for eager attention (None: a bool mask)."""

    path: str
    attn_implementation: str | None = None
    mask_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.path not in PACKED_ATTENTION_PATHS[1:]:
            raise ValueError(f"path must be one of {PACKED_ATTENTION_PATHS[1:]}, got {self.path!r}")

    def model_inputs(self, batch: Mapping[str, Tensor]) -> dict[str, Any]:
        """Keyword arguments of the base model's forward for a packed batch (`input_ids [1, total]`,
        `position_ids [1, total]`, `cu_seqlens [S+1]`, and from `collate_packed` its host copy
        `cu_seqlens_host`): input_ids, position_ids and the path's attention inputs. No `attention_mask` on the
        varlen and position_ids paths (flash-attention would unpad by it); sdpa_varlen gets an all-ones one
        (`sdpa_varlen.packed_row_mask`: no mask is built from it) and host `cu_seq_lens_q/k`. The varlen and
        sdpa_varlen paths read the sequence bounds from the host copy (no device sync); without one (or with one
        not on the host) from cu_seqlens."""
        ids, cu = batch["input_ids"], batch["cu_seqlens"]
        if ids.ndim != 2 or ids.shape[0] != 1:
            raise ValueError(f"input_ids: a packed batch is one row [1, total], got {tuple(ids.shape)}")
        inputs: dict[str, Any] = {"input_ids": ids, "position_ids": batch["position_ids"]}
        if self.path == "varlen":
            host = _host_offsets(batch)
            longest = int((host[1:] - host[:-1]).max())
            cu = cu.to(device=ids.device, dtype=torch.int32)
            inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
        elif self.path == "sdpa_varlen":
            cu = _host_offsets(batch)
            inputs.update(attention_mask=packed_row_mask(ids), cu_seq_lens_q=cu, cu_seq_lens_k=cu)
        elif self.path == "flex":
            inputs["attention_mask"] = _block_mask(document_ids(cu, ids.shape[1]))
        elif self.path == "mask":
            inputs["attention_mask"] = _dense_mask(document_ids(cu, ids.shape[1]), self.mask_dtype)
        return inputs


def _host_offsets(batch: Mapping[str, Tensor]) -> Tensor:
    """The batch's sequence offsets on the host, int32: `cu_seqlens_host` when it is there (checked against
    cu_seqlens by shape only: reading the device copy is what it saves), else cu_seqlens copied to the host."""
    cu, host = batch["cu_seqlens"], batch.get(CU_SEQLENS_HOST)
    if host is None or host.device.type != "cpu":
        return cu.to(device="cpu", dtype=torch.int32)
    if host.shape != cu.shape:
        raise ValueError(f"{CU_SEQLENS_HOST} {tuple(host.shape)} must be the host copy of cu_seqlens "
                         f"{tuple(cu.shape)}")
    return host.to(dtype=torch.int32)


def document_ids(cu_seqlens: Tensor, total: int) -> Tensor:
    """doc[t] = s for cu[s] <= t < cu[s+1]: int64 [total], on cu_seqlens' device, without a host sync."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    docs = torch.arange(lengths.numel(), device=cu_seqlens.device)
    return torch.repeat_interleave(docs, lengths, output_size=total)


def _dense_mask(doc: Tensor, dtype: torch.dtype | None) -> Tensor:
    """[1, 1, T, T]: True (or 0) where doc(q) == doc(k) and k <= q; False (or dtype-min) elsewhere."""
    n = doc.numel()
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(n, n, dtype=torch.bool, device=doc.device).tril()
    if dtype is None:
        return allowed[None, None]
    mask = torch.zeros(n, n, dtype=dtype, device=doc.device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


#: flex attention's default tile (torch.nn.attention.flex_attention._DEFAULT_SPARSE_BLOCK_SIZE)
FLEX_BLOCK = 128
#: the smallest head dimension flex attention's CUDA (Triton) kernel takes: its tl.dot needs >= 16; PyTorch's
#: lowering raises NotImplementedError ("NYI: embedding dimension ... at least 16") below it
FLEX_CUDA_MIN_HEAD_DIM = 16


def _head_dims(config: Any) -> list[int]:
    """The attention head dimensions of a transformers config: `head_dim` (else hidden_size / heads) and, where
    the value heads differ, `v_head_dim`."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(text, "head_dim", None)
    heads, hidden = getattr(text, "num_attention_heads", None), getattr(text, "hidden_size", None)
    if not isinstance(head_dim, int) and isinstance(heads, int) and isinstance(hidden, int) and heads > 0:
        head_dim = hidden // heads
    dims = [head_dim, getattr(text, "v_head_dim", None)]
    return [d for d in dims if isinstance(d, int)]


def flex_runs_on_cuda(config: Any) -> bool:
    """Whether flex attention's CUDA kernel takes the model's head dimensions (all >= FLEX_CUDA_MIN_HEAD_DIM)."""
    return all(d >= FLEX_CUDA_MIN_HEAD_DIM for d in _head_dims(config))


def _ordered(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """A [nq, nk] bool block map as flex's (count, column indices: the set ones first, ascending), [1, 1, ...]."""
    dense = blocks.to(torch.int32)
    cols = torch.argsort(dense, dim=-1, descending=True, stable=True)
    return dense.sum(-1, dtype=torch.int32)[None, None], cols.to(torch.int32)[None, None].contiguous()


def _block_mask(doc: Tensor, block: int = FLEX_BLOCK) -> Any:
    """The BlockMask of allowed(q, k) = doc(q) == doc(k) and k <= q, built from the documents of each tile's
    first and last token in O(total + tiles²) work (torch's create_block_mask evaluates the rule at every one of
    the total² pairs). With tiles of `block` tokens, qb / kb tile indices and docs contiguous ranges:
    a tile pair kb < qb holds an allowed pair iff last_doc(kb) == first_doc(qb) (every key precedes every
    query, so only the shared document can match), and is full iff both tiles hold that one document only
    and are complete; a diagonal tile always holds allowed pairs (q attends itself) and never is full."""
    from torch.nn.attention.flex_attention import BlockMask

    def document_causal(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return (doc[q] == doc[k]) & (k <= q)

    n = doc.numel()
    tiles = -(-n // block)
    starts = torch.arange(tiles, device=doc.device) * block
    ends = (starts + block).clamp(max=n)
    first, last = doc[starts], doc[ends - 1]
    complete = (ends - starts) == block
    qb, kb = torch.arange(tiles, device=doc.device)[:, None], torch.arange(tiles, device=doc.device)[None, :]
    below = kb < qb
    partial_or_full = (below & (last[None, :] == first[:, None])) | (kb == qb)
    one_doc = (first == last) & complete
    full = below & one_doc[:, None] & one_doc[None, :] & (first[:, None] == first[None, :])
    counts, cols = _ordered(partial_or_full & ~full)
    full_counts, full_cols = _ordered(full)
    return BlockMask.from_kv_blocks(counts, cols, full_counts, full_cols, BLOCK_SIZE=block,
                                    mask_mod=document_causal, seq_lengths=(n, n))


def auto_attention(model: nn.Module, device: torch.device | str, *, half: bool, max_seq_len: int | None = None
                   ) -> str | None:
    """Switch an eager / sdpa model to the packed implementation that skips masked work. On CUDA:
    `flash_attention_2` when flash-attn is installed and the compute dtype is half (`half`), else
    `flex_attention` (not for a sliding window shorter than `max_seq_len`: its BlockMask here is full causal;
    not for a head dimension below 16, which flex's CUDA kernel refuses);
    on CPU, or when neither applies, `SDPA_VARLEN` (`integrations.sdpa_varlen`: one call of PyTorch's flash
    varlen kernel on CUDA in half precision, one SDPA call per sequence otherwise) unless the model soft-caps
    its attention logits or has attention sinks (it then keeps the dense mask). bench/packed_attention.py
    times these kernels. Returns the implementation set (via transformers' `set_attn_implementation`), or
    None: another implementation already chosen by the user, or none available."""
    impl = attention_implementation(model)
    lm = unwrap_model(model)
    if impl not in ("eager", "sdpa") or not hasattr(lm, "set_attn_implementation"):
        return None
    candidates = []
    if torch.device(device).type == "cuda":
        if half and importlib.util.find_spec("flash_attn") is not None:
            candidates.append("flash_attention_2")
        window = _limited_window(lm.config)
        if flex_runs_on_cuda(lm.config) and (window is None or (max_seq_len is not None and max_seq_len <= window)):
            candidates.append("flex_attention")
    if not _has_softcap_or_sinks(lm):
        candidates.append(SDPA_VARLEN)
    for name in candidates:
        try:
            lm.set_attn_implementation(name)
        except (ImportError, ValueError):
            continue
        return name
    return None


def half_precision_compute(model: nn.Module, amp_dtype: torch.dtype | None) -> bool:
    """Whether the model computes in bf16 / fp16 (autocast `amp_dtype`, or its weights): `auto_attention`'s
    `half` (flash-attention runs only in half precision)."""
    half = (torch.float16, torch.bfloat16)
    param = next(model.parameters(), None)
    return amp_dtype in half or (param is not None and param.dtype in half)


def _has_softcap_or_sinks(lm: nn.Module) -> bool:
    """Attention logit soft-capping (Gemma 2's `attn_logit_softcapping`) or attention sinks (modules with a
    `sinks` parameter, gpt-oss): keywords `SDPA_VARLEN` refuses, so `auto` leaves such a model on its dense-mask
    path."""
    config = getattr(lm, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "attn_logit_softcapping", None) is not None:
        return True
    return any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in lm.modules())


def use_sdpa_varlen(model: nn.Module) -> bool:
    """Switch an eager / sdpa model to `SDPA_VARLEN` (the forced `packed_attention="sdpa_varlen"`); True if set."""
    lm = unwrap_model(model)
    if attention_implementation(model) not in ("eager", "sdpa") or not hasattr(lm, "set_attn_implementation"):
        return False
    lm.set_attn_implementation(SDPA_VARLEN)
    return True


def resolve_packed_attention(
    model: nn.Module, *, path: str = "auto", device: torch.device | str = "cpu", max_seq_len: int | None = None,
) -> PackedAttention:
    """The packed path for `model` on `device` (`path="auto"`: by its attention implementation, module docstring).

    Raises `PackedAttentionError` where packing cannot be exact: no transformers attention implementation
    (auto), an implementation other than eager / sdpa / flex_attention / flash_attention_*, flex attention
    on CPU (no flex backward there, and the compiled forward fails at a second sequence length, so a frozen
    model too) or on CUDA with a head dimension below 16 (its kernel refuses it), a forced path the
    implementation does not take,
    or a sliding-window / chunked-attention model (mask and flex paths; chunked only on sdpa_varlen, which
    applies sliding windows per sequence) whose window is shorter than `max_seq_len` (with shorter sequences
    the window never binds)."""
    if path not in PACKED_ATTENTION_PATHS:
        raise ValueError(f"packed_attention must be one of {PACKED_ATTENTION_PATHS}, got {path!r}")
    impl = attention_implementation(model)
    chosen = _auto_path(impl) if path == "auto" else path
    if path not in ("auto", "position_ids") and impl is not None and _auto_path(impl) != chosen:
        raise PackedAttentionError(
            f"packed_attention={path!r} does not fit attention implementation {impl!r} "
            f"(it takes {_auto_path(impl)!r}); use packed_attention='auto'"
        )
    if chosen == "flex" and torch.device(device).type == "cpu":
        raise PackedAttentionError(
            "layout='packed' with flex_attention on CPU: PyTorch's flex attention has no backward on CPU, and its "
            "compiled forward fails at the second sequence length it meets there; use attn_implementation='sdpa' "
            "or 'eager' (the trainer then attends each sequence on its own)"
        )
    config = getattr(unwrap_model(model), "config", None)
    on_cuda = torch.device(device).type == "cuda"
    if chosen == "flex" and on_cuda and config is not None and not flex_runs_on_cuda(config):
        raise PackedAttentionError(
            f"flex_attention on CUDA: head dimensions {_head_dims(config)}; flex attention's CUDA kernel needs "
            f">= {FLEX_CUDA_MIN_HEAD_DIM}. Use attn_implementation='sdpa' (the trainer then attends each sequence "
            "on its own)"
        )
    window = _limited_window(config, sliding=chosen != "sdpa_varlen") if config is not None else None
    binds = window is not None and (max_seq_len is None or max_seq_len > window)
    if binds and chosen in ("mask", "flex", "sdpa_varlen"):
        raise PackedAttentionError(
            f"layout='packed': the model uses sliding-window / chunked attention (window {window}) and "
            f"max_seq_len={max_seq_len} exceeds it; the {chosen} path does not apply it. "
            "Use flash_attention_2 or (sliding windows) sdpa_varlen, max_seq_len <= the window, or layout='padded'"
        )
    mask_dtype = None
    if chosen == "mask" and impl == "eager":
        emb = unwrap_model(model).get_input_embeddings()
        mask_dtype = emb.weight.dtype if emb is not None and emb.weight.is_floating_point() else torch.float32
    return PackedAttention(path=chosen, attn_implementation=impl, mask_dtype=mask_dtype)


def _probe_rows(vocab: int, lengths: Sequence[int], seed: int) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    first, second = (torch.randint(0, vocab, (n,), generator=g) for n in lengths)
    other = (first + 1 + torch.randint(0, vocab - 1, first.shape, generator=g)) % vocab  # differs everywhere
    return first, other, second


@torch.no_grad()
def check_packed_attention(
    model: nn.Module, packing: PackedAttention, *, lengths: Sequence[int] = (7, 5), seed: int = 0,
    rtol: float | None = None, autocast_dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """Probe that a packed forward of `model` is exact: raises `PackedAttentionError` otherwise.

    Two sequences A (lengths[0] tokens) and B run packed as [A, B] and [A', B] (A' differs from A at every
    token) and each alone. Isolation: B's final hidden states must not change with A (max |Δ| over max |h|
    at most 1e-5 in fp32, 1e-3 in half precision: exact masking gives 0). Positions: each sequence packed
    equals it alone (relative error at most `rtol`, default 1e-4 in fp32 and 5e-2 in half precision).
    Runs in eval mode (no dropout) inside the model's forward (`call_in_forward`), under
    `torch.autocast(autocast_dtype)` when given (as the trainer's mixed precision runs it: flash-attention needs
    half precision; half-precision tolerances then); returns both errors."""
    lm = unwrap_model(model)
    emb = lm.get_input_embeddings() if hasattr(lm, "get_input_embeddings") else None
    if emb is None or not hasattr(emb, "num_embeddings"):
        raise PackedAttentionError("layout='packed': cannot probe a model without input embeddings")
    param = next(lm.parameters())
    half = (autocast_dtype or param.dtype) in (torch.float16, torch.bfloat16)
    iso_tol, pos_tol = (1e-3, 5e-2) if half else (1e-5, 1e-4)
    pos_tol = pos_tol if rtol is None else rtol
    first, other, second = _probe_rows(emb.num_embeddings, lengths, seed)
    device = param.device

    def hidden(*seqs: Tensor) -> Tensor:
        lens = [s.numel() for s in seqs]
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        batch = {
            "input_ids": torch.cat(seqs)[None].to(device),
            "position_ids": torch.cat([torch.arange(n) for n in lens])[None].to(device),
            "cu_seqlens": cu.to(device),
        }
        inputs = packing.model_inputs(batch) if len(seqs) > 1 else {"input_ids": batch["input_ids"]}
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            out = call_in_forward(model, lambda m, **kw: final_hidden_states(m, **kw), **inputs)
        return out[0].float()

    was_training = model.training
    model.eval()
    try:
        packed, packed_other = hidden(first, second), hidden(other, second)
        alone_a, alone_b = hidden(first), hidden(second)
    finally:
        model.train(was_training)
    n = lengths[0]
    scale = max(float(alone_b.abs().max()), float(alone_a.abs().max()), 1e-6)
    isolation = float((packed[n:] - packed_other[n:]).abs().max()) / scale
    positions = max(float((packed[:n] - alone_a).abs().max()), float((packed[n:] - alone_b).abs().max())) / scale
    name = f"{type(lm).__name__} ({packing.attn_implementation}, path {packing.path!r})"
    if not isolation <= iso_tol:
        raise PackedAttentionError(
            f"layout='packed': {name} lets a packed sequence attend the one before it (relative change "
            f"{isolation:.3g} > {iso_tol:g}); use layout='padded' or another attention implementation"
        )
    if not positions <= pos_tol:
        raise PackedAttentionError(
            f"layout='packed': {name} gives a packed sequence other hidden states than the sequence alone "
            f"(relative error {positions:.3g} > {pos_tol:g}); are restarting position_ids ignored? "
            "Use layout='padded'"
        )
    return {"isolation": isolation, "positions": positions}


__all__ = [
    "PACKED_ATTENTION_PATHS",
    "PackedAttentionError",
    "PackedAttention",
    "attention_implementation",
    "auto_attention",
    "use_sdpa_varlen",
    "half_precision_compute",
    "document_ids",
    "resolve_packed_attention",
    "check_packed_attention",
]
