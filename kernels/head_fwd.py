"""Fused forward of the head (no logits workspace): one program per (token tile x vocab split).

Each program computes logit tiles z = final(h W^T + b) with tl.dot (fp32 accumulation) over its vocab
range and keeps, per row, the fp32 online statistics

    m = max_j z_j,   s = sum_j e^{z_j - m},   t = sum_j e^{z_j - m} z_j,   z_y (target logit, 0 elsewhere)

written as partials `part[q, split, row]` (q = m, s, t, z_y) that `head_merge` combines. Vocab columns
>= V are -inf for m and s and contribute 0 to t. Offsets into h and W are int64.
"""

import triton
import triton.language as tl

from ._logit_math import final_logits, online_stats_update

#: Launch configurations per (input element size, architecture family), for N > SMALL_N tokens. bf16/fp16
#: use tensor cores (wgmma on sm_90, mma.sync on sm_80); fp32 uses exact "ieee" FMA dots with smaller tiles.
#: Every entry compiles spill-free for its architecture with every feature on and off (triton 3.9 AOT,
#: `bench/kernel_report.py`). On an H100, BLOCK 128x128x64 / 8 warps / 4 stages ran the anchor forward
#: (N=8192 D=4096 V=151936, bf16) in 22-25 ms against 30.0 ms for 128x128x32 / 4 stages; 128x256x64 /
#: 3 stages ran 17.3 ms but spills 220-700 bytes per thread in its epilogue on sm_90, so it is not a default.
CONFIGS = {
    (2, 90): {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4},
    (2, 80): {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 8, "num_stages": 4},
    (4, 90): {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 8, "num_stages": 3},
    (4, 80): {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 16, "num_warps": 8, "num_stages": 3},
}
#: N <= SMALL_N (one token tile, W-bandwidth bound): half-height tiles waste no rows (speed unmeasured).
SMALL_N = 64
SMALL_CONFIGS = {
    (2, 90): {"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4},
}


def launch_config(elem_size: int, arch: int, n: int) -> dict:
    """The launch configuration for `n` tokens of `elem_size`-byte inputs on architecture family `arch`
    (90: sm_90 and newer, 80: sm_80/sm_89)."""
    key = (elem_size, arch)
    if n <= SMALL_N and key in SMALL_CONFIGS:
        return SMALL_CONFIGS[key]
    return CONFIGS[key]


@triton.jit
def dot_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, D, stride_hn, stride_hk, stride_wv, stride_wk,
             UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] tile of h[rows] @ W[cols]^T, looping over D in BLOCK_K steps."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    h_row = h_ptr + rows.to(tl.int64)[:, None] * stride_hn
    w_col = w_ptr + cols.to(tl.int64)[None, :] * stride_wv
    for k0 in range(0, D, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < D
        h = tl.load(h_row + ks.to(tl.int64)[None, :] * stride_hk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_col + ks.to(tl.int64)[:, None] * stride_wk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:  # interpreter only: its bf16 tl.dot is wrong; bf16 -> fp32 is exact
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(h, w, acc, input_precision=PRECISION)
    return acc


@triton.jit
def head_fwd_kernel(
    h_ptr, w_ptr, b_ptr, tgt_ptr, inv_t_ptr, part_ptr,
    N, V, D, stride_hn, stride_hk, stride_wv, stride_wk, blocks_per_split,
    HAS_BIAS: tl.constexpr, SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SOFTCAP: tl.constexpr,
    ENTROPY: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    n_splits = tl.num_programs(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    inv_t = tl.load(inv_t_ptr + rows, mask=row_ok, other=1.0)
    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_M,), dtype=tl.float32)
    t = tl.zeros((BLOCK_M,), dtype=tl.float32)
    zy = tl.zeros((BLOCK_M,), dtype=tl.float32)
    v_lo = pid_s * blocks_per_split * BLOCK_N
    for vb in range(0, blocks_per_split):
        cols = v_lo + vb * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < V
        raw = dot_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, D, stride_hn, stride_hk, stride_wv, stride_wk,
                       UPCAST, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
        if HAS_BIAS:
            raw += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        z, _th = final_logits(raw, inv_t, SCALE, HAS_SOFTCAP, SOFTCAP)
        m, s, t, zy = online_stats_update(z, cols, col_ok, tgt, m, s, t, zy, ENTROPY)
    out = part_ptr + pid_s.to(tl.int64) * N + rows
    plane = n_splits.to(tl.int64) * N
    tl.store(out, m, mask=row_ok)
    tl.store(out + plane, s, mask=row_ok)
    tl.store(out + 2 * plane, t, mask=row_ok)
    tl.store(out + 3 * plane, zy, mask=row_ok)


def launch_head_fwd(h, w, b, tgt, inv_t, part, blocks_per_split, *, scale, softcap, entropy, upcast, precision,
                    config):
    """part: fp32 [4, splits, N] (written); each split covers `blocks_per_split` BLOCK_N-wide vocab blocks.
    tgt int32 with -1 for ignored rows; inv_t fp32 [N]; config from `launch_config`."""
    N, D = h.shape
    V = w.shape[0]
    splits = part.shape[1]
    grid = (triton.cdiv(N, config["BLOCK_M"]), splits)
    head_fwd_kernel[grid](
        h, w, b if b is not None else inv_t, tgt, inv_t, part,
        N, V, D, h.stride(0), h.stride(1), w.stride(0), w.stride(1), blocks_per_split,
        HAS_BIAS=b is not None, SCALE=scale, HAS_SOFTCAP=softcap is not None,
        SOFTCAP=1.0 if softcap is None else softcap, ENTROPY=entropy, UPCAST=upcast, PRECISION=precision,
        **config,
    )
