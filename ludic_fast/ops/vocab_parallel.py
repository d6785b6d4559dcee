"""Vocab-parallel LM head: `weight` holds rows `[vocab_start, vocab_start + V_local)` of the global vocabulary.

Every rank of `process_group` sees the same hidden states and global target ids and computes, with the torch
backend's chunk machinery (`ChunkedHead`), the statistics of its own vocabulary rows:

    m_r = max_{v in r} z_v,   tail_r = sum_{v in r, v != argmax} e^{z_v - m_r},
    t_r = sum_{v in r} e^{z_v - m_r} (z_v - m_r),   zy_r = z_y if y in r else 0     (`torch_head.RowSums`)

Two all-reduces combine them into the sums of the full vocabulary (MAX of m, then one SUM of a [4, N] tensor),
relative to M = max_r m_r, each shard's e^0 = 1 kept out of the tail, so a confident token's entropy keeps its
relative precision: with c_r = e^{m_r - M},

    top = #{r: m_r = M},   tail = sum_{m_r = M} tail_r + sum_{m_r < M} (1 + tail_r) c_r,
    t = sum_r (t_r + (1 + tail_r)(m_r - M)) c_r,   z_y = sum_r zy_r

then `torch_head.stats_from_sums`: log s = log(top) + log1p(tail / top), lse = M + log s, H = log s - t / s,
elp = (M - lse) + t / s (a shard whose logits are all -inf has c_r = 0 and adds nothing).
Backward: each rank forms dz on its columns with the global (lse, elp),
`dz_j = g_lp (1[j=y] - p_j) - g_H p_j (log p_j - elp)`, so dW and db are complete for its rows and dh is the
partial sum over its rows; `reduce_grad_hidden=True` all-reduces dh (SUM) so every rank gets the full gradient,
`False` leaves the partial dh for the caller's own reduction (e.g. a sequence-parallel reduce-scatter).
The upstream gradients must be the same on every rank (the loss is replicated), as in Megatron-style TP.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor

from ludic_fast._common import HeadOutput, validate_head_inputs
from ludic_fast.ops.torch_head import (
    HeadTransform,
    LinearLogprobsFunction,
    RowStats,
    RowSums,
    finite_or_zero,
    stats_from_sums,
    torch_blocks,
)


def vocab_partition(vocab_size: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rows `[start, stop)` of rank `rank` in an even split of `vocab_size` rows (the first ranks get the
    remainder, one extra row each)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must lie in [0, world_size), got rank={rank}, world_size={world_size}")
    if vocab_size < world_size:
        raise ValueError(f"vocab_size ({vocab_size}) must be >= world_size ({world_size})")
    base, extra = divmod(vocab_size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def _combine_sums(local: RowSums, group) -> RowStats:
    """`RowSums` of this rank's vocabulary rows -> `RowStats` of the whole vocabulary (module docstring)."""
    big_m = local.m.clone()
    dist.all_reduce(big_m, op=dist.ReduceOp.MAX, group=group)
    shift = finite_or_zero(big_m)
    c = torch.exp(local.m - shift)
    at_max = (local.m == big_m) & torch.isfinite(local.m)
    tail = torch.where(at_max, local.tail, (1.0 + local.tail) * c)
    t = torch.where(torch.isneginf(local.m), 0.0, (local.t + (1.0 + local.tail) * (local.m - shift)) * c)
    sums = torch.stack([at_max.to(tail.dtype), tail, t, local.zy])
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    return stats_from_sums(big_m, sums[1], sums[2], sums[3], with_entropy=True, top=sums[0])


