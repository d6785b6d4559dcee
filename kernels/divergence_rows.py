"""Distillation epilogue: one program per token row of two fp32 chunks written by GEMMs (or by the host).

Inputs `s [n, c]`, `t [n, c]` (fp32, any row stride) over the whole vocabulary: the student's raw logits and
the teacher's raw logits (T_LOGITS) or log-probs (a teacher given as probabilities or top-k log-probs). With
u_s = softcap(SCALE (s + b_s)) (untempered), z_s = u_s / T, z_t = softcap(SCALE (t + b_t)) / T (T_LOGITS)
or t / T, T per row (`inv_t [n]`), lse their log-partitions, S = z_s - lse_s, U = z_t - lse_t, p = e^S,
q = e^U:

  KIND 0  forward KL   D = Σ q (U - S)                         dD/dz_s = p - q
  KIND 1  reverse KL   D = Σ p (S - U)                         dD/dz_s = p (S - U - D)
  KIND 2  JSD(β)       D = β Σ q B + (1-β) Σ p A,  m = β q + (1-β) p,  A = S - log m,  B = U - log m
                       dD/dz_s = (1-β) p (A - Σ p A / Σ p)

JSD's log-ratios come from d = U - S alone: L = log1p(w expm1(-|d|)), w = β (d <= 0) or 1-β (d > 0),
A = -max(d, 0) - L, B = min(d, 0) - L (exact where one side has no mass, 0 where p = q); the mean of A is
divided by Σ p, which the rounded lse leaves 1 + ε; the three sums add up in fp64 and the mean is subtracted
as two floats (`ludic_fast.ops.divergence_math` says why each matters).

Every term of zero mass (a column of -inf) is exactly 0 (0 log 0 = 0); D is stored clamped at 0 (NaN kept);
a reverse-KL row of D = +inf (student mass where the teacher has none) gets a NaN gradient; a row of weight
0 (an ignored token) a zero one, whatever its values. HARD: with target y >= 0, loss = (1 - a) D + a CE,
CE = lse(u_s) - u_{s,y}, and dloss/dz_s = (1 - a) dD/dz_s + a T (softmax(u_s) - 1[j = y]).
`loss [n]` gets the per-row loss; with ENTROPY, `ent [n]` the student's entropy H = log σ - τ / σ relative
to the running maximum m (σ = Σ e^{z_s - m} = 1 + tail, the maximum's own 1 kept apart and log σ taken as
log1p(tail); τ = Σ e^{z_s - m} (z_s - m)), so a confident row's small H keeps a small relative error.
With GRAD, `s` is overwritten with d(raw) = w_row dloss/d(raw) (fp32),
d(raw) = dloss/dz_s / T · SCALE (1 - tanh^2) (the tanh factor only with a softcap).
Forward and reverse KL take two sweeps of the row (statistics with the weighted gap folded in online relative
to the running maxima, D = gap / σ - log σ + log σ' with σ the sums of e^{z - max}, then the gradient); JSD
three (statistics, the two KL sums, the gradient). Row offsets are int64.
"""

import triton
import triton.language as tl

from ._device import on_device_of
from ._logit_math import expm1_, log1p_, tanh_

BLOCK_V, NUM_WARPS = 2048, 8


