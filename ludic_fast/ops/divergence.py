"""Fused two-head distillation: a divergence between the student's and the teacher's next-token distributions
from both models' hidden states and LM heads, without the [N, V] logits of either.

    z_s = (h_s W_s^T + b_s) / T,   z_t = (h_t W_t^T + b_t) / T,   s = log_softmax(z_s),  t = log_softmax(z_t)

    forward_kl   D = KL(p_t || p_s) = Σ_v p_t (t - s)                 dD/dz_s = p_s - p_t
    reverse_kl   D = KL(p_s || p_t) = Σ_v p_s (s - t)                 dD/dz_s = p_s (s - t - D)
    jsd          D = β KL(p_t || m) + (1 - β) KL(p_s || m),  m = β p_t + (1 - β) p_s
                 dD/dz_s = (1 - β) p_s (g - Σ_v p_s g),  g = s - log m

The generalised JSD follows the GKD paper (Agarwal et al., arXiv 2306.13649) and uses the β convention of
Liger-Kernel's `LigerFusedLinearJSD` / `LigerFusedLinearJSDLoss` and TRL's `chunked_divergence` (β weights the
teacher's KL to the mixture, the mixture is β p_t + (1 - β) p_s; their β = 0 / 1 are our forward_kl /
reverse_kl kinds).

With targets and `hard_weight` α the per-token loss is (1 - α) D + α CE, CE = -log softmax(z_s T)_y (the
hard-label cross-entropy of the untempered student logits, as Liger's distillation base). Tokens with
target == ignore_index count for nothing. Reductions: 'mean' (over counted tokens), 'sum', 'none' (per token).

Token chunks of `rows = memory_budget / (16 V)` rows (four fp32 [rows, V] buffers): the teacher's logits
chunk is computed under no_grad and dropped with the chunk. For 'mean' and 'sum' the student's gradient is
formed in the forward (2 N V (D_s + D_t) + 4 N V D_s FLOPs in all; the backward only scales it); for 'none'
the backward recomputes both heads with the upstream per-token gradient. Gradients reach the student's
hidden, weight and bias only. The two heads may have different hidden sizes and dtypes.

Backends: 'torch' (any device: the chunk's epilogue as in-place torch ops over the logits) and 'triton'
(CUDA, or CPU under TRITON_INTERPRET=1): cuBLAS GEMMs write both raw-logits chunks, one Triton row kernel
(`ludic_fast.kernels.divergence_rows`) forms the loss and writes d(raw) over the student's chunk in two or
three sweeps, cuBLAS forms dh and dW.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ludic_fast._common import autocast_as_matmul
from ludic_fast.ops.budget import default_chunk_elements, parse_memory_budget
from ludic_fast.ops.torch_head import addmm_acc_, gemm_f32

KINDS = ("forward_kl", "reverse_kl", "jsd")
REDUCTIONS = ("mean", "sum", "none")


@dataclass(frozen=True)
class _Spec:
    kind: str
    beta: float
    inv_t: float
    hard_weight: float
    rows: int
    backend: str = "torch"


def _acc_dtype(*tensors: Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _logits(h: Tensor, W: Tensor, b: Tensor | None, inv_t: float, acc: torch.dtype) -> Tensor:
    """(h W^T + b) / T as a fresh acc-dtype chunk (fp32 output GEMM for bf16/fp16 CUDA operands)."""
    z = (h.to(acc) @ W.to(acc).T) if acc == torch.float64 else gemm_f32(h, W.T.to(h.dtype))
    if b is not None:
        z.add_(b.to(z.dtype))
    return z if inv_t == 1.0 else z.mul_(inv_t)


def _rowdot(a: Tensor, b: Tensor) -> Tensor:
    """Σ_v a b per row without an [n, V] temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def _chunk(spec: _Spec, zs: Tensor, zt: Tensor, tgt: Tensor | None, want_grad: bool) -> tuple[Tensor, Tensor | None]:
    """(per-token loss, dloss/dz_s or None) of one chunk; zs and zt are consumed (overwritten in place)."""
    zs.sub_(torch.logsumexp(zs, 1)[:, None])  # s
    zt.sub_(torch.logsumexp(zt, 1)[:, None])  # t
    a = spec.hard_weight if tgt is not None else 0.0
    ce = p1 = None
    if a > 0.0:  # CE on the untempered logits z = T s + const: p1 = softmax(T s)
        if spec.inv_t == 1.0:
            ce = -zs.gather(1, tgt[:, None]).squeeze(1)
        else:
            p1 = zs.mul(1.0 / spec.inv_t)
            p1.sub_(torch.logsumexp(p1, 1)[:, None])
            ce = -p1.gather(1, tgt[:, None]).squeeze(1)
            p1.exp_()
    if spec.kind == "forward_kl":
        pt = zt.exp()
        loss = _rowdot(pt, zt.sub_(zs))
        ps = zs.exp_()
        dz = torch.sub(ps, pt, out=zt) if want_grad else None
    elif spec.kind == "reverse_kl":
        diff = zt.neg_().add_(zs)  # s - t
        ps = zs.exp_()
        loss = _rowdot(ps, diff)
        dz = diff.sub_(loss[:, None]).mul_(ps) if want_grad else None
    else:
        beta = spec.beta
        log_m = zs + math.log1p(-beta)
        ps = zt + math.log(beta)
        torch.logaddexp(log_m, ps, out=log_m)
        torch.exp(zt, out=ps)  # p_t for now
        kl_t = _rowdot(ps, zt.sub_(log_m))
        torch.exp(zs, out=ps)  # p_s from here on
        g = zs.sub_(log_m)  # s - log m
        kl_s = _rowdot(ps, g)
        loss = beta * kl_t + (1.0 - beta) * kl_s
        dz = g.sub_(kl_s[:, None]).mul_(ps).mul_(1.0 - beta) if want_grad else None
    if ce is not None:
        loss = (1.0 - a) * loss + a * ce
        if dz is not None:  # d CE / d(z / T) = T (p1 - onehot(y)), the caller scales by 1/T
            c = a / spec.inv_t
            dz.mul_(1.0 - a).add_(ps if p1 is None else p1, alpha=c)
            dz.scatter_add_(1, tgt[:, None], torch.full_like(ce[:, None], -c))
    return loss, dz


