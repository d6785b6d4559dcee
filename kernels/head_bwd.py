"""Fused backward of the head (no logits workspace): one program per (token tile x vocab tile).

The program recomputes its logit tile with tl.dot, forms (p = e^{z - lse})

    dz_j  = g_lp (1[j=y] - p_j) - g_H p_j (z_j - E_p z)
    draw_j = dz_j / T * SCALE * (1 - tanh^2)            (tanh factor only with a softcap)

and adds its contributions dh[rows] += draw W[cols] and dW[cols] += draw^T h[rows] (db[cols] += sum_rows
draw) to fp32 buffers with atomics. Atomics, not a split reduction: every (row, vocab) tile is then
recomputed exactly once (6NDV for the backward: 2 recompute + 4 gradient GEMM FLOPs) and no [splits, N, D]
partial buffer is needed; the price is nondeterministic summation order in dh/dW (fp32, so ~1e-7 rel).
draw is rounded to the input dtype before the gradient tl.dot (tensor-core operands), as verl/CCE do.
Vocab columns >= V and rows >= N get draw = 0. Offsets are int64.
"""

import triton
import triton.language as tl

from ._logit_math import final_logits, logit_grad, raw_grad
from .head_fwd import dot_tile

#: Default launch configuration per input element size (see head_fwd.CONFIGS); spill-free on sm_80/sm_90.
CONFIGS = {
    2: {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 8, "num_stages": 2},
    4: {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 16, "num_warps": 4, "num_stages": 2},
}


@triton.jit
def head_bwd_kernel(
    h_ptr, w_ptr, b_ptr, tgt_ptr, inv_t_ptr, lse_ptr, ez_ptr, glp_ptr, gh_ptr, dh_ptr, dw_ptr, db_ptr,
    N, V, D, stride_hn, stride_hk, stride_wv, stride_wk,
    HAS_BIAS: tl.constexpr, SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_GH: tl.constexpr, NEED_DH: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    col_ok = cols < V
    ok = row_ok[:, None] & col_ok[None, :]
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    inv_t = tl.load(inv_t_ptr + rows, mask=row_ok, other=1.0)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    g_lp = tl.where(tgt >= 0, tl.load(glp_ptr + rows, mask=row_ok, other=0.0), 0.0)
    if HAS_GH:
        g_h = tl.where(tgt >= 0, tl.load(gh_ptr + rows, mask=row_ok, other=0.0), 0.0)
        ez = tl.load(ez_ptr + rows, mask=row_ok, other=0.0)
    else:
        g_h = g_lp
        ez = lse

    raw = dot_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, D, stride_hn, stride_hk, stride_wv, stride_wk,
                   UPCAST, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        raw += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    z, th = final_logits(raw, inv_t, SCALE, HAS_SOFTCAP, SOFTCAP)
    z = tl.where(ok, z, 0.0)
    p = tl.where(ok, tl.exp(z - lse[:, None]), 0.0)
    dz = logit_grad(z, p, cols[None, :] == tgt[:, None], g_lp, g_h, ez, HAS_GH)
    draw = tl.where(ok, raw_grad(dz, th, inv_t, SCALE, HAS_SOFTCAP), 0.0)
    if NEED_DB:
        tl.atomic_add(db_ptr + cols, tl.sum(draw, axis=0), mask=col_ok)

    d_lo = draw.to(h_ptr.dtype.element_ty)
    if UPCAST:
        d_lo = d_lo.to(tl.float32)
    h_row = rows.to(tl.int64)[:, None]
    w_col = cols.to(tl.int64)[:, None]
    for k0 in range(0, D, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < D
        ks64 = ks.to(tl.int64)[None, :]
        if NEED_DH:
            w = tl.load(w_ptr + w_col * stride_wv + ks64 * stride_wk, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if UPCAST:
                w = w.to(tl.float32)
            dh_part = tl.dot(d_lo, w, input_precision=PRECISION)
            tl.atomic_add(dh_ptr + h_row * D + ks64, dh_part, mask=row_ok[:, None] & k_ok[None, :])
        if NEED_DW:
            h = tl.load(h_ptr + h_row * stride_hn + ks64 * stride_hk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if UPCAST:
                h = h.to(tl.float32)
            dw_part = tl.dot(tl.trans(d_lo), h, input_precision=PRECISION)
            tl.atomic_add(dw_ptr + w_col * D + ks64, dw_part, mask=col_ok[:, None] & k_ok[None, :])


def launch_head_bwd(h, w, b, tgt, inv_t, lse, ez, g_lp, g_h, dh, dw, db, *, scale, softcap, upcast, precision,
                    config=None):
    """Accumulate into the fp32 contiguous buffers dh [N, D], dw [V, D], db [V] (each may be None).

    g_lp fp32 [N] contiguous; g_h fp32 [N] or None (no entropy gradient); tgt int32, -1 = ignored;
    config defaults to CONFIGS[h.element_size()]."""
    config = config or CONFIGS[h.element_size()]
    N, D = h.shape
    V = w.shape[0]
    any_buf = next(x for x in (dh, dw, db, lse) if x is not None)
    grid = (triton.cdiv(N, config["BLOCK_M"]), triton.cdiv(V, config["BLOCK_N"]))
    head_bwd_kernel[grid](
        h, w, b if b is not None else lse, tgt, inv_t, lse, ez, g_lp, g_h if g_h is not None else g_lp,
        dh if dh is not None else any_buf, dw if dw is not None else any_buf, db if db is not None else any_buf,
        N, V, D, h.stride(0), h.stride(1), w.stride(0), w.stride(1),
        HAS_BIAS=b is not None, SCALE=scale, HAS_SOFTCAP=softcap is not None,
        SOFTCAP=1.0 if softcap is None else softcap, HAS_GH=g_h is not None,
        NEED_DH=dh is not None, NEED_DW=dw is not None, NEED_DB=db is not None,
        UPCAST=upcast, PRECISION=precision, **config,
    )
