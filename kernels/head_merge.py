"""Merge of the fused forward's per-split partials (m_i, tail_i, t_i, z_y,i) into per-token results (fp32):
the parts' statistics folded relative to M = max_i m_i (`_logit_math.merge_partial`), z_y = sum_i z_y,i, then
lse, elp and H (`_logit_math.finish_stats`), logprob = z_y - lse (logprob, H: 0 at ignored rows, tgt < 0).
"""

import triton
import triton.language as tl

from ._device import on_device_of
from ._logit_math import finish_stats, merge_partial

BLOCK, NUM_WARPS = 256, 4


@triton.jit
def head_merge_kernel(part_ptr, tgt_ptr, lse_ptr, elp_ptr, lp_ptr, ent_ptr, N, n_splits,
                      ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < N
    plane = tl.cast(n_splits, tl.int64) * N
    big_m = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    tail = tl.zeros((BLOCK,), dtype=tl.float32)
    t = tl.zeros((BLOCK,), dtype=tl.float32)
    zy = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(0, n_splits):
        p = part_ptr + i * N + rows
        big_m, tail, t = merge_partial(big_m, tail, t, tl.load(p, mask=ok, other=0.0),
                                       tl.load(p + plane, mask=ok, other=0.0),
                                       tl.load(p + 2 * plane, mask=ok, other=0.0), ENTROPY)
        zy += tl.load(p + 3 * plane, mask=ok, other=0.0)
    lse, elp, ent = finish_stats(big_m, tail, t)
    valid = tl.load(tgt_ptr + rows, mask=ok, other=-1) >= 0
    tl.store(lse_ptr + rows, lse, mask=ok)
    tl.store(lp_ptr + rows, tl.where(valid, zy - lse, 0.0), mask=ok)
    if ENTROPY:
        tl.store(elp_ptr + rows, elp, mask=ok)
        tl.store(ent_ptr + rows, tl.where(valid, ent, 0.0), mask=ok)
    else:
        tl.store(elp_ptr + rows, tl.zeros((BLOCK,), dtype=tl.float32), mask=ok)
        tl.store(ent_ptr + rows, tl.zeros((BLOCK,), dtype=tl.float32), mask=ok)


def launch_head_merge(part, tgt, lse, elp, lp, ent, *, entropy, block=BLOCK, num_warps=NUM_WARPS):
    """part fp32 [4, splits, N] -> lse, elp (E_p z - lse; 0 without entropy), logprob, entropy (fp32 [N] each,
    written)."""
    N = part.shape[2]
    with on_device_of(part):
        head_merge_kernel[(triton.cdiv(N, block),)](
            part, tgt, lse, elp, lp, ent, N, part.shape[1], ENTROPY=entropy, BLOCK=block, num_warps=num_warps
        )
