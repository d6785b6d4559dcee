"""Fused distillation: a divergence between the student's and the teacher's next-token distributions from the
student's hidden states and LM head, without the [N, V] logits of either model.

    z_s = softcap(logit_scale (h_s W_s^T + b_s)) / T,   s = log_softmax(z_s)
    teacher log-probs t: a teacher head (the same transform), dense probabilities or top-k log-probs
    (`ludic_fast.ops.divergence_teachers`)

    forward_kl   D = KL(p_t || p_s) = Σ_v p_t (t - s)                 dD/dz_s = p_s - p_t
    reverse_kl   D = KL(p_s || p_t) = Σ_v p_s (s - t)                 dD/dz_s = p_s (s - t - D)
    jsd          D = β KL(p_t || m) + (1 - β) KL(p_s || m),  m = β p_t + (1 - β) p_s
                 dD/dz_s = (1 - β) p_s (g - Σ_v p_s g),  g = s - log m

The generalised JSD follows the GKD paper (Agarwal et al., arXiv 2306.13649) and uses the β convention of
Liger-Kernel's `LigerFusedLinearJSD` / `LigerFusedLinearJSDLoss` and TRL's `chunked_divergence` (β weights the
teacher's KL to the mixture, the mixture is β p_t + (1 - β) p_s; their β = 0 / 1 are our forward_kl /
reverse_kl kinds). Zero-mass columns (logits of -inf, zero teacher probabilities) add exactly 0 (0 log 0 = 0);
reverse KL is +inf where the student has mass and the teacher none (math, not rounding). D >= 0 (clamped).

With targets and `hard_weight` α the per-token loss is (1 - α) D + α CE, CE = -log softmax(z_s T)_y (the
hard-label cross-entropy of the untempered student logits, as Liger's distillation base). Tokens with
target == ignore_index count for nothing. Reductions: 'mean' (over counted tokens), 'sum', 'none' (per token).

Token chunks of `rows = memory_budget / (B V)` rows, B the bytes of the chunk's buffers per logit (four, one
more with a softcap, two more with the entropy, of 4 bytes, 8 for float64): the teacher's chunk is formed
under no_grad and dropped with the chunk. For 'mean' and 'sum' the student's gradient is formed in the forward
(the backward only scales it); for 'none' the backward recomputes the chunks with the upstream per-token
gradient. Gradients reach the student's hidden, weight and bias only. The two heads may have different hidden
sizes and dtypes.

Backends: 'torch' (any device: the chunk's math as in-place torch ops, `ludic_fast.ops.divergence_math`) and
'triton' (CUDA, or CPU under TRITON_INTERPRET=1): cuBLAS GEMMs write the student's raw-logits chunk (and a teacher
head's), one Triton row kernel (`ludic_fast.kernels.divergence_rows`) forms the loss and writes d(raw) over the
student's chunk in two or three sweeps, cuBLAS forms dh and dW. The kernel covers every option but the
top-k 'bucket' tail: 'auto' runs that on the torch backend, 'triton' refuses it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ludic_fast._common import autocast_as_matmul
from ludic_fast.ops.budget import parse_memory_budget
from ludic_fast.ops.divergence_math import bucket_divergence, dense_divergence, entropy, log_softmax_
from ludic_fast.ops.divergence_teachers import (
    DenseTeacher,
    HeadTeacher,
    Teacher,
    TopKTeacher,
    acc_dtype,
    raw_logits,
)
from ludic_fast.ops.plan import workspace_allowance
from ludic_fast.ops.torch_head import HeadTransform, addmm_acc_, gemm_f32

KINDS = ("forward_kl", "reverse_kl", "jsd")
REDUCTIONS = ("mean", "sum", "none")
TAILS = ("renormalize", "bucket")


@dataclass(frozen=True)
class _Spec:
    kind: str
    beta: float
    transform: HeadTransform
    hard_weight: float
    rows: int
    backend: str = "torch"
    entropy: bool = False


def _chunk(spec: _Spec, zs: Tensor, teacher: Teacher, rows: slice, tgt: Tensor | None,
           want_grad: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(per-token loss, dloss/dz_s or None, entropy or None) of one chunk of final student logits `zs`
    (consumed: overwritten in place)."""
    ent = entropy(zs) if spec.entropy else None
    s = log_softmax_(zs)
    a = spec.hard_weight if tgt is not None else 0.0
    ce = p1 = temp = None
    if a > 0.0:  # CE on the untempered logits z T = T s + const: p1 = softmax(T s)
        if spec.transform.unit_temperature:
            ce = -s.gather(1, tgt[:, None]).squeeze(1)
        else:
            temp = spec.transform.inv_temperature[rows].reciprocal().to(s.dtype)
            p1 = log_softmax_(s * temp[:, None])
            ce = -p1.gather(1, tgt[:, None]).squeeze(1)
            p1.exp_()
    if isinstance(teacher, TopKTeacher) and teacher.bucket:
        loss, dz, ps = bucket_divergence(spec.kind, spec.beta, s, teacher.idx[rows], teacher.coarse(rows, s.dtype),
                                         want_grad)
    else:
        t = teacher.log_probs(rows, spec.transform, s.dtype)
        loss, dz, ps = dense_divergence(spec.kind, spec.beta, s, t, want_grad)
    loss = loss.clamp_(min=0.0)
    if ce is not None:
        loss = (1.0 - a) * loss + a * ce
        if dz is not None:  # d CE / d(z / T) = T (p1 - onehot(y)), the caller scales by 1/T
            c = torch.full_like(ce, a) if temp is None else temp * a
            dz.mul_(1.0 - a).addcmul_(ps if p1 is None else p1, c[:, None])
            dz.scatter_add_(1, tgt[:, None], -c[:, None])
    return loss, dz, ent