def _weights(valid: Tensor, reduction: str) -> Tensor:
    w = valid.to(torch.float64 if valid.dtype == torch.float64 else torch.float32)
    return w / w.sum().clamp(min=1.0) if reduction == "mean" else w


def _triton_chunk(spec, h_c, Ws, bs, h_t, Wt, bt, tgt, token_w):
    """(per-token loss, d(raw) = token_w dloss/dz_s / T or None) of one chunk: the Triton row kernel over the
    fp32 GEMM workspaces of both heads (the student's is overwritten with d(raw))."""
    from ludic_fast.kernels.divergence_rows import launch_divergence_rows

    n = h_c.shape[0]
    zs = gemm_f32(h_c, Ws.T.to(h_c.dtype)).contiguous()
    zt = gemm_f32(h_t, Wt.T.to(h_t.dtype)).contiguous()
    dev = zs.device
    t32 = torch.full((n,), -1, dtype=torch.int32, device=dev) if tgt is None else tgt.to(torch.int32).contiguous()
    w = torch.zeros(n, dtype=torch.float32, device=dev) if token_w is None else token_w.float().contiguous()
    loss = torch.empty(n, dtype=torch.float32, device=dev)
    hard = spec.hard_weight if tgt is not None else 0.0
    launch_divergence_rows(zs, zt, None if bs is None else bs.float().contiguous(),
                           None if bt is None else bt.float().contiguous(), t32, w, loss, spec.inv_t, spec.beta,
                           hard, KINDS.index(spec.kind), token_w is not None)
    return loss, zs if token_w is not None else None


def _reduce(losses: Tensor, valid: Tensor, reduction: str) -> Tensor:
    if reduction == "none":
        return losses
    return losses.sum() if reduction == "sum" else losses.sum() / valid.sum().clamp(min=1.0)


def _grad_buffers(hs: Tensor, Ws: Tensor, bs: Tensor | None, need: tuple[bool, ...], acc: torch.dtype):
    dev = hs.device
    return (torch.zeros(hs.shape, dtype=acc, device=dev) if need[0] else None,
            torch.zeros(Ws.shape, dtype=acc, device=dev) if need[1] else None,
            torch.zeros(bs.shape, dtype=acc, device=dev) if need[2] and bs is not None else None)


