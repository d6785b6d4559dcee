"""Cost model of the head op: matmul FLOPs (2NDV forward, 8NDV forward+backward) and no [N, V] tensor."""

from __future__ import annotations

import torch
from _alloc import HostSyncs, LargestAllocation
from torch.utils.flop_counter import FlopCounterMode

import ludic_fast


def _inputs(N, D, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g, requires_grad=True)
    W = torch.randn(V, D, generator=g, requires_grad=True)
    b = torch.randn(V, generator=g, requires_grad=True)
    y = torch.randint(0, V, (N,), generator=g)
    return h, W, b, y


def _fwd_bwd(h, W, b, y, **kw):
    out = ludic_fast.linear_logprobs(h, W, y, bias=b, temperature=0.7, softcap=5.0, **kw)
    (out.logprobs.sum() + 0.3 * out.entropy.sum()).backward()


def test_no_tensor_with_n_times_v_elements():
    N, D, V = 256, 32, 3001
    h, W, b, y = _inputs(N, D, V)
    with LargestAllocation() as rec:
        _fwd_bwd(h, W, b, y, chunk_elements=64 * V)
    assert rec.largest < N * V, f"{rec.op} allocated {rec.largest} >= N*V = {N * V}"
    # chunk plan: 64 tokens x whole vocabulary is the biggest transient
    assert rec.largest <= 64 * V


def test_vocab_slicing_bounds_transients_below_one_row_block():
    """A budget smaller than 16 whole rows slices the vocabulary: transients stay within the budget."""
    N, D, V = 64, 16, 5003
    h, W, b, y = _inputs(N, D, V)
    budget = 16 * 700
    with LargestAllocation() as rec:
        _fwd_bwd(h, W, b, y, chunk_elements=budget)
    # the weight/gradient buffers [V, D] are the largest tensors; logits chunks are <= budget
    assert rec.largest <= max(budget, V * D)


def test_matmul_flops_forward_2ndv_and_fwd_bwd_8ndv():
    N, D, V = 192, 48, 2053
    ndv = N * D * V
    h, W, b, y = _inputs(N, D, V)
    with FlopCounterMode(display=False) as fwd:
        out = ludic_fast.linear_logprobs(h, W, y, bias=b, chunk_elements=50 * V)
    assert abs(fwd.get_total_flops() / ndv - 2.0) <= 0.02
    with FlopCounterMode(display=False) as total:
        out = ludic_fast.linear_logprobs(h, W, y, bias=b, chunk_elements=50 * V)
        (out.logprobs.sum() + out.entropy.sum()).backward()
    assert abs(total.get_total_flops() / ndv - 8.0) <= 0.08


def test_one_host_sync_per_head_call():
    """Only the target range check waits for the device (one bool()), forward and backward, with several chunks
    and ignored rows; a scalar temperature adds none."""
    h, W, b, y = _inputs(96, 16, 1009)
    y[:7] = -100
    with HostSyncs() as rec:
        _fwd_bwd(h, W, b, y, chunk_elements=32 * 1009)
    assert rec.ops == ["_local_scalar_dense"]
