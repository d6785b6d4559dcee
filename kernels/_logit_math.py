"""Shared @triton.jit helpers: the map raw logits -> final logits and its derivative, and the per-row online
statistics of the final logits.

    final = softcap(SCALE * raw) * inv_t,   softcap(x) = C * tanh(x / C)
    d final / d raw = inv_t * SCALE * (1 - tanh^2)      (the tanh factor only with a softcap)

Statistics, relative to the running row maximum m (as `ludic_fast.ops.torch_head`, whose docstring derives
them): tail = sum_{j != argmax} e^{z_j - m} (the maximum's own e^0 = 1 kept apart), t = sum e^{z-m} (z-m);
log s = log1p(tail), lse = m + log s, H = log s - t / s, elp = (m - lse) + t / s (E_p log p against the stored
lse). Relative logits are floored at REL_LOGIT_FLOOR (e^x = 0 below it), so logits of -inf (a masked
vocabulary) add exactly 0 to every sum and gradient.

Scalar hyper-parameters are tl.constexpr (never Python floats at runtime: those become fp64 under
torch.compile); the per-token 1/T is a tensor.
"""

import triton
import triton.language as tl

#: relative logits are clamped here: e^x is exactly 0 below it in fp32 (and fp64), so 0 * (-inf) becomes 0
REL_LOGIT_FLOOR: tl.constexpr = tl.constexpr(-2048.0)


@triton.jit
def tanh_(x):
    """tanh through the sigmoid (exact limits +-1 at +-inf, no libdevice)."""
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def final_logits(raw, inv_t, SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SOFTCAP: tl.constexpr):
    """(final logits, tanh of the softcap or 0) of a [BM, BN] tile of raw fp32 logits; inv_t is [BM]."""
    x = raw * SCALE
    if HAS_SOFTCAP:
        th = tanh_(x / SOFTCAP)
        x = SOFTCAP * th
    else:
        th = tl.zeros_like(x)
    return x * inv_t[:, None], th


@triton.jit
def raw_grad(dz, th, inv_t, SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """dL/d(raw) from dL/d(final) on a [BM, BN] tile (chain rule through 1/T, softcap, scale)."""
    d = dz * (inv_t[:, None] * SCALE)
    if HAS_SOFTCAP:
        d = d * (1.0 - th * th)
    return d


@triton.jit
def log_p_of(z, lse):
    """log p = z - lse of a [BM, BN] tile, floored at REL_LOGIT_FLOOR (p = e^{log p} is 0 there exactly)."""
    return tl.maximum(z - lse[:, None], REL_LOGIT_FLOOR)


@triton.jit
def logit_grad(log_p, p, is_target, g_lp, g_h, elp, HAS_GH: tl.constexpr):
    """dL/d(final logits): g_lp (1[j=y] - p) - g_H p (log p - elp), per [BM, BN] tile (log p from `log_p_of`,
    p = e^{log p}; elp = E_p z - lse, so log p_j - elp = z_j - E_p z)."""
    dz = tl.where(is_target, g_lp[:, None], 0.0) - g_lp[:, None] * p
    if HAS_GH:
        dz -= g_h[:, None] * p * (log_p - elp[:, None])
    return dz


@triton.jit
def log1p_(x):
    """log(1 + x) to a few ulps for small x (1 + x rounds away the low bits of x; the ratio restores them)."""
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * (x / (u - 1.0)))


@triton.jit
def expm1_(x):
    """e^x - 1 to a few ulps for small x (Kahan: the ratio x / log(e^x) restores what e^x - 1 rounds away);
    exactly -1 once e^x rounds to 0 (x = -inf included)."""
    u = tl.exp(x)
    um1 = u - 1.0
    return tl.where(u == 1.0, x, tl.where(um1 == -1.0, um1, um1 * (x / tl.log(u))))


@triton.jit
def finite_or_zero(m):
    """Row maxima as shifts: -inf (no finite logit yet) becomes 0, so z - shift stays -inf (not NaN)."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def online_stats_update(z, cols, col_ok, tgt, m, tail, t, zy, ENTROPY: tl.constexpr):
    """Fold a [BM, BN] tile of final logits (columns `cols`) into the per-row online
    statistics and return them: m = max z, tail, t (ENTROPY only; see the module docstring), zy += z at the
    target column. Columns with col_ok False are -inf (padded vocabulary); z must be finite there.
    When the maximum moves into the tile, its columns are found by value (z - m' == 0 exactly, as fp32
    subtraction of distinct numbers is never 0) rather than by index, which keeps no per-column index live:
    they are left out of the sum and k tied columns add exactly k - 1 to the tail."""
    pad = tl.where(col_ok, 0.0, float("-inf"))[None, :]
    zy += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)
    tile_max = tl.max(z + pad, axis=1)
    new = tile_max > m  # the row maximum moves into this tile
    m_new = tl.where(new, tile_max, m)
    shift = finite_or_zero(m_new)
    rel = tl.maximum(z + pad - shift[:, None], REL_LOGIT_FLOOR)
    own = new[:, None] & (rel == 0.0)  # the new maximum's columns: e^0 = 1 each
    e = tl.where(own, 0.0, tl.exp(rel))
    keep = tl.exp(m - shift)
    if ENTROPY:
        moved = tl.where(m == float("-inf"), 0.0, (1.0 + tail) * (m - shift))
        t = (t + moved) * keep + tl.sum(e * rel, axis=1)
    ties = (tl.sum(own.to(tl.int32), axis=1) - new.to(tl.int32)).to(tl.float32)  # k tied new maxima: k - 1
    tail = tl.where(new, 1.0 + tail, tail) * keep + (tl.sum(e, axis=1) + ties)
    return m_new, tail, t, zy


@triton.jit
def merge_partial(m, tail, t, m_i, tail_i, t_i, ENTROPY: tl.constexpr):
    """Fold the statistics (m_i, tail_i, t_i) of another part of the vocabulary into (m, tail, t)."""
    new = m_i > m
    m_new = tl.where(new, m_i, m)
    shift = finite_or_zero(m_new)
    c = tl.exp(m - shift)
    c_i = tl.exp(m_i - shift)
    if ENTROPY:
        t_old = tl.where(m == float("-inf"), 0.0, (t + (1.0 + tail) * (m - shift)) * c)
        t = t_old + tl.where(m_i == float("-inf"), 0.0, (t_i + (1.0 + tail_i) * (m_i - shift)) * c_i)
    tail = tl.where(new, (1.0 + tail) * c + tail_i, tail + (1.0 + tail_i) * c_i)
    return m_new, tail, t


@triton.jit
def finish_stats(m, tail, t):
    """(lse, elp, H) from the online statistics (module docstring)."""
    log_s = log1p_(tail)
    lse = m + log_s
    e_rel = t / (1.0 + tail)
    return lse, (m - lse) + e_rel, log_s - e_rel