@triton.jit
def _final(row_ptr, b_ptr, cols, ok, inv_t, HAS_B: tl.constexpr, TRANSFORM: tl.constexpr, SCALE: tl.constexpr,
           HAS_SOFTCAP: tl.constexpr, SOFTCAP: tl.constexpr):
    """(untempered u, final z = u / T (-inf past the last column), tanh of the softcap or 0) of one block."""
    u = tl.load(row_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_B:
        u += tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    th = tl.zeros_like(u)
    if TRANSFORM:
        u = u * SCALE
        if HAS_SOFTCAP:
            th = tanh_(u / SOFTCAP)
            u = SOFTCAP * th
    return u, tl.where(ok, u * inv_t, float("-inf")), th


@triton.jit
def _mixture_log_ratios(ls, lt, beta):
    """(A, B) = (S - log m, U - log m) from d = U - S (module docstring); NaN where S = U = -inf."""
    d = lt - ls
    L = log1p_(tl.where(d > 0, 1.0 - beta, beta) * expm1_(-tl.abs(d)))
    return -tl.maximum(d, 0.0) - L, tl.minimum(d, 0.0) - L


@triton.jit
def _rescale(m_old, m_new):
    return tl.where(m_old == float("-inf"), 0.0, tl.exp(m_old - m_new))


@triton.jit
def _delta(m_old, m_new):
    """How far a running maximum moved (0 when it did not, also at -inf)."""
    return tl.where(m_old == m_new, 0.0, m_new - m_old)


@triton.jit
def _entropy_sums(tail, tau, m_old, m_new, x, e, block_max):
    """The entropy's online sums after one block (x = z - m_new, e = e^x): the tail Σ e^x over every column
    but one at the maximum, kept apart from that column's e^0 = 1 so no rounding at 1 hides it, and
    τ = Σ e^x x; when the maximum moves, the old maximum's 1 joins the tail and both rescale by e^{m_old - m_new}
    (τ's terms also shift by m_old - m_new)."""
    alpha = _rescale(m_old, m_new)
    sigma_old = tl.where(m_old != float("-inf"), 1.0 + tail, 0.0)
    tau = tl.where(m_old != float("-inf"), (tau + sigma_old * (m_old - m_new)) * alpha, 0.0)
    tau += tl.sum(tl.where(e == 0, 0.0, e * x), 0)
    moved = block_max > m_old
    first_max = tl.arange(0, x.shape[0]) == tl.argmax(tl.where(x == x, x, float("-inf")), 0)  # NaN: no maximum
    block_tail = tl.sum(tl.where(first_max, tl.where(moved, 0.0, e), e), 0)
    tail = tl.where(moved, sigma_old * alpha + block_tail, tail + block_tail)
    return tail, tau


@triton.jit
def _shift(m):
    """A running maximum as a shift: -inf (no finite logit yet) becomes 0, so -inf - shift stays -inf."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def divergence_rows_kernel(
    s_ptr, t_ptr, bs_ptr, bt_ptr, tgt_ptr, w_ptr, inv_t_ptr, loss_ptr, ent_ptr,
    n_cols, stride_s, stride_t, beta, hard,
    KIND: tl.constexpr, HAS_BS: tl.constexpr, HAS_BT: tl.constexpr, HARD: tl.constexpr, GRAD: tl.constexpr,
    T_LOGITS: tl.constexpr, SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SOFTCAP: tl.constexpr,
    ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + row * stride_s
    t_row = t_ptr + row * stride_t
    tgt = tl.load(tgt_ptr + row)
    inv_t = tl.load(inv_t_ptr + row)
    m_s = float("-inf")
    sum_s = 0.0
    m_t = float("-inf")
    sum_t = 0.0
    gap = 0.0  # KIND 0: Σ e^{x_t} (x_t - x_s); KIND 1: Σ e^{x_s} (x_s - x_t); x = z - (running max m)
    m_1 = float("-inf")
    sum_1 = 0.0
    u_y = 0.0
    tail_s = 0.0  # ENTROPY: Σ e^{x_s} over every column but one at the running maximum
    tau_s = 0.0  # ENTROPY: Σ e^{x_s} x_s
    for v0 in range(0, n_cols, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        ok = cols < n_cols
        u_s, zs, _th = _final(s_row, bs_ptr, cols, ok, inv_t, HAS_BS, True, SCALE, HAS_SOFTCAP, SOFTCAP)
        _u, zt, _th_t = _final(t_row, bt_ptr, cols, ok, inv_t, HAS_BT, T_LOGITS, SCALE, HAS_SOFTCAP, SOFTCAP)
        ms_new = tl.maximum(m_s, tl.max(zs, 0))
        mt_new = tl.maximum(m_t, tl.max(zt, 0))
        xs = zs - _shift(ms_new)
        xt = zt - _shift(mt_new)
        es = tl.exp(xs)
        et = tl.exp(xt)
        if KIND == 0:  # the old terms' x_s and x_t move with the maxima, then the weights e^{x_t} rescale
            moved = tl.where(sum_t == 0, 0.0, sum_t * (_delta(m_s, ms_new) - _delta(m_t, mt_new)))
            gap = (gap + moved) * _rescale(m_t, mt_new) + tl.sum(tl.where(et == 0, 0.0, et * (xt - xs)), 0)
        if KIND == 1:
            moved = tl.where(sum_s == 0, 0.0, sum_s * (_delta(m_t, mt_new) - _delta(m_s, ms_new)))
            gap = (gap + moved) * _rescale(m_s, ms_new) + tl.sum(tl.where(es == 0, 0.0, es * (xs - xt)), 0)
        if ENTROPY:
            tail_s, tau_s = _entropy_sums(tail_s, tau_s, m_s, ms_new, xs, es, tl.max(zs, 0))
        sum_s = sum_s * _rescale(m_s, ms_new) + tl.sum(es, 0)
        sum_t = sum_t * _rescale(m_t, mt_new) + tl.sum(et, 0)
        m_s = ms_new
        m_t = mt_new
        if HARD:
            r1 = tl.where(ok, u_s, float("-inf"))
            m1_new = tl.maximum(m_1, tl.max(r1, 0))
            sum_1 = sum_1 * _rescale(m_1, m1_new) + tl.sum(tl.exp(r1 - _shift(m1_new)), 0)
            m_1 = m1_new
            u_y += tl.sum(tl.where(cols == tgt, u_s, 0.0), 0)
    lse_s = m_s + tl.log(sum_s)
    lse_t = m_t + tl.log(sum_t)
    mean_a = 0.0  # KIND 2: Σ p A / Σ p = mean_a + mean_lo (module docstring)
    mean_lo = 0.0
    if KIND == 0:  # relative to the maxima: no rounding step of the logits' size (D = 0 exactly at V = 1)
        div = gap / sum_t - tl.log(sum_t) + tl.log(sum_s)
    elif KIND == 1:
        div = gap / sum_s - tl.log(sum_s) + tl.log(sum_t)
    else:
        kl_t = tl.zeros((), tl.float64)  # the sums in fp64 (module docstring)
        kl_s = tl.zeros((), tl.float64)
        sum_p = tl.zeros((), tl.float64)
        for v0 in range(0, n_cols, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            ok = cols < n_cols
            _u, zs, _th = _final(s_row, bs_ptr, cols, ok, inv_t, HAS_BS, True, SCALE, HAS_SOFTCAP, SOFTCAP)
            _u, zt, _th = _final(t_row, bt_ptr, cols, ok, inv_t, HAS_BT, T_LOGITS, SCALE, HAS_SOFTCAP, SOFTCAP)
            ls = zs - lse_s
            lt = zt - lse_t
            p = tl.exp(ls)
            q = tl.exp(lt)
            a, b = _mixture_log_ratios(ls, lt, beta)
            kl_t += tl.sum(tl.where(q == 0, 0.0, q * b).to(tl.float64), 0)
            kl_s += tl.sum(tl.where(p == 0, 0.0, p * a).to(tl.float64), 0)
            sum_p += tl.sum(p.to(tl.float64), 0)
        div = (beta * kl_t + (1.0 - beta) * kl_s).to(tl.float32)
        r = 1.0 / sum_p.to(tl.float32)  # kl_s / sum_p without a div.rn.f64 (a subroutine call): an fp32
        mean64 = kl_s * r  # reciprocal and one Newton step, relative error ~1e-14
        mean64 += (kl_s - mean64 * sum_p) * r
        mean_a = mean64.to(tl.float32)
        mean_lo = (mean64 - mean_a.to(tl.float64)).to(tl.float32)
    loss = tl.where(div < 0.0, 0.0, div)  # D >= 0: a rounding below 0 is clamped, NaN kept
    lse_1 = 0.0
    if HARD:
        lse_1 = m_1 + tl.log(sum_1)
        ce = tl.where(tgt >= 0, lse_1 - u_y, 0.0)
        loss = (1.0 - hard) * loss + hard * ce
    tl.store(loss_ptr + row, loss)
    if ENTROPY:  # H = log σ - τ / σ, σ = 1 + tail (log1p keeps the small H of a confident row)
        h = log1p_(tail_s) - tau_s / (1.0 + tail_s)
        tl.store(ent_ptr + row, tl.where(h < 0.0, 0.0, h))
    if GRAD:
        w = tl.load(w_ptr + row)
        row_factor = w * inv_t * SCALE
        if KIND == 1:  # a row of D = +inf has no gradient
            row_factor = tl.where(div == float("inf"), float("nan"), row_factor)
        for v0 in range(0, n_cols, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            ok = cols < n_cols
            u_s, zs, th = _final(s_row, bs_ptr, cols, ok, inv_t, HAS_BS, True, SCALE, HAS_SOFTCAP, SOFTCAP)
            _u, zt, _th = _final(t_row, bt_ptr, cols, ok, inv_t, HAS_BT, T_LOGITS, SCALE, HAS_SOFTCAP, SOFTCAP)
            ls = zs - lse_s
            lt = zt - lse_t
            p = tl.exp(ls)
            if KIND == 0:
                d = p - tl.exp(lt)
            elif KIND == 1:
                d = tl.where(p == 0, 0.0, p * (ls - lt - div))
            else:
                a, _b = _mixture_log_ratios(ls, lt, beta)
                d = tl.where(p == 0, 0.0, (1.0 - beta) * p * ((a - mean_a) - mean_lo))
            if HARD:
                p1 = tl.exp(u_s - lse_1)
                d = (1.0 - hard) * d + (hard / inv_t) * (p1 - tl.where(cols == tgt, 1.0, 0.0))
            d = d * row_factor
            if HAS_SOFTCAP:
                d = d * (1.0 - th * th)
            tl.store(s_row + cols, tl.where(w == 0.0, 0.0, d), mask=ok)  # an ignored row: 0, even from NaN


def launch_divergence_rows(s, t, bs, bt, tgt, w, inv_t, loss, beta: float, hard: float, kind: int, grad: bool,
                           t_logits: bool = True, scale: float = 1.0, softcap: float | None = None,
                           entropy=None) -> None:
    """Run the kernel over the n rows of `s` / `t` (module docstring); `tgt` int32 [n] (-1: no target), `w`
    fp32 [n] (read only with grad), `inv_t` fp32 [n], `loss` fp32 [n] (written), `entropy` fp32 [n] or None
    (written: the student's entropy)."""
    n, c = s.shape
    if n == 0:
        return
    with on_device_of(s):
        divergence_rows_kernel[(n,)](
            s, t, s if bs is None else bs, t if bt is None else bt, tgt, w, inv_t, loss,
            loss if entropy is None else entropy,
            c, s.stride(0), t.stride(0), float(beta), float(hard),
            KIND=kind, HAS_BS=bs is not None, HAS_BT=bt is not None, HARD=hard > 0.0, GRAD=grad,
            T_LOGITS=t_logits, SCALE=float(scale), HAS_SOFTCAP=softcap is not None,
            SOFTCAP=1.0 if softcap is None else float(softcap), ENTROPY=entropy is not None, BLOCK_V=BLOCK_V,
            num_warps=NUM_WARPS,
        )
