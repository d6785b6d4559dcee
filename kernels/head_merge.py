"""Merge of the fused forward's per-split partials into per-token results (fp32):

    M = max_i m_i,  S = sum_i s_i e^{m_i - M},  T = sum_i t_i e^{m_i - M},  z_y = sum_i z_y,i
    lse = M + log S,  E_p z = T / S,  logprob = z_y - lse,  H = lse - E_p z   (0 at ignored rows, tgt < 0)
"""

import triton
import triton.language as tl

from ._device import on_device_of

BLOCK, NUM_WARPS = 256, 4


@triton.jit
def head_merge_kernel(part_ptr, tgt_ptr, lse_ptr, ez_ptr, lp_ptr, ent_ptr, N, n_splits,
                      ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < N
    plane = n_splits.to(tl.int64) * N
    big_m = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK,), dtype=tl.float32)
    t = tl.zeros((BLOCK,), dtype=tl.float32)
    zy = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(0, n_splits):
        p = part_ptr + i * N + rows
        m_i = tl.load(p, mask=ok, other=0.0)
        m_new = tl.maximum(big_m, m_i)
        keep = tl.exp(big_m - m_new)
        w_i = tl.exp(m_i - m_new)
        s = s * keep + tl.load(p + plane, mask=ok, other=1.0) * w_i
        if ENTROPY:
            t = t * keep + tl.load(p + 2 * plane, mask=ok, other=0.0) * w_i
        zy += tl.load(p + 3 * plane, mask=ok, other=0.0)
        big_m = m_new
    lse = big_m + tl.log(s)
    ez = t / s
    valid = tl.load(tgt_ptr + rows, mask=ok, other=-1) >= 0
    tl.store(lse_ptr + rows, lse, mask=ok)
    tl.store(ez_ptr + rows, ez, mask=ok)
    tl.store(lp_ptr + rows, tl.where(valid, zy - lse, 0.0), mask=ok)
    if ENTROPY:
        tl.store(ent_ptr + rows, tl.where(valid, lse - ez, 0.0), mask=ok)
    else:
        tl.store(ent_ptr + rows, tl.zeros((BLOCK,), dtype=tl.float32), mask=ok)


def launch_head_merge(part, tgt, lse, ez, lp, ent, *, entropy, block=BLOCK, num_warps=NUM_WARPS):
    """part fp32 [4, splits, N] -> lse, E_p z, logprob, entropy (fp32 [N] each, written)."""
    N = part.shape[2]
    with on_device_of(part):
        head_merge_kernel[(triton.cdiv(N, block),)](
            part, tgt, lse, ez, lp, ent, N, part.shape[1], ENTROPY=entropy, BLOCK=block, num_warps=num_warps
        )
