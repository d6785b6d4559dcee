"""Distillation epilogue: one program per token row of two raw-logits chunks written by GEMMs.

Inputs `s [n, c]`, `t [n, c]` (fp32, any row stride): raw logits of the student and the teacher over the whole
vocabulary. With z_s = (s + b_s) / T, z_t = (t + b_t) / T, lse their log-partitions, S = z_s - lse_s,
U = z_t - lse_t (log-probs), p = e^S, q = e^U:

  KIND 0  forward KL   D = Σ q (U - S)                         dD/dz_s = p - q
  KIND 1  reverse KL   D = Σ p (S - U)                         dD/dz_s = p (S - U - D)
  KIND 2  JSD(β)       D = β Σ q (U - log m) + (1-β) Σ p (S - log m),  m = β q + (1-β) p
                       dD/dz_s = (1-β) p (S - log m - Σ p (S - log m))

HARD: with target y >= 0, loss = (1 - a) D + a CE, CE = lse(s + b_s) - (s + b_s)_y (untempered), and
dloss/dz_s = (1 - a) dD/dz_s + a T (softmax(s + b_s) - 1[j = y]).
`loss [n]` gets the per-row loss; with GRAD, `s` is overwritten with d(raw) = w_row · dloss/dz_s / T (fp32).
Forward and reverse KL take two sweeps of the row (statistics with the weighted gap folded in online, then
the gradient); JSD three (statistics, the two KL sums, the gradient). Row offsets are int64.
"""

import triton
import triton.language as tl

from ._device import on_device_of

BLOCK_V, NUM_WARPS = 2048, 8


