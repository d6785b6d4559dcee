"""log Σ_v p_v² per action token, the alignment term of WPO's weights (Zhou et al., arXiv 2406.11827, eq. 2).

For final logits z of a token, log Σ_v p_v² = logsumexp(2z) - 2 logsumexp(z). Computed without gradients
over row chunks of the action tokens (never [N, V]): one extra forward GEMM pass (2NDV) when the batch does
not carry it. The head transform is the loss call's (`softcap(logit_scale (h W^T + b)) / T`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from ludic_fast.ops.budget import default_chunk_elements, parse_memory_budget
from ludic_fast.ops.torch_head import HeadTransform
from ludic_fast.token_batch import TokenBatch

WPO_KEY = "log_sum_sq_probs"


def _log_sum_sq(z: Tensor) -> Tensor:
    return torch.logsumexp(2.0 * z, dim=-1) - 2.0 * torch.logsumexp(z, dim=-1)


def _chunk_rows(vocab: int, chunk_elements: int | None, memory_budget: int | str | None) -> int:
    """Rows per chunk: the chunk's logits and their doubled copy (2 V floats a row of 4 or 8 bytes) within
    `memory_budget` bytes, else `chunk_elements` logits, else the default chunk."""
    budget = parse_memory_budget(memory_budget)
    elements = budget // 16 if budget is not None else chunk_elements or default_chunk_elements()
    return max(1, elements // vocab)


@torch.no_grad()
def with_log_sum_sq_probs(
    batch: Mapping[str, Tensor],
    *,
    hidden: Tensor | None = None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    logits: Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    temperature: float | Tensor = 1.0,
    chunk_elements: int | None = None,
    memory_budget: int | str | None = None,
    **_head_options: object,
) -> dict[str, Tensor]:
    """A copy of `batch` with batch['log_sum_sq_probs'] [B, T] (the value of the token scored from position j
    stored at j+1, as batch['ref_logps']; 0 elsewhere), float32 (float64 for float64 inputs). `_head_options`
    (fused, backend) choose how the loss pass runs and do not change these values."""
    if (hidden is None) == (logits is None):
        raise ValueError("pass exactly one of hidden= (with weight=) or logits=")
    tb = TokenBatch.from_batch(batch)
    source = logits if logits is not None else hidden
    if weight is None and logits is None:
        raise ValueError("weight (the lm_head weight [V, D]) is required with hidden=")
    rows_x = source.reshape(-1, source.shape[-1]).index_select(0, tb.rows)
    vocab = source.shape[-1] if logits is not None else weight.shape[0]
    temp = temperature.reshape(-1)[tb.rows] if isinstance(temperature, Tensor) and temperature.ndim > 0 else temperature
    transform = HeadTransform.build(logit_scale, softcap, temp, tb.n, source.device)
    compute = source.dtype if weight is None else torch.promote_types(source.dtype, weight.dtype)
    wide = torch.float64 if compute == torch.float64 else torch.float32
    out = torch.zeros(tb.n, dtype=wide, device=source.device)
    step = _chunk_rows(vocab, chunk_elements, memory_budget)
    w_t = None if weight is None else weight.to(compute).T  # a copy only when hidden and weight dtypes differ
    for start in range(0, tb.n, step):
        rows = slice(start, min(start + step, tb.n))
        if logits is not None:
            z = rows_x[rows].to(wide)
        else:  # the GEMM in the operands' dtype (as the head's on the CPU), the statistics in float32 / float64
            z = (rows_x[rows].to(compute) @ w_t).to(wide)
            if bias is not None:
                z += bias.to(wide)
            z = transform.apply_(z, rows)
        out[rows] = _log_sum_sq(z)
    flat = torch.zeros(batch["input_ids"].numel(), dtype=wide, device=source.device)
    flat[tb.rows + 1] = out
    return {**batch, WPO_KEY: flat.reshape(batch["input_ids"].shape)}
