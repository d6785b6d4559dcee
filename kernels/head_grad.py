"""Backward logits-to-gradient kernel of the fused strategy: one program per (token tile x vocab tile) of a
backward block. It recomputes the raw logit tile with tl.dot (fp32 accumulation) and, in registers, forms

    log p = z - lse,   dz_j = g_lp (1[j=y] - p_j) - g_H p_j (log p_j - elp),
    d(raw)_j = dz_j / T * SCALE * (1 - tanh^2)

then stores d(raw) in the GEMM operand dtype of `d` (bf16/fp16, or fp32 for fp32 inputs). cuBLAS forms
dh = d W and dW = d^T h from it. Each program owns its output tile (no atomics); no fp32 logits are
written or read, so the block moves 2 bytes per logit element (the d(raw) store) where the workspace
backward moves 10 (fp32 logits written and read, d(raw) written). Columns are relative to the block: `w_src`
is W[col_start:] (a pointer, or a TMA descriptor of that view), targets are global ids. Ignored rows (tgt < 0)
and tiles past the block get d(raw) = 0 (stored only inside the block). Offsets are int64.
"""

import triton
import triton.language as tl

from ._device import on_device_of
from ._logit_math import final_logits, log_p_of, logit_grad, raw_grad
from .head_fwd import dot_operands, dot_tile

#: Launch configurations per (input element size, architecture family), spill-free with every feature on and
#: off (triton 3.6 and 3.9 AOT, `tests/test_kernel_compile.py`); speed unmeasured. fp32 on sm_80 runs 2 stages:
#: 3 spilled 24 B without bias and softcap under triton 3.6. The elementwise epilogue (no reductions)
#: is lighter than the forward's, but 128x256x64 still spills on sm_90 (112-264 B). BLOCK_K equals the
#: forward's (`head_fwd.CONFIGS`) so that the recomputed logits are the forward's bit for bit: a last-bit
#: difference next to a large logit offset is a large error in p_j (z_j - E_p z) of a confident token.
CONFIGS = {
    (2, 90): {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4},
    (2, 80): {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 4},
    (4, 90): {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 8, "num_stages": 3},
    (4, 80): {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 16, "num_warps": 8, "num_stages": 2},
}


#: The TMA + persistent variant (bf16/fp16 on sm_90+; opt-in: never run on a GPU, speed unmeasured): the same
#: tiles, h and W tiles fetched by TMA descriptors, and a persistent grid (one program per SM looping over the
#: output tiles, the tile loop flattened with the K loop so the next tile's loads overlap this tile's epilogue).
#: Used only where `tma.tma_ready` holds for h and W.
TMA_CONFIGS = {key: {**c, "TMA": True, "PERSISTENT": True} for key, c in CONFIGS.items() if key == (2, 90)}
#: the constexprs of the pointer-load kernel (one tile per program), which `CONFIGS` leaves out
POINTER_LOADS = {"TMA": False, "PERSISTENT": False}


def grad_config(elem_size: int, arch: int, tma: bool = False) -> dict:
    """The launch configuration for `elem_size`-byte inputs on architecture family `arch` (90: sm_90 and newer,
    80: sm_80/sm_89); `tma` asks for the TMA + persistent variant, which exists for bf16/fp16 on sm_90 only."""
    key = (elem_size, arch)
    return TMA_CONFIGS[key] if tma and key in TMA_CONFIGS else CONFIGS[key]


