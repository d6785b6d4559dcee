"""Exact varlen attention without flash-attn: the sequences of a packed row attended one at a time.

A packed row `[1, heads, total, head_dim]` holds S sequences at `cu_seqlens` (sequence s occupies
`[cu[s], cu[s+1])`). Block-diagonal causal attention over the row equals causal attention over each sequence
alone, so

    out[cu[s]:cu[s+1]] = SDPA(q[cu[s]:cu[s+1]], k[...], v[...], is_causal=True)

with PyTorch's `scaled_dot_product_attention`
(https://pytorch.org/docs/stable/generated/torch.nn.functional.scaled_dot_product_attention.html): Σ L_s²
attention work instead of the total² of a dense block-diagonal mask, no mask memory, autograd on every device.
On CUDA in half precision the row goes to PyTorch's flash-attention varlen kernel in one call
(`torch.nn.attention.varlen.varlen_attn`: the row and its offsets as they are, GQA without repeating the kv
heads where it takes `enable_gqa`, a sliding window as its `window_size`); where that does not apply (attention
dropout, which it has none of; a head dimension the flash kernel does not take) to SDPA in one call as a
nested jagged tensor (PyTorch's varlen flash / memory-efficient kernels); elsewhere one SDPA call per
sequence.
A sliding window w (the `sliding_window` keyword the model passes its attention function) keeps keys with
`q - w < k <= q` inside each sequence, as transformers' masks do.

The function is registered in transformers' `AttentionInterface` as `SDPA_VARLEN`, with `sdpa_varlen_mask`
(transformers' sdpa mask) in `AttentionMaskInterface`: a call without `cu_seq_lens_q` (a padded batch,
generation) runs transformers' `sdpa_attention_forward` unchanged. A packed forward passes `cu_seq_lens_q` /
`cu_seq_lens_k` (host tensors, so splitting the row needs no device sync; read once per forward, not per layer)
and `packed_row_mask(ids)`, an all-ones 2D `attention_mask` (without one transformers would find the packed
sequences in `position_ids` and build a dense 4D mask), which `sdpa_varlen_mask` answers with no mask without
reading it (transformers' sdpa mask would check that it is all ones: a device sync); the packed path needs none.
The per-sequence part runs outside `torch.compile` (`torch.compiler.disable`): its split depends on each batch.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.varlen import varlen_attn  # PyTorch's flash-attention varlen entry point
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward, use_gqa_in_sdpa
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

#: the attention implementation name (`config._attn_implementation`); contains "sdpa" so that transformers
#: checks the model supports SDPA when it is set
SDPA_VARLEN = "ludic_sdpa_varlen"

_UNSUPPORTED = ("softcap", "s_aux")
#: use_gqa_in_sdpa takes (attention_mask, key) in transformers 5.10 and (attention_mask, key, value) by 5.17
_GQA_ARITY = len(inspect.signature(use_gqa_in_sdpa).parameters)
#: its keywords: `window_size` (so causal) from torch 2.11, `enable_gqa` in later releases
_VARLEN_PARAMS = inspect.signature(varlen_attn).parameters
#: the head dimensions PyTorch's flash kernel takes (multiples of 8 up to 256)
FLASH_HEAD_DIMS = range(8, 257, 8)


def sdpa_varlen_attention_forward(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
    dropout: float = 0.0, scaling: float | None = None, **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers attention function: query `[1, heads, total, d]`, key / value `[1, kv_heads, total, d]`
    (GQA: kv heads repeated, or SDPA's `enable_gqa`, as transformers' sdpa does) -> `([1, total, heads, d],
    None)`, causal within each sequence of `cu_seq_lens_q`. Without `cu_seq_lens_q`: transformers' sdpa."""
    if kwargs.get("cu_seq_lens_q") is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return _per_sequence(module, query, key, value, dropout, scaling, kwargs), None


