"""Shared @triton.jit helpers: the map raw logits -> final logits and its derivative.

    final = softcap(SCALE * raw) * inv_t,   softcap(x) = C * tanh(x / C)
    d final / d raw = inv_t * SCALE * (1 - tanh^2)      (the tanh factor only with a softcap)

Scalar hyper-parameters are tl.constexpr (never Python floats at runtime: those become fp64 under
torch.compile); the per-token 1/T is a tensor.
"""

import triton
import triton.language as tl


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
def logit_grad(z, p, is_target, g_lp, g_h, ez, HAS_GH: tl.constexpr):
    """dL/d(final logits): g_lp (1[j=y] - p) - g_H p (z - E_p z), per [BM, BN] tile.

    p must already be 0 on masked-out entries and z finite there (callers pass where(mask, z, 0))."""
    dz = tl.where(is_target, g_lp[:, None], 0.0) - g_lp[:, None] * p
    if HAS_GH:
        dz -= g_h[:, None] * p * (z - ez[:, None])
    return dz


@triton.jit
def online_stats_update(z, cols, col_ok, tgt, m, s, t, zy, ENTROPY: tl.constexpr):
    """Fold a [BM, BN] tile of final logits into the per-row online statistics and return them:
    m = max z, s = sum e^{z-m}, t = sum e^{z-m} z (ENTROPY only), zy += z at the target column.
    Columns with col_ok False are -inf for m and s and 0 for t (padded vocabulary); z must be finite there."""
    pad = tl.where(col_ok, 0.0, float("-inf"))[None, :]
    zy += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)
    m_new = tl.maximum(m, tl.max(z + pad, axis=1))
    keep = tl.exp(m - m_new)
    e = tl.exp(z + pad - m_new[:, None])
    s = s * keep + tl.sum(e, axis=1)
    if ENTROPY:
        t = t * keep + tl.sum(e * z, axis=1)
    return m_new, s, t, zy
