"""The head op: per-token logprob / entropy from hidden states and the lm_head weight, with backend dispatch.

    z = softcap(logit_scale * (h W^T + b)) / T
    logprob_t = z_{t, y_t} - logsumexp(z_t),   H_t = -sum_v p_{t,v} log p_{t,v}

Backends (same numbers): "torch" (chunked PyTorch, any device) and "triton" (CUDA; under
TRITON_INTERPRET=1 also CPU tensors). "auto" picks triton for CUDA tensors and torch otherwise.
Inside `torch.autocast`, the fp32 hidden states, weight and bias are cast to the autocast dtype first (as
autocast casts a matmul's inputs) and the head runs with autocast off: each backend computes exactly what it
computes for inputs of that dtype (on CUDA both keep fp32 logits and statistics: the same numbers).
Under `torch.compile` the torch backend is traced like any PyTorch code; a triton call (the head op, a fused
loss, a divergence) runs outside the graph (`torch.compiler.disable`: one graph break), since dynamo cannot
trace the kernels' launch path (the interpreter's, or TMA descriptors and device contexts on CUDA).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from ludic_fast._common import HeadOutput, autocast_as_matmul, validate_head_inputs
from ludic_fast.ops.divergence import linear_divergence
from ludic_fast.ops.torch_head import HeadTransform, LinearLogprobsFunction, torch_blocks

BACKENDS = ("auto", "torch", "triton")


def resolve_backend(backend: str, device: torch.device) -> str:
    """'auto' -> 'triton' on CUDA, else 'torch'; 'triton' off CUDA only under TRITON_INTERPRET=1."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"backend='triton' needs CUDA tensors (got device {device}); "
            "set TRITON_INTERPRET=1 before importing triton to run the kernels on CPU, or use backend='torch'"
        )
    return backend


@autocast_as_matmul("hidden", "weight", "bias")
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
    backend: str = "auto",
    chunk_elements: int | None = None,
    memory_budget: int | str | None = None,
    process_group: object | None = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    reduce_grad_hidden: bool = True,
) -> HeadOutput:
    """Per-token log p(y) and entropy of `z = softcap(logit_scale (h W^T + b)) / T`, without [N, V] logits.

    hidden [..., D] (any float dtype, any strides), weight [V, D], targets [...] ints, temperature a float
    or a tensor with the shape of targets (finite and > 0; one that requires grad is refused: the head gives
    temperature no gradient). Returns `HeadOutput(logprobs, entropy, lse)` with the shape of
    targets, float32 (float64 when hidden or weight is float64); logprobs and entropy are 0 where
    `targets == ignore_index`. Differentiable w.r.t. hidden, weight and bias for any upstream gradients of
    logprobs and entropy:
    dz_j = g_lp (1[j=y] - p_j) - g_H p_j (z_j - E_p z).

    `memory_budget`: bytes (an int, or a string like '4GiB') the call may hold beyond its inputs and
    outputs; the cost model of `ops.plan` picks the chunking and strategy predicted fastest within it. On the
    triton backend, a budget of 4 N V bytes or more lets a call with gradients keep its forward's fp32 logits
    until its backward (no recompute: 6NDV instead of 8NDV; held per call until that call's backward).
    Default: on a GPU the fp32 gradient accumulators plus min(1 GiB, 1/64 of device memory); on the CPU
    chunks of `budget.DEFAULT_CHUNK_ELEMENTS` logit elements. `chunk_elements` is the low-level override
    (tokens x vocab columns of one transient logits chunk); with neither argument, env
    LUDIC_FAST_CHUNK_ELEMENTS (read at each call) is that override when set.

    Vocab-parallel: with `process_group=pg, vocab_start=s`, `weight` holds rows `[s, s + V_local)` of the
    global vocabulary (of `vocab_size` rows; summed over the group when None) and targets are global ids;
    results equal the unsharded op (`ops.vocab_parallel`; torch backend, collective, generic mode).
    """
    if process_group is not None or vocab_start is not None:
        return _vocab_parallel(
            hidden, weight, targets, process_group, vocab_start or 0, vocab_size, backend, reduce_grad_hidden,
            bias=bias, logit_scale=logit_scale, softcap=softcap, temperature=temperature, entropy=entropy,
            ignore_index=ignore_index, chunk_elements=chunk_elements, memory_budget=memory_budget,
        )
    validate_head_inputs(hidden, weight, targets, bias, logit_scale, softcap, temperature, ignore_index)
    impl = resolve_backend(backend, hidden.device)
    out_shape = targets.shape
    h2 = hidden.reshape(-1, hidden.shape[-1])
    t1 = targets.reshape(-1)
    transform = HeadTransform.build(logit_scale, softcap, temperature, t1.numel(), hidden.device)
    if impl == "triton":
        from ludic_fast.ops.triton_head import triton_linear_logprobs

        lp, ent, lse = triton_linear_logprobs(
            h2, weight, bias, t1, transform, entropy, ignore_index, chunk_elements=chunk_elements,
            memory_budget=memory_budget,
        )
    else:
        blocks = torch_blocks(h2, weight, bias, chunk_elements, memory_budget)
        lp, ent, lse = LinearLogprobsFunction.apply(h2, weight, bias, t1, (transform, blocks, ignore_index), entropy)
    return HeadOutput(
        lp.reshape(out_shape), ent.reshape(out_shape) if entropy else None, lse.reshape(out_shape)
    )


def _vocab_parallel(hidden, weight, targets, group, vocab_start, vocab_size, backend, reduce_dh, **head_kwargs):
    """Route a sharded-vocabulary call to `ops.vocab_parallel` (torch backend only)."""
    import torch.distributed as dist

    from ludic_fast.ops.vocab_parallel import vocab_parallel_linear_logprobs

    if backend not in ("auto", "torch"):
        raise ValueError(f"backend={backend!r}: the vocab-parallel head runs on the torch backend only")
    if vocab_size is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("process_group: torch.distributed is not initialized (call init_process_group first)")
        total = torch.tensor([weight.shape[0]], device=weight.device)
        dist.all_reduce(total, group=group)
        vocab_size = int(total)
    return vocab_parallel_linear_logprobs(
        hidden, weight, targets, process_group=group, vocab_start=vocab_start, vocab_size=vocab_size,
        reduce_grad_hidden=reduce_dh, **head_kwargs,
    )


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    reduction: str = "mean",
    ignore_index: int = -100,
    **head_kwargs,
) -> Tensor:
    """SFT cross-entropy `-log p(y)` from hidden states; reduction 'none' | 'sum' | 'mean' (over
    non-ignored tokens)."""
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"reduction must be 'none', 'sum' or 'mean', got {reduction!r}")
    out = linear_logprobs(hidden, weight, targets, entropy=False, ignore_index=ignore_index, **head_kwargs)
    nll = -out.logprobs
    if reduction == "none":
        return nll
    if reduction == "sum":
        return nll.sum()
    return nll.sum() / (targets != ignore_index).sum().clamp(min=1)


__all__ = ["linear_divergence", "linear_logprobs", "linear_cross_entropy", "resolve_backend", "HeadOutput", "BACKENDS"]