@torch.compiler.disable  # the split depends on each batch's cu_seqlens: compiling it would recompile per batch
def _per_sequence(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, dropout: float,
                  scaling: float | None, kwargs: dict[str, Any]) -> Tensor:
    for name in _UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise ValueError(f"{SDPA_VARLEN}: attention keyword {name!r} is not supported; "
                             "use packed_attention='mask' (eager) or layout='padded'")
    cu, cu_k = kwargs["cu_seq_lens_q"], kwargs.get("cu_seq_lens_k")
    if cu_k is not None and cu_k is not cu and not torch.equal(cu_k.cpu(), cu.cpu()):
        raise ValueError(f"{SDPA_VARLEN}: cu_seq_lens_k must equal cu_seq_lens_q (self-attention over a packed row)")
    split = _split(cu)
    bounds = split.bounds
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    total = query.shape[2]
    if query.shape[0] != 1 or key.shape[2] != total or bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(f"{SDPA_VARLEN}: cu_seq_lens_q {bounds} must split one packed row of {total} query and key "
                         f"tokens, got query {tuple(query.shape)}, key {tuple(key.shape)} (no KV cache)")
    window = kwargs.get("sliding_window")
    groups = getattr(module, "num_key_value_groups", 1)
    if flash_varlen_applies(query, lengths, dropout):
        return _flash_varlen(query, key, value, split, groups, window, scaling)
    nested = nested_applies(query, lengths, window)
    gqa = groups > 1 and not nested and window is None and use_gqa_in_sdpa(*(None, key, value)[:_GQA_ARITY])
    if groups > 1 and not gqa:  # jagged SDPA does not take enable_gqa
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    if nested:
        return _nested(query, key, value, split, dropout, scaling)
    return _loop(query, key, value, lengths, window, dropout, scaling, {"enable_gqa": True} if gqa else {})


class _Split:
    """A packed row's sequence bounds, read once (`bounds`), and their copy on each device that uses them
    (`offsets`: the jagged tensors' int64 offsets, the flash kernel's int32 ones; copied once per forward, not
    per layer)."""

    def __init__(self, bounds: list[int]) -> None:
        self.bounds = bounds
        self._offsets: dict[tuple[torch.device, torch.dtype], Tensor] = {}

    def offsets(self, device: torch.device, dtype: torch.dtype = torch.int64) -> Tensor:
        """The bounds as a `dtype` tensor on `device`; to a CUDA device from pinned memory (a copy from pageable
        memory waits for the stream's queued work first)."""
        if (device, dtype) not in self._offsets:
            host = torch.tensor(self.bounds, dtype=dtype)
            if device.type == "cuda":
                host = host.pin_memory()
            self._offsets[device, dtype] = host.to(device, non_blocking=True)
        return self._offsets[device, dtype]


#: the last cu_seq_lens_q read: (the tensor, its version counter, its split); every layer of a forward gets the
#: same tensor, so the split is read once per forward
_last_split: tuple[Tensor, int, _Split] | None = None


def _split(cu: Tensor) -> _Split:
    """cu's split, read once per tensor (and per in-place change of it): the first layer reads it, the others
    reuse it. A host tensor (the packed batch's `cu_seqlens_host`): no device sync."""
    global _last_split
    if cu.is_inference():  # no version counter: read every time
        return _Split(cu.tolist())
    last = _last_split
    if last is not None and last[0] is cu and last[1] == cu._version:
        return last[2]
    split = _Split(cu.tolist())
    _last_split = (cu, cu._version, split)
    return split


def _compute_dtype(query: Tensor) -> torch.dtype:
    """The dtype SDPA computes in: the autocast dtype when autocast is on for the query's device, else its own."""
    device = query.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype


def flash_varlen_applies(query: Tensor, lengths: list[int], dropout: float) -> bool:
    """Whether the row runs as one call of PyTorch's flash varlen kernel (`_flash_varlen`): a torch whose
    `varlen_attn` takes `window_size`, on CUDA computing in half precision, no attention dropout (the entry
    point has none), a head dimension in FLASH_HEAD_DIMS, no empty sequence."""
    half = _compute_dtype(query) in (torch.float16, torch.bfloat16)
    return ("window_size" in _VARLEN_PARAMS and query.is_cuda and half and dropout == 0.0
            and query.shape[-1] in FLASH_HEAD_DIMS and min(lengths) > 0)


def _flash_varlen(query: Tensor, key: Tensor, value: Tensor, split: _Split, groups: int, window: int | None,
                  scaling: float | None) -> Tensor:
    """One call of `torch.nn.attention.varlen.varlen_attn` over the row: q `[total, heads, d]`, k / v
    `[total, kv_heads, d]` (GQA by its `enable_gqa` where it has one, else the kv heads repeated), the int32
    offsets on the device (made once per forward), causal within each sequence as `window_size=(-1, 0)`, a
    sliding window w (keys q - w < k <= q) as `(w - 1, 0)` -> `[1, total, heads, d]`. Under autocast the inputs
    are cast to its dtype here (autocast does not cast a custom op's) and the call runs outside it."""
    bounds = split.bounds
    longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    extra: dict[str, Any] = {}
    if groups > 1 and "enable_gqa" in _VARLEN_PARAMS:
        extra["enable_gqa"] = True
    elif groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    dtype = _compute_dtype(query)
    q, k, v = (x[0].transpose(0, 1).to(dtype).contiguous() for x in (query, key, value))
    cu = split.offsets(query.device, torch.int32)
    with torch.autocast(query.device.type, enabled=False):
        out = varlen_attn(q, k, v, cu, cu, longest, longest, scale=scaling,
                          window_size=(-1 if window is None else window - 1, 0), **extra)
    return out[None]