@triton.jit
def grad_tile(
    pid_m, pid_n, h_src, w_src, b_ptr, tgt_ptr, inv_t_ptr, lse_ptr, elp_ptr, glp_ptr, gh_ptr, d_ptr,
    N, C, D, col_start, stride_hn, stride_hk, stride_wv, stride_wk, stride_d,
    HAS_BIAS: tl.constexpr, SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_GH: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """d(raw) of output tile (pid_m, pid_n) of the block, stored inside the block."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    col_ok = cols < C
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    inv_t = tl.load(inv_t_ptr + rows, mask=row_ok, other=1.0)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    g_lp = tl.where(tgt >= 0, tl.load(glp_ptr + rows, mask=row_ok, other=0.0), 0.0)
    if HAS_GH:
        g_h = tl.where(tgt >= 0, tl.load(gh_ptr + rows, mask=row_ok, other=0.0), 0.0)
        elp = tl.load(elp_ptr + rows, mask=row_ok, other=0.0)
    else:
        g_h = g_lp
        elp = lse
    raw = dot_tile(h_src, w_src, pid_m * BLOCK_M, pid_n * BLOCK_N, N, C, D, stride_hn, stride_hk, stride_wv,
                   stride_wk, TMA, UPCAST, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        raw += tl.load(b_ptr + col_start + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    # outside the block (masked loads: raw = 0) z and p stay finite and are never stored, so no masking here
    z, th = final_logits(raw, inv_t, SCALE, HAS_SOFTCAP, SOFTCAP)
    log_p = log_p_of(z, lse)
    dz = logit_grad(log_p, tl.exp(log_p), (col_start + cols)[None, :] == tgt[:, None], g_lp, g_h, elp, HAS_GH)
    draw = raw_grad(dz, th, inv_t, SCALE, HAS_SOFTCAP)
    d_tile = d_ptr + rows.to(tl.int64)[:, None] * stride_d + cols[None, :]
    tl.store(d_tile, draw.to(d_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def head_grad_kernel(
    h_src, w_src, b_ptr, tgt_ptr, inv_t_ptr, lse_ptr, elp_ptr, glp_ptr, gh_ptr, d_ptr,
    N, C, D, col_start, stride_hn, stride_hk, stride_wv, stride_wk, stride_d,
    HAS_BIAS: tl.constexpr, SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_GH: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
    PERSISTENT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One output tile per program on a (token tiles, vocab tiles) grid; PERSISTENT: a 1-D grid whose programs
    take the tiles pid, pid + programs, ... (token tile fastest, as in the 2-D grid's launch order)."""
    if PERSISTENT:
        tiles_m = tl.cdiv(N, BLOCK_M)
        for tile in tl.range(tl.program_id(0), tiles_m * tl.cdiv(C, BLOCK_N), tl.num_programs(0), flatten=True):
            grad_tile(tile % tiles_m, tile // tiles_m, h_src, w_src, b_ptr, tgt_ptr, inv_t_ptr, lse_ptr, elp_ptr,
                      glp_ptr, gh_ptr, d_ptr, N, C, D, col_start, stride_hn, stride_hk, stride_wv, stride_wk,
                      stride_d, HAS_BIAS, SCALE, HAS_SOFTCAP, SOFTCAP, HAS_GH, UPCAST, PRECISION, TMA, BLOCK_M,
                      BLOCK_N, BLOCK_K)
    else:
        grad_tile(tl.program_id(0), tl.program_id(1), h_src, w_src, b_ptr, tgt_ptr, inv_t_ptr, lse_ptr, elp_ptr,
                  glp_ptr, gh_ptr, d_ptr, N, C, D, col_start, stride_hn, stride_hk, stride_wv, stride_wk, stride_d,
                  HAS_BIAS, SCALE, HAS_SOFTCAP, SOFTCAP, HAS_GH, UPCAST, PRECISION, TMA, BLOCK_M, BLOCK_N, BLOCK_K)


def launch_head_grad(h, w, b, tgt, inv_t, lse, elp, g_lp, g_h, d, *, col_start, scale, softcap, upcast, precision,
                     config, programs=None):
    """d [n, c] (unit column stride, written) <- d(raw) of h [n, D] against the block's weight rows
    w = W[col_start : col_start + c] (any strides; TMA configs: `tma.tma_ready(h, w)`); b the full [V] bias or
    None; tgt int32 [n] global ids (-1 ignored); inv_t, lse, elp (E_p z - lse), g_lp fp32 [n]; g_h fp32 [n] or
    None (no entropy gradient); `config` from `grad_config`; `programs` the persistent grid's size (the SM count)."""
    n, c = d.shape
    D = h.shape[1]
    tiles = (triton.cdiv(n, config["BLOCK_M"]), triton.cdiv(c, config["BLOCK_N"]))
    if config.get("PERSISTENT"):
        if not programs:
            raise ValueError("programs: a persistent config needs the grid size (the SM count)")
        grid = (min(programs, tiles[0] * tiles[1]),)
    else:
        grid = tiles
    with on_device_of(d):
        head_grad_kernel[grid](
            *dot_operands(h, w, config), b if b is not None else lse, tgt, inv_t, lse, elp, g_lp,
            g_h if g_h is not None else g_lp, d, n, c, D, col_start, h.stride(0), h.stride(1), w.stride(0), w.stride(1),
            d.stride(0), HAS_BIAS=b is not None, SCALE=scale, HAS_SOFTCAP=softcap is not None,
            SOFTCAP=1.0 if softcap is None else softcap, HAS_GH=g_h is not None, UPCAST=upcast, PRECISION=precision,
            **{**POINTER_LOADS, **config},
        )