def _weights(valid: Tensor, reduction: str) -> Tensor:
    return valid / valid.sum().clamp(min=1.0) if reduction == "mean" else valid


def _triton_chunk(spec: _Spec, h_c: Tensor, Ws: Tensor, bs: Tensor | None, teacher: Teacher, rows: slice,
                  tgt: Tensor | None, token_w: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(per-token loss, d(raw) = token_w dloss/d(raw) or None, entropy or None) of one chunk: the Triton row
    kernel over the fp32 GEMM workspace of the student (overwritten with d(raw)) and the teacher's fp32 chunk."""
    from ludic_fast.kernels.divergence_rows import launch_divergence_rows

    n = h_c.shape[0]
    zs = gemm_f32(h_c, Ws.T.to(h_c.dtype)).contiguous()
    zt, bt, t_logits = teacher.kernel_input(rows)
    dev = zs.device
    t32 = torch.full((n,), -1, dtype=torch.int32, device=dev) if tgt is None else tgt.to(torch.int32).contiguous()
    w = torch.zeros(n, dtype=torch.float32, device=dev) if token_w is None else token_w.float().contiguous()
    inv_t = spec.transform.inv_temperature[rows].float().contiguous()
    loss = torch.empty(n, dtype=torch.float32, device=dev)
    ent = torch.empty(n, dtype=torch.float32, device=dev) if spec.entropy else None
    hard = spec.hard_weight if tgt is not None else 0.0
    launch_divergence_rows(zs, zt, None if bs is None else bs.float().contiguous(), bt, t32, w, inv_t, loss,
                           spec.beta, hard, KINDS.index(spec.kind), token_w is not None, t_logits,
                           spec.transform.logit_scale, spec.transform.softcap, ent)
    return loss, (zs if token_w is not None else None), ent


def _weighted_(d_raw: Tensor, w: Tensor) -> Tensor:
    """d_raw w per row; a row of weight 0 (an ignored token) is 0 even where its gradient is NaN (a
    +inf reverse KL, a bad per-token temperature)."""
    return d_raw.mul_(w.to(d_raw.dtype)[:, None]).masked_fill_((w == 0)[:, None], 0.0)


def _reduce(losses: Tensor, valid: Tensor, reduction: str) -> Tensor:
    losses = torch.where(valid > 0, losses, 0.0)  # an ignored token's loss may be +inf
    if reduction == "none":
        return losses
    return losses.sum() if reduction == "sum" else losses.sum() / valid.sum().clamp(min=1.0)


def _grad_buffers(hs: Tensor, Ws: Tensor, bs: Tensor | None, need: tuple[bool, ...], acc: torch.dtype):
    dev = hs.device
    return (torch.zeros(hs.shape, dtype=acc, device=dev) if need[0] else None,
            torch.zeros(Ws.shape, dtype=acc, device=dev) if need[1] else None,
            torch.zeros(bs.shape, dtype=acc, device=dev) if need[2] and bs is not None else None)


def _sweep(spec: _Spec, hs, Ws, bs, teacher: Teacher, tgt, token_w, grads) -> tuple[Tensor, Tensor | None]:
    """(per-token losses, per-token entropies or None) over all chunks; with `grads` = (dh, dW, db) (entries
    may be None) also dh += d(raw) W_s, dW += d(raw)^T h_s, db += Σ d(raw), for d(raw) = token_w dloss/d(raw)."""
    acc = acc_dtype(hs, Ws)
    n = hs.shape[0]
    losses = torch.zeros(n, dtype=acc, device=hs.device)
    ents = torch.zeros(n, dtype=acc, device=hs.device) if spec.entropy else None
    for r0 in range(0, n, spec.rows):
        rows = slice(r0, min(n, r0 + spec.rows))
        h_c = hs[rows]
        t_c = None if tgt is None else tgt[rows]
        if spec.backend == "triton" and acc == torch.float32:  # the kernel writes d(raw) = w dloss/dz_s / T
            loss, d_raw, ent = _triton_chunk(spec, h_c, Ws, bs, teacher, rows, t_c,
                                             None if grads is None else token_w[rows])
        else:
            zs = spec.transform.apply_(raw_logits(h_c, Ws, bs, acc), rows)
            factor = None if grads is None else spec.transform.chain_factor(zs, rows)
            loss, dz, ent = _chunk(spec, zs, teacher, rows, t_c, grads is not None)
            d_raw = None if dz is None else _weighted_(spec.transform.backprop_(dz, factor, rows), token_w[rows])
        losses[rows] = loss
        if ent is not None:
            ents[rows] = ent
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
    return losses, ents


class LinearDivergenceFunction(torch.autograd.Function):
    """Divergence (reduced or per token) and the student's entropy (or an empty tensor; no gradient), with
    gradients to the student's hidden, weight and bias."""

    @staticmethod
    def forward(ctx, hs, Ws, bs, tgt, valid, teacher: Teacher, spec: _Spec, reduction: str):  # type: ignore[override]
        need = ctx.needs_input_grad[:3]
        ctx.spec, ctx.reduction, ctx.teacher = spec, reduction, teacher
        ctx.dtypes = (hs.dtype, Ws.dtype, None if bs is None else bs.dtype)
        ctx.recompute = reduction == "none"
        if ctx.recompute or not any(need):
            losses, ents = _sweep(spec, hs, Ws, bs, teacher, tgt, None, None)
            ctx.save_for_backward(hs, Ws, bs, tgt, valid)
        else:  # the gradient of the reduced loss, formed now
            grads = _grad_buffers(hs, Ws, bs, need, acc_dtype(hs, Ws))
            losses, ents = _sweep(spec, hs, Ws, bs, teacher, tgt, _weights(valid, reduction), grads)
            ctx.save_for_backward(*grads)
        ctx.used = False
        ents = losses.new_zeros(0) if ents is None else torch.where(valid > 0, ents, 0.0)
        ctx.mark_non_differentiable(ents)
        return _reduce(losses, valid, reduction), ents

    @staticmethod
    def backward(ctx, g, _g_entropy):  # type: ignore[override]
        if ctx.recompute:
            hs, Ws, bs, tgt, valid = ctx.saved_tensors
            grads = _grad_buffers(hs, Ws, bs, ctx.needs_input_grad[:3], acc_dtype(hs, Ws))
            _sweep(ctx.spec, hs, Ws, bs, ctx.teacher, tgt, g * valid, grads)
        else:
            if ctx.used:
                raise RuntimeError("linear_divergence scales its stored gradients in place; backward it only once")
            ctx.used = True
            grads = tuple(None if t is None else t.mul_(g.to(t.dtype)) for t in ctx.saved_tensors)
        (dh, dW, db), (h_dt, w_dt, b_dt) = grads, ctx.dtypes
        return (None if dh is None else dh.to(h_dt), None if dW is None else dW.to(w_dt),
                None if db is None else db.to(b_dt), None, None, None, None, None)


def _check_head(name: str, h: Tensor, W: Tensor, b: Tensor | None) -> None:
    if not isinstance(h, Tensor) or not h.dtype.is_floating_point or h.ndim < 1:
        raise TypeError(f"h_{name} must be a floating-point tensor [..., D], got {getattr(h, 'dtype', type(h))}")
    if not isinstance(W, Tensor) or W.ndim != 2 or not W.dtype.is_floating_point:
        raise TypeError(f"W_{name} must be a floating-point tensor [V, D]")
    if W.shape[1] != h.shape[-1] or W.shape[0] == 0 or W.shape[1] == 0:
        raise ValueError(f"W_{name} {tuple(W.shape)} must be [V, D] with V, D > 0 and D = h_{name}.shape[-1] "
                         f"({h.shape[-1]})")
    if b is not None and (not isinstance(b, Tensor) or tuple(b.shape) != (W.shape[0],)):
        raise ValueError(f"b_{name} must be a tensor of shape [{W.shape[0]}], got {getattr(b, 'shape', type(b))}")


def _check_number(name: str, x: object, low_open: float | None = None) -> float:
    """x as a float; TypeError for a non-number (bool included), ValueError when not finite or <= low_open."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(x).__name__}")
    if not math.isfinite(x) or (low_open is not None and not x > low_open):
        bound = "" if low_open is None else f" and > {low_open:g}"
        raise ValueError(f"{name} must be finite{bound}, got {x}")
    return float(x)


def _temperature(temperature: float | Tensor, lead: torch.Size, device: torch.device) -> float | Tensor:
    """A checked float, or a float64 tensor of the token shape with NaN where an entry is not finite and > 0
    (so that token's loss is NaN: no device synchronisation here)."""
    if not isinstance(temperature, Tensor):
        return _check_number("temperature", temperature, 0.0)
    if not temperature.dtype.is_floating_point:
        raise TypeError(f"temperature must be a float or a floating-point tensor, got {temperature.dtype}")
    if tuple(temperature.shape) not in ((), tuple(lead)):
        raise ValueError(f"temperature tensor must be 0-d or have the token shape {tuple(lead)}, "
                         f"got {tuple(temperature.shape)}")
    if temperature.requires_grad:
        raise ValueError("temperature must not require grad: linear_divergence gives it no gradient (detach it)")
    t = temperature.to(device=device, dtype=torch.float64).expand(lead).reshape(-1)
    return torch.where(torch.isfinite(t) & (t > 0), t, math.nan)


def _targets(targets: Tensor, lead: torch.Size, V: int, ignore_index: int) -> tuple[Tensor, Tensor]:
    """(targets as int64 with ignored entries 0, valid mask as bool), flat."""
    if not isinstance(targets, Tensor) or targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise TypeError(f"targets must be an integer tensor, got {getattr(targets, 'dtype', type(targets))}")
    if targets.shape != lead:
        raise ValueError(f"targets must have the token shape {tuple(lead)}, got {tuple(targets.shape)}")
    t1 = targets.reshape(-1)
    valid = t1 != ignore_index
    if bool(((t1 < 0) | (t1 >= V))[valid].any()):
        raise ValueError(f"targets must lie in [0, {V}) or equal ignore_index ({ignore_index})")
    return torch.where(valid, t1, torch.zeros_like(t1)).long(), valid


def _teacher(h_teacher, W_teacher, b_teacher, teacher_probs, teacher_topk, teacher_tail, lead, V,
             temperature) -> Teacher:
    """The one teacher the call names (module docstring of `divergence_teachers`), checked."""
    given = [n for n, x in (("h_teacher/W_teacher", W_teacher if W_teacher is not None else h_teacher),
                            ("teacher_probs", teacher_probs), ("teacher_topk", teacher_topk)) if x is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one teacher (h_teacher and W_teacher, teacher_probs or teacher_topk), got "
                         f"{given or 'none'}")
    if teacher_tail is not None and teacher_topk is None:
        raise ValueError("teacher_tail applies to teacher_topk only")
    if b_teacher is not None and W_teacher is None:
        raise ValueError("b_teacher belongs to a teacher head (h_teacher, W_teacher)")
    if teacher_probs is not None:
        if not isinstance(teacher_probs, Tensor) or not teacher_probs.dtype.is_floating_point:
            raise TypeError("teacher_probs must be a floating-point tensor [..., V]")
        if teacher_probs.shape[:-1] != lead or teacher_probs.shape[-1] < V:
            raise ValueError(f"teacher_probs must have shape [{', '.join(map(str, lead))}, V'] with V' >= {V}, got "
                             f"{tuple(teacher_probs.shape)}")
        return DenseTeacher(teacher_probs.detach().reshape(-1, teacher_probs.shape[-1]), V)
    if teacher_topk is not None:
        return _topk_teacher(teacher_topk, teacher_tail or "renormalize", lead, V, temperature)
    _check_head("teacher", h_teacher, W_teacher, b_teacher)
    if h_teacher.shape[:-1] != lead:
        raise ValueError(f"h_teacher {tuple(h_teacher.shape)} and h_student must share their leading (token) shape "
                         f"{tuple(lead)}")
    if W_teacher.shape[0] < V:
        raise ValueError(f"W_teacher has {W_teacher.shape[0]} vocabulary rows, fewer than W_student's {V}")
    return HeadTeacher(h_teacher.detach().reshape(-1, h_teacher.shape[-1]), W_teacher.detach()[:V],
                       None if b_teacher is None else b_teacher.detach()[:V])


def _topk_teacher(teacher_topk, tail: str, lead: torch.Size, V: int, temperature) -> TopKTeacher:
    if tail not in TAILS:
        raise ValueError(f"teacher_tail must be one of {TAILS}, got {tail!r}")
    if not isinstance(teacher_topk, (tuple, list)) or len(teacher_topk) != 2:
        raise TypeError("teacher_topk must be a pair (indices [..., k], log-probs [..., k])")
    idx, lp = teacher_topk
    if not isinstance(idx, Tensor) or idx.dtype.is_floating_point or idx.dtype == torch.bool:
        raise TypeError(f"teacher_topk indices must be an integer tensor, got {getattr(idx, 'dtype', type(idx))}")
    if not isinstance(lp, Tensor) or not lp.dtype.is_floating_point:
        raise TypeError("teacher_topk log-probs must be a floating-point tensor")
    if idx.shape != lp.shape or idx.shape[:-1] != lead or not 1 <= idx.shape[-1] <= V:
        raise ValueError(f"teacher_topk indices {tuple(idx.shape)} and log-probs {tuple(lp.shape)} must both have "
                         f"shape [{', '.join(map(str, lead))}, k] with 1 <= k <= {V}")
    if tail == "bucket" and not (isinstance(temperature, float) and temperature == 1.0):
        raise ValueError("teacher_tail='bucket' needs temperature 1: the teacher's tempered tail mass is unknown")
    idx = idx.reshape(-1, idx.shape[-1]).long()
    if bool(((idx < 0) | (idx >= V)).any()):
        raise ValueError(f"teacher_topk indices must lie in [0, {V})")
    ordered = idx.sort(1).values
    if bool((ordered[:, 1:] == ordered[:, :-1]).any()):
        raise ValueError("teacher_topk indices must be distinct within each token")
    return TopKTeacher(idx, lp.detach().reshape(-1, lp.shape[-1]), V, tail == "bucket")


def _kernel_gap(teacher: Teacher) -> str | None:
    """What the Triton row kernel cannot do in this call, or None."""
    return "teacher_tail='bucket'" if isinstance(teacher, TopKTeacher) and teacher.bucket else None


@autocast_as_matmul("h_student", "W_student", "h_teacher", "W_teacher", "b_student", "b_teacher")  # ludic_fast.ops
def linear_divergence(
    h_student: Tensor,
    W_student: Tensor,
    h_teacher: Tensor | None = None,
    W_teacher: Tensor | None = None,
    targets: Tensor | None = None,
    *,
    teacher_probs: Tensor | None = None,
    teacher_topk: tuple[Tensor, Tensor] | None = None,
    teacher_tail: str | None = None,
    kind: str = "forward_kl",
    beta: float = 0.5,
    temperature: float | Tensor = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    hard_weight: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    b_student: Tensor | None = None,
    b_teacher: Tensor | None = None,
    return_entropy: bool = False,
    memory_budget: int | str | None = None,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """Divergence between student and teacher next-token distributions (module docstring), fused with the
    student's LM head: `h_student [..., D_s]`, `W_student [V, D_s]`, and one teacher:
    - a teacher head `h_teacher [..., D_t]`, `W_teacher [V', D_t]` (V' >= V: rows past V are dropped, the
      teacher renormalised over the student's vocabulary), optional `b_teacher [V']`;
    - `teacher_probs [..., V']`: dense probabilities (columns past V dropped; rows renormalised);
    - `teacher_topk = (indices, log_probs)`, both [..., k]: a served teacher's top-k; `teacher_tail`
      'renormalize' (default: the teacher conditioned on its top k, zero mass elsewhere, so reverse KL is
      +inf wherever the student has mass off the top k) or 'bucket' (both distributions coarsened to the k
      tokens plus one outcome for the rest, the teacher's of mass 1 - Σ e^{log_probs}; temperature 1 only).
    Both logits are z = softcap(logit_scale (h W^T + b)) / T (a distribution teacher: log p / T), with
    `temperature` a float or a tensor of the token shape (per token; an entry that is not finite and > 0
    makes that token's loss NaN). Optional `targets [...]` (ignore_index marks tokens that count for
    nothing; with `hard_weight` α the loss is (1 - α) D + α CE). `kind` forward_kl | reverse_kl | jsd
    (β = `beta` in (0, 1)). `memory_budget`: bytes (int, or a string like '2GiB') of transient chunk buffers
    (default `plan.workspace_allowance` of the device: 1 GiB on the CPU and on an 80 GB GPU). Returns a 0-d
    tensor ('mean', 'sum') or per-token losses of the leading shape ('none'), float64 when h_student or
    W_student is float64, else float32; differentiable w.r.t. the student's hidden, weight and bias.
    `return_entropy`: also the student's per-token entropy
    -Σ p_s log p_s at temperature T (0 at ignored tokens; a statistic without gradient), as (loss, entropy).
    `backend` 'auto' (triton on CUDA where the kernel covers the call, else torch), 'torch' or 'triton'
    (CUDA, or CPU under TRITON_INTERPRET=1; float64 inputs run the torch path; refuses what the kernel lacks)."""
    from ludic_fast.ops import resolve_backend

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    beta = _check_number("beta", beta)
    if kind == "jsd" and not 0.0 < beta < 1.0:
        raise ValueError(f"beta must lie in (0, 1) for kind='jsd' (its ends are forward_kl / reverse_kl), got {beta}")
    hard_weight = _check_number("hard_weight", hard_weight)
    if not 0.0 <= hard_weight <= 1.0:
        raise ValueError(f"hard_weight must lie in [0, 1], got {hard_weight}")
    if hard_weight > 0 and targets is None:
        raise ValueError("hard_weight > 0 needs targets")
    logit_scale = _check_number("logit_scale", logit_scale, 0.0)
    if softcap is not None:
        softcap = _check_number("softcap", softcap, 0.0)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if not isinstance(return_entropy, bool):
        raise TypeError(f"return_entropy must be a bool, got {type(return_entropy).__name__}")
    _check_head("student", h_student, W_student, b_student)
    V = W_student.shape[0]
    lead = h_student.shape[:-1]
    temperature = _temperature(temperature, lead, h_student.device)
    teacher = _teacher(h_teacher, W_teacher, b_teacher, teacher_probs, teacher_topk, teacher_tail, lead, V,
                       temperature)
    hs = h_student.reshape(-1, h_student.shape[-1])
    acc = acc_dtype(h_student, W_student)
    if targets is not None:
        tgt, valid = _targets(targets, lead, V, ignore_index)
        valid = valid.to(acc)
    else:
        tgt, valid = None, torch.ones(hs.shape[0], dtype=acc, device=hs.device)
    buffers = 4 + (softcap is not None) + 2 * return_entropy
    row_bytes = buffers * V * torch.empty((), dtype=acc).element_size()
    budget = parse_memory_budget(memory_budget) or workspace_allowance(h_student.device)
    transform = HeadTransform.build(logit_scale, softcap, temperature, hs.shape[0], hs.device)
    spec = _Spec(kind, beta, transform, hard_weight, max(1, budget // row_bytes), "torch", return_entropy)
    resolved = resolve_backend(backend, h_student.device)
    if resolved == "triton":
        gap = _kernel_gap(teacher)
        if gap is not None and backend == "triton":
            raise ValueError(f"backend='triton': the divergence kernel does not support {gap} yet; use "
                             "backend='torch' (or 'auto', which does)")
        spec = _Spec(kind, beta, transform, hard_weight, spec.rows, "torch" if gap else "triton", return_entropy)
    apply = _apply_outside_compile if spec.backend == "triton" else LinearDivergenceFunction.apply  # ludic_fast.ops
    loss, ents = apply(hs, W_student, b_student, tgt, valid, teacher, spec, reduction)
    loss = loss.reshape(lead) if reduction == "none" else loss
    return (loss, ents.reshape(lead)) if return_entropy else loss


_apply_outside_compile = torch.compiler.disable(LinearDivergenceFunction.apply)


__all__ = ["linear_divergence", "LinearDivergenceFunction", "KINDS", "TAILS"]