class VocabParallelLogprobsFunction(torch.autograd.Function):
    """Generic mode over a vocab-sharded weight: forward keeps the global (lse, elp); backward is the torch
    backend's (`LinearLogprobsFunction.backward`, recomputing the local logits chunk by chunk) on the local
    rows, then the optional all-reduce of dh. `head_args = (transform, chunks, ignore_sentinel)`."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, local_targets, head_args, with_entropy, group, reduce_dh):  # type: ignore[override]
        merge = functools.partial(_combine_sums, group=group)
        out = LinearLogprobsFunction.forward(ctx, hidden, weight, bias, local_targets, head_args, with_entropy, merge)
        ctx.group, ctx.reduce_dh = group, reduce_dh
        return out

    @staticmethod
    def backward(ctx, g_lp, g_H, g_lse):  # type: ignore[override]
        dh, dW, db, *_ = LinearLogprobsFunction.backward(ctx, g_lp, g_H, g_lse)
        if dh is not None and ctx.reduce_dh:
            full = dh.float() if dh.dtype in (torch.float16, torch.bfloat16) else dh
            dist.all_reduce(full, op=dist.ReduceOp.SUM, group=ctx.group)
            dh = full.to(dh.dtype)
        return dh, dW, db, None, None, None, None, None


def vocab_parallel_linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    process_group: dist.ProcessGroup | None,
    vocab_start: int,
    vocab_size: int,
    bias: Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    temperature: float | Tensor = 1.0,
    entropy: bool = True,
    ignore_index: int = -100,
    reduce_grad_hidden: bool = True,
    chunk_elements: int | None = None,
    memory_budget: int | str | None = None,
) -> HeadOutput:
    """`ludic_fast.linear_logprobs` over a weight sharded by vocabulary rows across `process_group`.

    `weight [V_local, D]` (and `bias [V_local]`) hold rows `[vocab_start, vocab_start + V_local)` of a
    vocabulary of `vocab_size` rows; the ranks' row ranges must tile `[0, vocab_size)` exactly once
    (`vocab_partition` gives an even split). `hidden [..., D]`, `targets [...]` (global ids) and `temperature`
    are the same on every rank. Returns float32 `HeadOutput(logprobs, entropy, lse)`, identical on every rank
    and equal to the unsharded op on the concatenated weight:
    `z = softcap(logit_scale (h W^T + b)) / T`, `logprob = z_y - logsumexp(z)`, `H = -sum_v p_v log p_v`.

    Gradients: weight/bias get the gradient of their own rows; hidden gets the full gradient when
    `reduce_grad_hidden` (one all-reduce in backward), otherwise this rank's partial sum over its rows.
    `process_group=None` means the default group. Collective: every rank must call it with the same shapes.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("process_group: torch.distributed is not initialized (call init_process_group first)")
    if not isinstance(vocab_size, int) or not isinstance(vocab_start, int):
        raise TypeError("vocab_start and vocab_size must be ints")
    n_local = weight.shape[0] if isinstance(weight, Tensor) and weight.ndim == 2 else 0
    if vocab_start < 0 or vocab_start + n_local > vocab_size:
        raise ValueError(
            f"vocab_start={vocab_start} with {n_local} local rows must lie inside [0, vocab_size={vocab_size})"
        )
    validate_head_inputs(
        hidden, weight, targets, bias, logit_scale, softcap, temperature, ignore_index, vocab_size, vocab_start
    )
    out_shape = targets.shape
    h2 = hidden.reshape(-1, hidden.shape[-1])
    t1 = targets.reshape(-1)
    valid = t1 != ignore_index
    # local ids; ignored rows get a sentinel no valid id can map to (valid local ids lie in [-vocab_start, ...))
    sentinel = -vocab_start - 1
    local = torch.where(valid, t1.long() - vocab_start, torch.full_like(t1, sentinel, dtype=torch.long))
    transform = HeadTransform.build(logit_scale, softcap, temperature, t1.numel(), hidden.device)
    blocks = torch_blocks(h2, weight, bias, chunk_elements, memory_budget)
    lp, ent, lse = VocabParallelLogprobsFunction.apply(
        h2, weight, bias, local, (transform, blocks, sentinel), entropy, process_group, bool(reduce_grad_hidden)
    )
    return HeadOutput(lp.reshape(out_shape), ent.reshape(out_shape) if entropy else None, lse.reshape(out_shape))
