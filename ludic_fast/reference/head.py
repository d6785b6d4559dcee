"""The head op's twin: logits of the head, their log-probs and entropies, materialised (float64 inside)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ludic_fast._common import HeadOutput, per_token_temperature, validate_head_inputs


# --------------------------------------------------------------------------------------------- head op
def head_logits(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    temperature: float | Tensor = 1.0,
) -> Tensor:
    """Materialised final logits `softcap(logit_scale * (h W^T + b)) / T`, float32 (float64 if any input is)."""
    dtype = torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32
    z = hidden.to(dtype) @ weight.to(dtype).T
    if bias is not None:
        z = z + bias.to(dtype)
    z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    temp = per_token_temperature(temperature, hidden.shape[:-1].numel(), hidden.device)
    return z / temp.to(dtype).reshape(*hidden.shape[:-1], 1)


def logprobs_from_logits(
    logits: Tensor, targets: Tensor, *, entropy: bool = True, ignore_index: int = -100
) -> HeadOutput:
    """Per-token log p(target), entropy and logsumexp from materialised logits `[..., V]`."""
    out_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logp = torch.log_softmax(logits.double(), dim=-1)
    valid = targets != ignore_index
    safe_targets = torch.where(valid, targets, torch.zeros_like(targets))
    zero = torch.zeros((), dtype=torch.float64, device=logits.device)
    lp = torch.where(valid, logp.gather(-1, safe_targets.unsqueeze(-1).long()).squeeze(-1), zero).to(out_dtype)
    ent = None
    if entropy:
        ent = torch.where(valid, _entropy_from_logp(logp), zero).to(out_dtype)
    lse = torch.logsumexp(logits.double(), dim=-1).to(out_dtype).detach()
    return HeadOutput(lp, ent, lse)


def _entropy_from_logp(logp: Tensor) -> Tensor:
    """H = -sum_v p_v log p_v over the last dim, with 0 log 0 = 0 (value and gradient) for p_v = 0."""
    p = logp.exp()
    safe_logp = torch.where(p > 0, logp, torch.zeros((), dtype=logp.dtype, device=logp.device))
    return -(p * safe_logp).sum(-1)


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim: float64 log-softmax (shifted by the row maximum, so a
    confident token keeps its relative precision), 0 log 0 = 0; float32 out (float64 for float64 logits)."""
    out_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return _entropy_from_logp(torch.log_softmax(logits.double(), dim=-1)).to(out_dtype)


def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    temperature: float | Tensor = 1.0,
    entropy: bool = True,
    ignore_index: int = -100,
) -> HeadOutput:
    """Reference for `ludic_fast.linear_logprobs`: materialises all `[N, V]` logits."""
    validate_head_inputs(hidden, weight, targets, bias, logit_scale, softcap, temperature, ignore_index)
    logits = head_logits(
        hidden, weight, bias, logit_scale=logit_scale, softcap=softcap, temperature=temperature
    )
    return logprobs_from_logits(logits, targets, entropy=entropy, ignore_index=ignore_index)


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    reduction: str = "mean",
    ignore_index: int = -100,
    **head_kwargs: Any,
) -> Tensor:
    """Reference SFT cross-entropy `-logprob`, reduced over non-ignored tokens (none | sum | mean)."""
    out = linear_logprobs(hidden, weight, targets, entropy=False, ignore_index=ignore_index, **head_kwargs)
    nll = -out.logprobs
    if reduction == "none":
        return nll
    if reduction == "sum":
        return nll.sum()
    if reduction == "mean":
        return nll.sum() / (targets != ignore_index).sum().clamp(min=1)
    raise ValueError(f"reduction must be 'none', 'sum' or 'mean', got {reduction!r}")
