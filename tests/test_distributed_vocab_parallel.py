"""Vocab-parallel head on a 2-process gloo group equals the single-process reference (values and gradients)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _head_numerics import check_vocab_parallel

from ludic_fast import losses, reference
from ludic_fast.distributed import vocab_parallel_linear_logprobs, vocab_parallel_loss, vocab_partition
from ludic_fast.distributed.local import run_local_group
from ludic_fast.ops import linear_logprobs

V, D = 37, 8  # odd vocabulary: the two shards get 19 and 18 rows


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 5, D, generator=g, dtype=dtype)
    weight = torch.randn(V, D, generator=g, dtype=dtype)
    bias = torch.randn(V, generator=g, dtype=dtype) * 0.1
    targets = torch.randint(0, V, (3, 5), generator=g)
    targets[0, 1] = -100
    targets[2, 4] = -100
    temperature = torch.rand(3, 5, generator=g, dtype=torch.float64) + 0.5
    return hidden, weight, bias, targets, temperature


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6, msg=lambda m: f"{what}: {m}")


def _check_head(rank: int, world: int) -> None:
    hidden, weight, bias, targets, temperature = _inputs()
    start, stop = vocab_partition(V, world, rank)
    g = torch.Generator().manual_seed(1)
    g_lp, g_H = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    kw = {"logit_scale": 0.7, "softcap": 5.0, "temperature": temperature}

    h_ref, w_ref, b_ref = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    ref = reference.linear_logprobs(h_ref, w_ref, targets, bias=b_ref, **kw)
    ((ref.logprobs * g_lp).sum() + (ref.entropy * g_H).sum()).backward()

    for reduce_dh in (True, False):
        h = hidden.clone().requires_grad_()
        w = weight[start:stop].clone().requires_grad_()
        b = bias[start:stop].clone().requires_grad_()
        out = vocab_parallel_linear_logprobs(
            h, w, targets, bias=b, process_group=None, vocab_start=start, vocab_size=V,
            reduce_grad_hidden=reduce_dh, chunk_elements=40, **kw,  # 40 elements: slices inside the shard
        )
        _close(out.logprobs, ref.logprobs, "logprobs")
        _close(out.entropy, ref.entropy, "entropy")
        _close(out.lse, ref.lse, "lse")
        ((out.logprobs * g_lp).sum() + (out.entropy * g_H).sum()).backward()
        _close(w.grad, w_ref.grad[start:stop], "dW")
        _close(b.grad, b_ref.grad[start:stop], "db")
        dh = h.grad.clone()
        if not reduce_dh:
            assert not torch.allclose(dh, h_ref.grad), "partial dh should differ from the full gradient"
            dist.all_reduce(dh)
        _close(dh, h_ref.grad, f"dh (reduce_grad_hidden={reduce_dh})")

    with pytest.raises(ValueError, match="targets"):
        vocab_parallel_linear_logprobs(
            hidden, weight[start:stop], torch.full((3, 5), V), process_group=None, vocab_start=start, vocab_size=V
        )
    with pytest.raises(ValueError, match="vocab_start"):
        vocab_parallel_linear_logprobs(
            hidden, weight[start:stop], targets, process_group=None, vocab_start=V - 1, vocab_size=V
        )


def _check_bf16(rank: int, world: int) -> None:
    """bf16 inputs: the sharded head equals the single-process torch backend on the same bf16 tensors."""
    hidden, weight, _, targets, _ = _inputs(torch.bfloat16)
    start, stop = vocab_partition(V, world, rank)
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = linear_logprobs(h_ref, w_ref, targets, backend="torch")
    (ref.logprobs.sum() + ref.entropy.sum()).backward()
    h, w = hidden.clone().requires_grad_(), weight[start:stop].clone().requires_grad_()
    # the public op routes a sharded call; vocab_size is summed over the group
    out = linear_logprobs(h, w, targets, process_group=dist.group.WORLD, vocab_start=start)
    (out.logprobs.sum() + out.entropy.sum()).backward()
    _close(out.logprobs, ref.logprobs, "bf16 logprobs")
    _close(out.entropy, ref.entropy, "bf16 entropy")
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-2, atol=1e-2)  # dh partials rounded to bf16 once
    torch.testing.assert_close(w.grad, w_ref.grad[start:stop], rtol=1e-2, atol=1e-2)


def _rl_batch():
    g = torch.Generator().manual_seed(2)
    B, T = 3, 6
    action_mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1]], dtype=torch.float32)
    actor_logps = (torch.randn(B, T, generator=g) * 0.3 - 3.0) * action_mask
    batch = {
        "input_ids": torch.randint(0, V, (B, T), generator=g),
        "attention_mask": torch.ones(B, T, dtype=torch.long),
        "action_mask": action_mask,
        "weight": torch.tensor([1.5, -0.7, 0.0]),
        "actor_logps": actor_logps,
        "old_logp_action": actor_logps.sum(-1),
        "zvp_direction": torch.tensor([0, 0, -1]),
    }
    return batch, torch.randn(B, T, D, generator=g), torch.randn(V, D, generator=g)


def _check_losses(rank: int, world: int) -> None:
    """CISPO (token-local), GSPO (sequence-coupled) and RL-ZVP (reads entropy) through the sharded head equal
    the single-process losses; CISPO also equals the reference on materialised logits."""
    batch, hidden, weight = _rl_batch()
    start, stop = vocab_partition(V, world, rank)
    for loss_fn in (losses.CISPOLoss(), losses.ClippedSurrogateLoss(), losses.ZVPCISPOLoss()):
        name = type(loss_fn).__name__
        h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if type(loss_fn) is losses.CISPOLoss:
            ref_loss, ref_stats = reference.CISPOLoss()(batch, logits=reference.head_logits(h_ref, w_ref))
        else:
            ref_loss, ref_stats = loss_fn(batch, hidden=h_ref, weight=w_ref, fused=False)
        ref_loss.backward()
        h, w = hidden.clone().requires_grad_(), weight[start:stop].clone().requires_grad_()
        loss, stats = vocab_parallel_loss(
            loss_fn, batch, hidden=h, weight=w, process_group=None, vocab_start=start, vocab_size=V
        )
        loss.backward()
        _close(loss, ref_loss, f"{name} loss")
        _close(stats["ratio_mean"], ref_stats["ratio_mean"], f"{name} ratio_mean")
        _close(h.grad, h_ref.grad, f"{name} dh")
        _close(w.grad, w_ref.grad[start:stop], f"{name} dW")


def _worker(rank: int, world: int) -> None:
    torch.set_num_threads(1)
    _check_head(rank, world)
    _check_bf16(rank, world)
    _check_losses(rank, world)
    check_vocab_parallel(rank, world)  # confident tokens and a masked vocabulary (tests/_head_numerics.py)


def test_vocab_parallel_two_ranks_equal_single_process():
    run_local_group(_worker, 2)


def test_vocab_partition_tiles_the_vocabulary():
    parts = [vocab_partition(10, 3, r) for r in range(3)]
    assert parts == [(0, 4), (4, 7), (7, 10)]
    with pytest.raises(ValueError, match="rank"):
        vocab_partition(10, 3, 3)
    with pytest.raises(ValueError, match="vocab_size"):
        vocab_partition(2, 3, 0)


def test_vocab_parallel_needs_an_initialized_group():
    assert not dist.is_initialized()
    hidden, weight, _, targets, _ = _inputs()
    with pytest.raises(ValueError, match="process_group"):
        vocab_parallel_linear_logprobs(hidden, weight, targets, process_group=None, vocab_start=0, vocab_size=V)