def _sweep(spec, hs, Ws, bs, ht, Wt, bt, tgt, token_w, grads):
    """Per-token losses over all chunks; with `grads` = (dh, dW, db) (entries may be None) also
    dh += d(raw) W_s, dW += d(raw)^T h_s, db += Σ d(raw), for d(raw) = token_w · dD/dz_s / T."""
    acc = _acc_dtype(hs, Ws)
    n = hs.shape[0]
    losses = torch.zeros(n, dtype=acc, device=hs.device)
    for r0 in range(0, n, spec.rows):
        rows = slice(r0, min(n, r0 + spec.rows))
        h_c = hs[rows]
        t_c = None if tgt is None else tgt[rows]
        if spec.backend == "triton" and acc == torch.float32:  # the kernel writes d(raw) = w dloss/dz_s / T
            loss, d_raw = _triton_chunk(spec, h_c, Ws, bs, ht[rows], Wt, bt, t_c,
                                        None if grads is None else token_w[rows])
        else:
            zs = _logits(h_c, Ws, bs, spec.inv_t, acc)
            zt = _logits(ht[rows], Wt, bt, spec.inv_t, _acc_dtype(ht, Wt)).to(zs.dtype)
            loss, dz = _chunk(spec, zs, zt, t_c, grads is not None)
            del zt
            d_raw = None if dz is None else dz.mul_((token_w[rows] * spec.inv_t).to(dz.dtype)[:, None])
        losses[rows] = loss
        if grads is None:
            continue
        dh, dW, db = grads
        if db is not None:
            db.add_(d_raw.sum(0))
        d_lo = d_raw.to(h_c.dtype) if h_c.is_cuda else d_raw
        if dh is not None:
            addmm_acc_(dh[rows], d_lo, Ws.to(d_lo.dtype))
        if dW is not None:
            addmm_acc_(dW, d_lo.T, h_c.to(d_lo.dtype))
    return losses


class LinearDivergenceFunction(torch.autograd.Function):
    """Divergence (reduced or per token) with gradients to the student's hidden, weight and bias."""

    @staticmethod
    def forward(ctx, hs, Ws, bs, ht, Wt, bt, tgt, valid, spec: _Spec, reduction: str):  # type: ignore[override]
        need = ctx.needs_input_grad[:3]
        ctx.spec, ctx.reduction = spec, reduction
        ctx.dtypes = (hs.dtype, Ws.dtype, None if bs is None else bs.dtype)
        ctx.recompute = reduction == "none"
        if ctx.recompute or not any(need):
            losses = _sweep(spec, hs, Ws, bs, ht, Wt, bt, tgt, None, None)
            ctx.save_for_backward(hs, Ws, bs, ht, Wt, bt, tgt, valid)
        else:  # the gradient of the reduced loss, formed now
            grads = _grad_buffers(hs, Ws, bs, need, _acc_dtype(hs, Ws))
            losses = _sweep(spec, hs, Ws, bs, ht, Wt, bt, tgt, _weights(valid, reduction), grads)
            ctx.save_for_backward(*grads)
        ctx.used = False
        return _reduce(losses * valid, valid, reduction)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        if ctx.recompute:
            hs, Ws, bs, ht, Wt, bt, tgt, valid = ctx.saved_tensors
            grads = _grad_buffers(hs, Ws, bs, ctx.needs_input_grad[:3], _acc_dtype(hs, Ws))
            _sweep(ctx.spec, hs, Ws, bs, ht, Wt, bt, tgt, g * valid, grads)
        else:
            if ctx.used:
                raise RuntimeError("linear_divergence scales its stored gradients in place; backward it only once")
            ctx.used = True
            grads = tuple(None if t is None else t.mul_(g.to(t.dtype)) for t in ctx.saved_tensors)
        (dh, dW, db), (h_dt, w_dt, b_dt) = grads, ctx.dtypes
        return (None if dh is None else dh.to(h_dt), None if dW is None else dW.to(w_dt),
                None if db is None else db.to(b_dt), None, None, None, None, None, None, None)


def _check_head(name: str, h: Tensor, W: Tensor, b: Tensor | None) -> None:
    if not isinstance(h, Tensor) or not h.dtype.is_floating_point or h.ndim < 1:
        raise TypeError(f"h_{name} must be a floating-point tensor [..., D], got {getattr(h, 'dtype', type(h))}")
    if not isinstance(W, Tensor) or W.ndim != 2 or not W.dtype.is_floating_point:
        raise TypeError(f"W_{name} must be a floating-point tensor [V, D]")
    if W.shape[1] != h.shape[-1] or W.shape[0] == 0 or W.shape[1] == 0:
        raise ValueError(f"W_{name} {tuple(W.shape)} must be [V, D] with V, D > 0 and D = h_{name}.shape[-1] "
                         f"({h.shape[-1]})")
    if b is not None and tuple(b.shape) != (W.shape[0],):
        raise ValueError(f"b_{name} must have shape [{W.shape[0]}], got {tuple(b.shape)}")