@triton.jit
def _tempered(row_ptr, b_ptr, cols, ok, inv_t, HAS_B: tl.constexpr):
    raw = tl.load(row_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_B:
        raw += tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    return raw, tl.where(ok, raw * inv_t, float("-inf"))


@triton.jit
def _row_logps(s_row, t_row, bs_ptr, bt_ptr, v0, n_cols, inv_t, lse_s, lse_t,
               HAS_BS: tl.constexpr, HAS_BT: tl.constexpr, BLOCK_V: tl.constexpr):
    """Columns, mask, raw student logits (biased) and the log-probs S = z_s - lse_s, U = z_t - lse_t (0 past the
    last column) of the block of the row starting at `v0`."""
    cols = v0 + tl.arange(0, BLOCK_V)
    ok = cols < n_cols
    raw_s, zs = _tempered(s_row, bs_ptr, cols, ok, inv_t, HAS_BS)
    _raw_t, zt = _tempered(t_row, bt_ptr, cols, ok, inv_t, HAS_BT)
    return cols, ok, raw_s, tl.where(ok, zs - lse_s, 0.0), tl.where(ok, zt - lse_t, 0.0)


@triton.jit
def _log_mix(ls, lt, log_b, log_1b):
    """log m = log(β q + (1-β) p) from S = log p, U = log q, computed as a stable two-term log-sum-exp."""
    a = lt + log_b
    b = ls + log_1b
    hi = tl.maximum(a, b)
    return hi + tl.log(1.0 + tl.exp(tl.minimum(a, b) - hi))


@triton.jit
def _rescale(m_old, m_new):
    return tl.where(m_old == float("-inf"), 0.0, tl.exp(m_old - m_new))


@triton.jit
def divergence_rows_kernel(
    s_ptr, t_ptr, bs_ptr, bt_ptr, tgt_ptr, w_ptr, loss_ptr,
    n_cols, stride_s, stride_t, inv_t, beta, hard,
    KIND: tl.constexpr, HAS_BS: tl.constexpr, HAS_BT: tl.constexpr, HARD: tl.constexpr, GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + row * stride_s
    t_row = t_ptr + row * stride_t
    tgt = tl.load(tgt_ptr + row)
    m_s = float("-inf")
    sum_s = 0.0
    m_t = float("-inf")
    sum_t = 0.0
    gap = 0.0  # KIND 0: Σ e^{z_t - m_t} (z_t - z_s); KIND 1: Σ e^{z_s - m_s} (z_s - z_t)
    m_1 = float("-inf")
    sum_1 = 0.0
    raw_y = 0.0
    for v0 in range(0, n_cols, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        ok = cols < n_cols
        raw_s, zs = _tempered(s_row, bs_ptr, cols, ok, inv_t, HAS_BS)
        raw_t, zt = _tempered(t_row, bt_ptr, cols, ok, inv_t, HAS_BT)
        diff = (raw_t - raw_s) * inv_t  # z_t - z_s, finite (0) past the last column
        ms_new = tl.maximum(m_s, tl.max(zs, 0))
        mt_new = tl.maximum(m_t, tl.max(zt, 0))
        es = tl.where(ok, tl.exp(zs - ms_new), 0.0)
        et = tl.where(ok, tl.exp(zt - mt_new), 0.0)
        if KIND == 0:
            gap = gap * _rescale(m_t, mt_new) + tl.sum(et * diff, 0)
        if KIND == 1:
            gap = gap * _rescale(m_s, ms_new) - tl.sum(es * diff, 0)
        sum_s = sum_s * _rescale(m_s, ms_new) + tl.sum(es, 0)
        sum_t = sum_t * _rescale(m_t, mt_new) + tl.sum(et, 0)
        m_s = ms_new
        m_t = mt_new
        if HARD:
            r1 = tl.where(ok, raw_s, float("-inf"))
            m1_new = tl.maximum(m_1, tl.max(r1, 0))
            sum_1 = sum_1 * _rescale(m_1, m1_new) + tl.sum(tl.where(ok, tl.exp(r1 - m1_new), 0.0), 0)
            m_1 = m1_new
            raw_y += tl.sum(tl.where(cols == tgt, raw_s, 0.0), 0)
    lse_s = m_s + tl.log(sum_s)
    lse_t = m_t + tl.log(sum_t)
    log_b = tl.log(beta)
    log_1b = tl.log(1.0 - beta)
    kl_s = 0.0
    if KIND == 0:
        div = gap / sum_t - lse_t + lse_s
    elif KIND == 1:
        div = gap / sum_s - lse_s + lse_t
    else:
        kl_t = 0.0
        for v0 in range(0, n_cols, BLOCK_V):
            _c, ok, _r, ls, lt = _row_logps(s_row, t_row, bs_ptr, bt_ptr, v0, n_cols, inv_t, lse_s, lse_t,
                                            HAS_BS, HAS_BT, BLOCK_V)
            log_m = _log_mix(ls, lt, log_b, log_1b)
            kl_t += tl.sum(tl.where(ok, tl.exp(lt) * (lt - log_m), 0.0), 0)
            kl_s += tl.sum(tl.where(ok, tl.exp(ls) * (ls - log_m), 0.0), 0)
        div = beta * kl_t + (1.0 - beta) * kl_s
    loss = div
    lse_1 = 0.0
    if HARD:
        lse_1 = m_1 + tl.log(sum_1)
        ce = tl.where(tgt >= 0, lse_1 - raw_y, 0.0)
        loss = (1.0 - hard) * div + hard * ce
    tl.store(loss_ptr + row, loss)
    if GRAD:
        w = tl.load(w_ptr + row) * inv_t
        for v0 in range(0, n_cols, BLOCK_V):
            cols, ok, raw_s, ls, lt = _row_logps(s_row, t_row, bs_ptr, bt_ptr, v0, n_cols, inv_t, lse_s, lse_t,
                                                 HAS_BS, HAS_BT, BLOCK_V)
            p = tl.exp(ls)
            if KIND == 0:
                d = p - tl.exp(lt)
            elif KIND == 1:
                d = p * (ls - lt - div)
            else:
                d = (1.0 - beta) * p * (ls - _log_mix(ls, lt, log_b, log_1b) - kl_s)
            if HARD:
                p1 = tl.exp(raw_s - lse_1)
                d = (1.0 - hard) * d + (hard / inv_t) * (p1 - tl.where(cols == tgt, 1.0, 0.0))
            tl.store(s_row + cols, d * w, mask=ok)


def launch_divergence_rows(s, t, bs, bt, tgt, w, loss, inv_t: float, beta: float, hard: float, kind: int,
                           grad: bool) -> None:
    """Run the kernel over the n rows of `s` / `t` (module docstring); `tgt` int32 [n] (-1: no target), `w`
    fp32 [n] (read only with grad), `loss` fp32 [n] (written)."""
    n, c = s.shape
    if n == 0:
        return
    with on_device_of(s):
        divergence_rows_kernel[(n,)](
            s, t, s if bs is None else bs, t if bt is None else bt, tgt, w, loss,
            c, s.stride(0), t.stride(0), float(inv_t), float(beta), float(hard),
            KIND=kind, HAS_BS=bs is not None, HAS_BT=bt is not None, HARD=hard > 0.0, GRAD=grad,
            BLOCK_V=BLOCK_V, num_warps=NUM_WARPS,
        )