def nested_applies(query: Tensor, lengths: list[int], window: int | None) -> bool:
    """Whether the row runs as one SDPA call over nested jagged tensors (`_nested`): on CUDA computing in half
    precision (bf16 / fp16 query, or autocast to one; PyTorch's flash / memory-efficient varlen kernels; its
    math fallback refuses is_causal on jagged tensors, so the CPU keeps the loop), without a sliding window or
    an empty sequence."""
    half = _compute_dtype(query) in (torch.float16, torch.bfloat16)
    return query.is_cuda and half and window is None and min(lengths) > 0


def _loop(query: Tensor, key: Tensor, value: Tensor, lengths: list[int], window: int | None, dropout: float,
          scaling: float | None, extra: dict[str, Any]) -> Tensor:
    """One causal SDPA call per sequence (a sliding window as an explicit mask) -> [1, total, heads, d]."""
    outs = []
    for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2)):
        n = q.shape[2]
        mask = None
        if window is not None and n > window:
            i = torch.arange(n, device=q.device)
            lag = i[:, None] - i[None, :]
            mask = (lag >= 0) & (lag < window)
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                                   is_causal=mask is None, **extra))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def _nested(query: Tensor, key: Tensor, value: Tensor, bounds: list[int] | _Split, dropout: float,
            scaling: float | None) -> Tensor:
    """One causal SDPA call over the row as nested jagged tensors `[S, heads, j, d]` with offsets `bounds`
    (torch.nested.nested_tensor_from_jagged; causal per sequence) -> [1, total, heads, d]; given a `_Split`, the
    offsets it holds on the device (made once per forward). Under autocast the inputs are cast to its dtype
    here, as autocast casts SDPA's, and the call runs outside autocast."""
    split = bounds if isinstance(bounds, _Split) else _Split(bounds)
    bounds, offsets = split.bounds, split.offsets(query.device)
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    dtype = _compute_dtype(query)

    def jagged(x: Tensor) -> Tensor:
        values = x[0].transpose(0, 1).to(dtype).contiguous()  # [total, heads, d]
        nt = torch.nested.nested_tensor_from_jagged(values, offsets, min_seqlen=min(lengths),
                                                    max_seqlen=max(lengths))
        return nt.transpose(1, 2)

    with torch.autocast(query.device.type, enabled=False):
        out = F.scaled_dot_product_attention(jagged(query), jagged(key), jagged(value), dropout_p=dropout,
                                             scale=scaling, is_causal=True)
    return out.transpose(1, 2).values()[None]


#: the masks `packed_row_mask` made that are alive, by id
_PACKED_ROW_MASKS: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()


def packed_row_mask(input_ids: Tensor) -> Tensor:
    """The all-ones bool `attention_mask` of a packed row `input_ids [1, total]`, on its device: the mask function
    registered for SDPA_VARLEN returns no mask for it (a packed forward attends by `cu_seq_lens_q`)."""
    mask = torch.ones_like(input_ids, dtype=torch.bool)
    _PACKED_ROW_MASKS[id(mask)] = mask
    return mask


def sdpa_varlen_mask(*args: Any, **kwargs: Any) -> Tensor | None:
    """transformers' mask function for SDPA_VARLEN: None for a `packed_row_mask` (transformers hands the 2D mask
    over as it is when it is already bool on the model's device), else transformers' `sdpa_mask`."""
    mask = kwargs.get("attention_mask")
    if isinstance(mask, Tensor) and _PACKED_ROW_MASKS.get(id(mask)) is mask:
        return None
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(SDPA_VARLEN, sdpa_varlen_attention_forward)
AttentionMaskInterface.register(SDPA_VARLEN, sdpa_varlen_mask)

__all__ = ["SDPA_VARLEN", "sdpa_varlen_attention_forward", "flash_varlen_applies", "nested_applies", "packed_row_mask",
           "sdpa_varlen_mask"]