@autocast_as_matmul("h_student", "W_student", "h_teacher", "W_teacher", "b_student", "b_teacher")  # ludic_fast.ops
def linear_divergence(
    h_student: Tensor,
    W_student: Tensor,
    h_teacher: Tensor,
    W_teacher: Tensor,
    targets: Tensor | None = None,
    *,
    kind: str = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    hard_weight: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    b_student: Tensor | None = None,
    b_teacher: Tensor | None = None,
    memory_budget: int | str | None = None,
    backend: str = "auto",
) -> Tensor:
    """Divergence between student and teacher next-token distributions (module docstring), fused with both
    LM heads: `h_student [..., D_s]`, `W_student [V, D_s]`, `h_teacher [..., D_t]`, `W_teacher [V, D_t]`
    (same leading shape, same V), optional `targets [...]` (ignore_index marks tokens that count for
    nothing; with `hard_weight` α the loss is (1 - α) D + α CE). `kind` forward_kl | reverse_kl | jsd
    (β = `beta` in (0, 1)). `memory_budget`: bytes (int, or a string like '2GiB') of transient chunk buffers
    (default 4 x 64 Mi fp32 elements). Returns a 0-d tensor ('mean', 'sum') or per-token losses of the
    leading shape ('none'); differentiable w.r.t. the student's hidden, weight and bias. `backend` 'auto'
    (triton on CUDA, else torch), 'torch' or 'triton' (CUDA, or CPU under TRITON_INTERPRET=1; float64 inputs
    run the torch path)."""
    from ludic_fast.ops import resolve_backend

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if kind == "jsd" and not 0.0 < beta < 1.0:
        raise ValueError(f"beta must lie in (0, 1) for kind='jsd' (its ends are forward_kl / reverse_kl), got {beta}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not 0.0 <= hard_weight <= 1.0:
        raise ValueError(f"hard_weight must lie in [0, 1], got {hard_weight}")
    if hard_weight > 0 and targets is None:
        raise ValueError("hard_weight > 0 needs targets")
    _check_head("student", h_student, W_student, b_student)
    _check_head("teacher", h_teacher, W_teacher, b_teacher)
    if h_teacher.shape[:-1] != h_student.shape[:-1]:
        raise ValueError(f"h_teacher {tuple(h_teacher.shape)} and h_student {tuple(h_student.shape)} must share "
                         "their leading (token) shape")
    V = W_student.shape[0]
    if W_teacher.shape[0] != V:
        raise ValueError(f"W_teacher has {W_teacher.shape[0]} vocabulary rows, W_student {V}: they must match")
    lead = h_student.shape[:-1]
    hs, ht = h_student.reshape(-1, h_student.shape[-1]), h_teacher.reshape(-1, h_teacher.shape[-1]).detach()
    acc = _acc_dtype(h_student, W_student)
    if targets is not None:
        if not isinstance(targets, Tensor) or targets.dtype.is_floating_point or targets.shape != lead:
            raise ValueError(f"targets must be an integer tensor of shape {tuple(lead)}")
        t1 = targets.reshape(-1)
        valid = t1 != ignore_index
        if bool(((t1 < 0) | (t1 >= V))[valid].any()):
            raise ValueError(f"targets must lie in [0, {V}) or equal ignore_index ({ignore_index})")
        tgt = torch.where(valid, t1, torch.zeros_like(t1)).long()
        valid = valid.to(acc)
    else:
        tgt, valid = None, torch.ones(hs.shape[0], dtype=acc, device=hs.device)
    budget = parse_memory_budget(memory_budget) or 16 * default_chunk_elements()
    spec = _Spec(kind, float(beta), 1.0 / float(temperature), float(hard_weight), max(1, budget // (16 * V)),
                 resolve_backend(backend, h_student.device))
    bt = None if b_teacher is None else b_teacher.detach()
    apply = _apply_outside_compile if spec.backend == "triton" else LinearDivergenceFunction.apply  # ludic_fast.ops
    out = apply(hs, W_student, b_student, ht, W_teacher.detach(), bt, tgt, valid, spec, reduction)
    return out.reshape(lead) if reduction == "none" else out


_apply_outside_compile = torch.compiler.disable(LinearDivergenceFunction.apply)


__all__ = ["linear_divergence", "LinearDivergenceFunction", "KINDS"]
