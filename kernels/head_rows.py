"""Workspace-strategy epilogue: one program per ROWS rows of a raw-logits chunk written by a GEMM.

Input `ws [n, c]` (bf16/fp16/fp32, any row stride) holds raw logits h W[col_start : col_start + c]^T of
n tokens. With z = final(ws + b) (fp32; see `_logit_math`):

  STATS (needs whole vocabulary rows, c = V):  lse = log sum_j e^{z_j},  elp = E_p z - lse,  z_y,  H
        (online, relative to the row maximum: `_logit_math`)
  GRAD  (any column slice; lse and elp given or from STATS):  d <- d(raw), where
        dz_j = g_lp (1[j=y] - p_j) - g_H p_j (log p_j - elp),  d(raw)_j = dz_j / T * SCALE * (1 - tanh^2)

`d [n, c]` is written in its own dtype (the gradient GEMMs' operand dtype: bf16/fp16, or fp32), so no
conversion pass follows. It may be `ws` itself, or a narrower view of ws's memory whose row i starts at the
first byte of ws's row i (a bf16 view of an fp32 workspace: no second buffer). In that case (NARROW) the
loop puts a barrier between each block's loads and its stores: all warps then finish loading fp32 blocks
0..k before any thread stores narrow block k, whose bytes lie inside fp32 blocks 0..k (inside block 0 itself
for k = 0), so no store lands on bytes still to be read.

Vocab columns past c are -inf for the statistics (add nothing), as are logits of -inf (a masked vocabulary).
Targets are global vocab ids (-1 = ignored row: no gradient, z_y = 0). Row offsets are int64.
"""

import triton
import triton.language as tl

from ._device import on_device_of
from ._logit_math import (
    REL_LOGIT_FLOOR,
    final_logits,
    finish_stats,
    log_p_of,
    logit_grad,
    online_stats_update,
    raw_grad,
)

ROWS, BLOCK_V, NUM_WARPS = 1, 4096, 8


@triton.jit
def _final_tile(ws_row, b_ptr, cols, col_start, col_ok, row_ok, inv_t,
                HAS_BIAS: tl.constexpr, SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SOFTCAP: tl.constexpr):
    ok = row_ok[:, None] & col_ok[None, :]
    raw = tl.load(ws_row + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        raw += tl.load(b_ptr + col_start + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    z, th = final_logits(raw, inv_t, SCALE, HAS_SOFTCAP, SOFTCAP)
    return z, th, ok


@triton.jit
def head_rows_kernel(
    ws_ptr, d_ptr, b_ptr, tgt_ptr, inv_t_ptr, lse_ptr, elp_ptr, zy_ptr, ent_ptr, glp_ptr, gh_ptr,
    n_rows, n_cols, col_start, stride_ws, stride_d,
    HAS_BIAS: tl.constexpr, SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SOFTCAP: tl.constexpr,
    ENTROPY: tl.constexpr, STATS: tl.constexpr, GRAD: tl.constexpr, HAS_GH: tl.constexpr, NARROW: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    ws_row = ws_ptr + rows.to(tl.int64)[:, None] * stride_ws
    d_row = d_ptr + rows.to(tl.int64)[:, None] * stride_d
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1) - col_start
    inv_t = tl.load(inv_t_ptr + rows, mask=row_ok, other=1.0)
    if STATS:
        m = tl.full((ROWS,), float("-inf"), dtype=tl.float32)
        tail = tl.zeros((ROWS,), dtype=tl.float32)
        t = tl.zeros((ROWS,), dtype=tl.float32)
        zy = tl.zeros((ROWS,), dtype=tl.float32)
        for v0 in range(0, n_cols, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            col_ok = cols < n_cols
            z, _th, ok = _final_tile(ws_row, b_ptr, cols, col_start, col_ok, row_ok, inv_t,
                                     HAS_BIAS, SCALE, HAS_SOFTCAP, SOFTCAP)
            m, tail, t, zy = online_stats_update(z, cols, col_ok, tgt, m, tail, t, zy, ENTROPY)
        lse, elp, ent = finish_stats(m, tail, t)
        if not ENTROPY:
            elp = tl.zeros_like(lse)
            ent = tl.zeros_like(lse)
        tl.store(lse_ptr + rows, lse, mask=row_ok)
        tl.store(elp_ptr + rows, elp, mask=row_ok)
        tl.store(zy_ptr + rows, zy, mask=row_ok)
        tl.store(ent_ptr + rows, ent, mask=row_ok)
    else:
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        elp = tl.load(elp_ptr + rows, mask=row_ok, other=0.0)
    if GRAD:
        valid = tl.load(tgt_ptr + rows, mask=row_ok, other=-1) >= 0
        g_lp = tl.where(valid, tl.load(glp_ptr + rows, mask=row_ok, other=0.0), 0.0)
        if HAS_GH:
            g_h = tl.where(valid, tl.load(gh_ptr + rows, mask=row_ok, other=0.0), 0.0)
        else:
            g_h = g_lp
        for v0 in range(0, n_cols, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            col_ok = cols < n_cols
            z, th, ok = _final_tile(ws_row, b_ptr, cols, col_start, col_ok, row_ok, inv_t,
                                    HAS_BIAS, SCALE, HAS_SOFTCAP, SOFTCAP)
            log_p = tl.where(ok, log_p_of(z, lse), REL_LOGIT_FLOOR)
            dz = logit_grad(log_p, tl.exp(log_p), cols[None, :] == tgt[:, None], g_lp, g_h, elp, HAS_GH)
            draw = raw_grad(dz, th, inv_t, SCALE, HAS_SOFTCAP)
            if NARROW:
                tl.debug_barrier()
            tl.store(d_row + cols[None, :], draw.to(d_ptr.dtype.element_ty), mask=ok)


def launch_head_rows(ws, b, tgt, inv_t, lse, elp, zy, g_lp, g_h, *, col_start, scale, softcap, entropy, stats,
                     d=None, ent=None, rows=ROWS, block_v=BLOCK_V, num_warps=NUM_WARPS):
    """See the module docstring. ws [n, c] with unit column stride; d (default ws) [n, c] with unit column
    stride; tgt int32 [n] (-1 ignored); inv_t, lse, elp, zy, ent, g_lp, g_h fp32 [n] (zy, ent: written with
    `stats`, ent may be None; g_lp None: statistics only; g_h None: no entropy gradient)."""
    n, c = ws.shape
    grad = g_lp is not None
    d = ws if d is None else d
    dummy = inv_t
    if stats and ent is None:
        ent = lse.new_empty(lse.shape)
    with on_device_of(ws):
        head_rows_kernel[(triton.cdiv(n, rows),)](
            ws, d, b if b is not None else dummy, tgt, inv_t, lse, elp, zy if zy is not None else dummy,
            ent if ent is not None else dummy, g_lp if grad else dummy, g_h if g_h is not None else dummy,
            n, c, col_start, ws.stride(0), d.stride(0),
            HAS_BIAS=b is not None, SCALE=scale, HAS_SOFTCAP=softcap is not None,
            SOFTCAP=1.0 if softcap is None else softcap, ENTROPY=entropy, STATS=stats, GRAD=grad,
            HAS_GH=g_h is not None, NARROW=grad and d is not ws and d.element_size() < ws.element_size(),
            ROWS=rows, BLOCK_V=block_v, num_warps=num_warps,
        )
