"""Fused forward of the head (no logits workspace): one program per (token tile x vocab split).

Each program computes logit tiles z = final(h W^T + b) with tl.dot (fp32 accumulation) over its vocab
range and keeps, per row, the fp32 online statistics

    m = max_j z_j,   tail = sum_{j != argmax} e^{z_j - m},   t = sum_j e^{z_j - m} (z_j - m),   z_y (target
    logit, 0 elsewhere)          (relative to the running maximum: see `_logit_math`)

written as partials `part[q, split, row]` (q = m, tail, t, z_y) that `head_merge` combines. Vocab columns
>= V are -inf for m and the sums. Offsets into h and W are int64. h and W arrive as pointers
(masked loads, any strides) or, in the TMA variant (constexpr TMA), as tensor descriptors (`kernels.tma`).
"""

import triton
import triton.language as tl

from ._device import on_device_of
from ._logit_math import final_logits, online_stats_update
from .tma import descriptor

#: Launch configurations per (input element size, architecture family), for N > SMALL_N tokens. bf16/fp16
#: use tensor cores (wgmma on sm_90, mma.sync on sm_80); fp32 uses exact "ieee" FMA dots with smaller tiles.
#: Every entry compiles spill-free for its architecture with every feature on and off (triton 3.6 and 3.9 AOT,
#: `tests/test_kernel_compile.py`, `bench/kernel_report.py`). On an H100, BLOCK 128x128x64 / 8 warps / 4 stages
#: ran the anchor forward (N=8192 D=4096 V=151936, bf16) in 22-25 ms against 30.0 ms for 128x128x32 / 4 stages;
#: 128x256x64 / 3 stages ran 17.3 ms but spills 220-700 bytes per thread in its epilogue on sm_90, so it is not
#: a default.
#: sm_80 bf16 runs 3 stages: 4 spilled 4 bytes with the argmax epilogue of the time (speed unmeasured).
CONFIGS = {
    (2, 90): {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4},
    (2, 80): {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 8, "num_stages": 3},
    (4, 90): {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 8, "num_stages": 3},
    (4, 80): {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 16, "num_warps": 8, "num_stages": 3},
}
#: N <= SMALL_N (one token tile, W-bandwidth bound): half-height tiles waste no rows (speed unmeasured).
SMALL_N = 64
SMALL_CONFIGS = {
    (2, 90): {"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4},
}


#: The TMA variant (bf16/fp16 on sm_90+; opt-in: never run on a GPU, speed unmeasured): the same tiles, h and
#: W tiles fetched by TMA descriptors, and the vocab-tile loop flattened with the K loop so that the next tile's
#: loads are in flight during a tile's epilogue. Used only where `tma.tma_ready` holds for h and W. Not for
#: fp32: its FMA dot reading TMA's shared-memory layout spills 1.1 KB per thread (triton 3.6, sm_90).
TMA_CONFIGS = {key: {**c, "TMA": True, "FLATTEN": True} for key, c in CONFIGS.items() if key == (2, 90)}
SMALL_TMA_CONFIGS = {key: {**c, "TMA": True, "FLATTEN": True} for key, c in SMALL_CONFIGS.items() if key == (2, 90)}
#: the constexprs of the pointer-load kernel, which the tables above leave out
POINTER_LOADS = {"TMA": False, "FLATTEN": False}


def launch_config(elem_size: int, arch: int, n: int, tma: bool = False) -> dict:
    """The launch configuration for `n` tokens of `elem_size`-byte inputs on architecture family `arch`
    (90: sm_90 and newer, 80: sm_80/sm_89); `tma` asks for the TMA variant, which exists on sm_90 only."""
    key = (elem_size, arch)
    small, large = (SMALL_TMA_CONFIGS, TMA_CONFIGS) if tma and key in TMA_CONFIGS else (SMALL_CONFIGS, CONFIGS)
    if n <= SMALL_N and key in small:
        return small[key]
    return large[key]


@triton.jit
def _mma(h, w, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """acc + h @ w in fp32."""
    if UPCAST:  # interpreter only: its bf16 tl.dot is wrong; bf16 -> fp32 is exact
        h = h.to(tl.float32)
        w = w.to(tl.float32)
    return tl.dot(h, w, acc, input_precision=PRECISION)


@triton.jit
def dot_tile(h_src, w_src, row0, col0, N, C, D, stride_hn, stride_hk, stride_wv, stride_wk, TMA: tl.constexpr,
             UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] tile of h[row0 :] @ W[col0 :]^T over D in BLOCK_K steps; rows >= N, columns >= C
    and k >= D read as 0. TMA: h_src, w_src are tensor descriptors of h [N, D] and W [C, D] with blocks
    [BLOCK_M, BLOCK_K], [BLOCK_N, BLOCK_K] (TMA zero-fills outside); else pointers with the given strides."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA:
        for k0 in range(0, D, BLOCK_K):
            acc = _mma(h_src.load([row0, k0]), tl.trans(w_src.load([col0, k0])), acc, UPCAST, PRECISION)
    else:
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = col0 + tl.arange(0, BLOCK_N)
        h_row = h_src + rows.to(tl.int64)[:, None] * stride_hn
        w_col = w_src + cols.to(tl.int64)[None, :] * stride_wv
        for k0 in range(0, D, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < D
            h = tl.load(h_row + ks.to(tl.int64)[None, :] * stride_hk, mask=(rows < N)[:, None] & k_ok[None, :],
                        other=0.0)
            w = tl.load(w_col + ks.to(tl.int64)[:, None] * stride_wk, mask=k_ok[:, None] & (cols < C)[None, :],
                        other=0.0)
            acc = _mma(h, w, acc, UPCAST, PRECISION)
    return acc


@triton.jit
def head_fwd_kernel(
    h_src, w_src, b_ptr, tgt_ptr, inv_t_ptr, part_ptr,
    N, V, D, stride_hn, stride_hk, stride_wv, stride_wk, blocks_per_split,
    HAS_BIAS: tl.constexpr, SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SOFTCAP: tl.constexpr,
    ENTROPY: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
    FLATTEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    n_splits = tl.num_programs(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    inv_t = tl.load(inv_t_ptr + rows, mask=row_ok, other=1.0)
    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    tail = tl.zeros((BLOCK_M,), dtype=tl.float32)
    t = tl.zeros((BLOCK_M,), dtype=tl.float32)
    zy = tl.zeros((BLOCK_M,), dtype=tl.float32)
    v_lo = pid_s * blocks_per_split * BLOCK_N
    for vb in tl.range(0, blocks_per_split, flatten=FLATTEN):
        col0 = v_lo + vb * BLOCK_N
        cols = col0 + tl.arange(0, BLOCK_N)
        col_ok = cols < V
        raw = dot_tile(h_src, w_src, pid_m * BLOCK_M, col0, N, V, D, stride_hn, stride_hk, stride_wv, stride_wk,
                       TMA, UPCAST, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
        if HAS_BIAS:
            raw += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        z, _th = final_logits(raw, inv_t, SCALE, HAS_SOFTCAP, SOFTCAP)
        m, tail, t, zy = online_stats_update(z, cols, col_ok, tgt, m, tail, t, zy, ENTROPY)
    out = part_ptr + pid_s.to(tl.int64) * N + rows
    plane = n_splits.to(tl.int64) * N
    tl.store(out, m, mask=row_ok)
    tl.store(out + plane, tail, mask=row_ok)
    tl.store(out + 2 * plane, t, mask=row_ok)
    tl.store(out + 3 * plane, zy, mask=row_ok)


def dot_operands(h, w, config: dict) -> tuple:
    """(h, w) as the tl.dot kernels take them under `config`: tensor descriptors with its tiles when it asks
    for TMA (ValueError unless `tma.tma_ready(h, w)`), else the tensors themselves (pointer loads)."""
    if not config.get("TMA"):
        return h, w
    return descriptor(h, (config["BLOCK_M"], config["BLOCK_K"])), descriptor(w, (config["BLOCK_N"], config["BLOCK_K"]))


def launch_head_fwd(h, w, b, tgt, inv_t, part, blocks_per_split, *, scale, softcap, entropy, upcast, precision,
                    config):
    """part: fp32 [4, splits, N] (written); each split covers `blocks_per_split` BLOCK_N-wide vocab blocks.
    tgt int32 with -1 for ignored rows; inv_t fp32 [N]; config from `launch_config`."""
    N, D = h.shape
    V = w.shape[0]
    splits = part.shape[1]
    grid = (triton.cdiv(N, config["BLOCK_M"]), splits)
    with on_device_of(h):
        head_fwd_kernel[grid](
            *dot_operands(h, w, config), b if b is not None else inv_t, tgt, inv_t, part,
            N, V, D, h.stride(0), h.stride(1), w.stride(0), w.stride(1), blocks_per_split,
            HAS_BIAS=b is not None, SCALE=scale, HAS_SOFTCAP=softcap is not None,
            SOFTCAP=1.0 if softcap is None else softcap, ENTROPY=entropy, UPCAST=upcast, PRECISION=precision,
            **{**POINTER_LOADS, **config},
        )
