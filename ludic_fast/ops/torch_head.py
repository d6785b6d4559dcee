"""The `torch` backend of the head: chunked matmuls with online statistics, any device.

Rows (tokens) are processed in chunks of `n` tokens, vocabulary columns in slices of `v` columns, with
`n * v` bounded by a memory budget, so no `[N, V]` tensor is ever allocated. Per chunk:

    z = softcap(logit_scale * (h W^T + b)) / T          (float32)
    online over slices:  m = max z,  s = 1 + tail,  tail = sum_{j != argmax} e^{z_j-m},  t = sum e^{z-m} (z-m)
                         (when m moves to m': tail <- (1 + tail) e^{m-m'} (the old maximum joins the tail),
                          t <- (t + s (m-m')) e^{m-m'})
    log s = log1p(tail),  lse = m + log s,  H = log s - t / s,  logprob = z_y - lse,  elp = (m - lse) + t / s

Every sum is relative to the running maximum and the maximum's own e^0 = 1 is kept out of the tail, so the
entropy of a confident token (H << 1, tail << 1, next to logits of size |m|) carries a relative error, not
one rounding step of m (as `lse - E_p z` would) nor of 1 (as log(1 + tail) in fp32 would). `elp` is E_p log p
taken against the stored (rounded) lse, so that log p_j - elp = z_j - E_p z exactly for that lse. Logits of -inf
(a bias of -inf: masked vocabulary) have p = 0 and add 0 to every sum and gradient (relative logits are
floored at REL_LOGIT_FLOOR, below which e^x is 0 in fp32 and fp64).

Backward for per-token upstream gradients (g_lp, g_H), log p = z - lse:

    dz_j = g_lp (1[j=y] - p_j) - g_H p_j (log p_j - elp)
    d(raw)_j = dz_j / T * (1 - tanh^2) * logit_scale,   dh = d(raw) W,  dW = d(raw)^T h,  db = sum d(raw)

The chunk sizes come from `ludic_fast.ops.plan` (on the CPU: the element rule of `ludic_fast.ops.budget`,
chunks of DEFAULT_CHUNK_ELEMENTS logit elements). The chunk kernels here are also the building blocks of the
fused-loss mode (`ludic_fast.ops.fused_loss`), which forms d(raw) in the forward pass. On CUDA with bf16/fp16 inputs the
logits GEMM has an fp32 output (no rounding of the logits to the input dtype) and the gradient GEMMs take
d(raw) rounded to the input dtype with fp32 accumulation: the precision of the triton backend. On the CPU, bf16
logits are multiplied (and rounded) in bf16, fp16 ones in fp32 (fp16's range ends at 65504).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from ludic_fast._common import per_token_temperature
from ludic_fast.ops.budget import chunk_plan
from ludic_fast.ops.plan import plan_head

#: relative logits (z - max z, z - lse) are clamped here: e^x is exactly 0 below it in fp32 and fp64, so the
#: clamp changes no probability and makes 0 * (-inf) = 0 for logits of -inf
REL_LOGIT_FLOOR = -2048.0


@dataclass(frozen=True)
class HeadTransform:
    """The map from raw logits `h W^T + b` to final logits: scale, softcap, per-token 1/T."""

    logit_scale: float
    softcap: float | None
    inv_temperature: Tensor  # [N] float64 (cast to the chunk dtype on use)
    unit_temperature: bool = False  # T == 1 for every token: skip the 1/T passes over each chunk

    @classmethod
    def build(
        cls, logit_scale: float, softcap: float | None, temperature: float | Tensor, n_tokens: int, device
    ) -> HeadTransform:
        """The transform of `softcap(logit_scale * raw) / T` for `n_tokens` rows (T scalar or per token)."""
        inv_t = per_token_temperature(temperature, n_tokens, device).reciprocal()
        unit = not isinstance(temperature, Tensor) and float(temperature) == 1.0
        return cls(float(logit_scale), None if softcap is None else float(softcap), inv_t, unit)

    def apply_(self, z: Tensor, rows: slice) -> Tensor:
        """raw logits chunk (float32, rows `rows`) -> final logits, in place."""
        if self.logit_scale != 1.0:
            z.mul_(self.logit_scale)
        if self.softcap is not None:
            z.div_(self.softcap).tanh_().mul_(self.softcap)
        return z if self.unit_temperature else z.mul_(self.inv_temperature[rows, None].to(z.dtype))

    def chain_factor(self, z: Tensor, rows: slice) -> Tensor | None:
        """d(final)/d(raw) for the chunk as a tensor, or None when it is the per-row 1/T alone."""
        if self.softcap is None:
            return None
        tanh = z / (self.inv_temperature[rows, None].to(z.dtype) * self.softcap)
        return tanh.square_().neg_().add_(1.0)

    def backprop_(self, dz: Tensor, factor: Tensor | None, rows: slice) -> Tensor:
        """dL/dz (final) -> dL/d(raw), in place."""
        if not self.unit_temperature:
            dz.mul_(self.inv_temperature[rows, None].to(dz.dtype))
        if factor is not None:
            dz.mul_(factor)
        if self.logit_scale != 1.0:
            dz.mul_(self.logit_scale)
        return dz


def torch_blocks(
    h2: Tensor, weight: Tensor, bias: Tensor | None, chunk_elements: int | None, memory_budget: int | str | None
) -> tuple[int, int]:
    """(token rows, vocab columns) of one chunk of the torch backend's generic mode, from `plan.plan_head`."""
    grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (h2, weight, bias))
    return plan_head(
        h2.shape[0], h2.shape[1], weight.shape[0], dtype=torch.promote_types(h2.dtype, weight.dtype),
        mode="generic" if grad else "forward", device=h2.device, backend="torch", memory_budget=memory_budget,
        chunk_elements=chunk_elements,
    ).blocks


class RowSums(NamedTuple):
    """Per-row online sums of the final logits relative to the row maximum m (module docstring)."""

    m: Tensor  # max_j z_j (-inf for a row without a finite logit)
    tail: Tensor  # sum_{j != argmax} e^{z_j - m}
    t: Tensor  # sum_j e^{z_j - m} (z_j - m); zeros without entropy
    zy: Tensor  # the target's logit (0 where the target is not in these columns)


class RowStats(NamedTuple):
    """Per-row statistics of the final logits (float32, or float64 for float64 inputs); see the module
    docstring. `elp` and `entropy` are zeros when entropy was not asked for."""

    lse: Tensor  # log sum_j e^{z_j}
    elp: Tensor  # E_p z - lse for this (rounded) lse: E_p log p
    zy: Tensor  # the target's logit z_y
    entropy: Tensor  # H = log s - t / s, computed relative to the row maximum


def finite_or_zero(m: Tensor) -> Tensor:
    """The row maxima as shifts: -inf (a row with no finite logit yet) becomes 0, so z - shift stays -inf."""
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def stats_from_sums(
    m: Tensor, tail: Tensor, t: Tensor, zy: Tensor, with_entropy: bool, top: Tensor | None = None
) -> RowStats:
    """`RowStats` from per-row sums relative to the row maximum m: `top` logits (default 1) equal to m count
    e^0 = 1 each, `tail` = sum e^{z-m} over the others, t = sum e^{z-m} (z-m); s = top + tail and
    log s = log(top) + log1p(tail / top) (a small tail keeps its precision)."""
    log_s = torch.log1p(tail) if top is None else torch.log(top) + torch.log1p(tail / top)
    lse = m + log_s
    if not with_entropy:
        zeros = torch.zeros_like(lse)
        return RowStats(lse, zeros, zy, zeros)
    e_rel = t / ((1.0 if top is None else top) + tail)  # E_p (z - m) <= 0
    return RowStats(lse, (m - lse) + e_rel, zy, log_s - e_rel)


class ChunkedHead:
    """Shared state of one head call: flattened inputs, transform, chunk blocks.

    `chunks`: (token rows, vocab columns) of one chunk (a `HeadPlan.blocks`), or a bound on the logit
    elements of one chunk (None: `budget.default_chunk_elements()`) for `budget.chunk_plan`."""

    def __init__(
        self,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        transform: HeadTransform,
        chunks: tuple[int, int] | int | None,
        ignore_index: int,
    ):
        self.compute_dtype = torch.promote_types(hidden.dtype, weight.dtype)
        # statistics and accumulators: float32, or float64 when an input is float64 (finite differences)
        self.acc = torch.float64 if self.compute_dtype == torch.float64 else torch.float32
        self.hidden = hidden
        self.weight = weight
        self.bias = None if bias is None else bias.to(self.acc)
        self.may_mask = bias is not None  # a bias of -inf masks columns: relative logits get floored
        self.transform = transform
        self.valid = targets != ignore_index
        self.targets = torch.where(self.valid, targets, torch.zeros_like(targets)).long()
        self.N, self.V = hidden.shape[0], weight.shape[0]
        if isinstance(chunks, tuple):
            self.n_chunk, self.v_chunk = max(1, min(chunks[0], self.N)), max(1, min(chunks[1], self.V))
        else:
            self.n_chunk, self.v_chunk = chunk_plan(self.N, self.V, chunks)

    def row_chunks(self):
        for r0 in range(0, self.N, self.n_chunk):
            yield slice(r0, min(r0 + self.n_chunk, self.N))

    def col_slices(self):
        for c0 in range(0, self.V, self.v_chunk):
            yield slice(c0, min(c0 + self.v_chunk, self.V))

    def h_rows(self, rows: slice) -> Tensor:
        return self.hidden[rows].to(self.compute_dtype)

    def logits(self, h_c: Tensor, rows: slice, cols: slice) -> Tensor:
        """Final float32 logits of a (rows x cols) chunk."""
        w = self.weight[cols].to(self.compute_dtype)
        lowp_cuda = h_c.is_cuda and h_c.dtype in (torch.float16, torch.bfloat16)
        # CUDA: fp32 logits, no rounding; fp16 elsewhere: an fp32 GEMM (fp16 logits overflow above 65504)
        z = gemm_f32(h_c, w.T) if lowp_cuda or h_c.dtype == torch.float16 else (h_c @ w.T).to(self.acc)
        if self.bias is not None:
            z.add_(self.bias[cols])
        return self.transform.apply_(z, rows)

    def target_in(self, rows: slice, cols: slice) -> tuple[Tensor, Tensor]:
        """(target column relative to `cols`, clamped into it; mask of rows whose target lies in `cols`)."""
        tgt = self.targets[rows]
        here = (tgt >= cols.start) & (tgt < cols.stop)
        return (tgt - cols.start).clamp_(0, cols.stop - cols.start - 1), here

    def floor_(self, rel: Tensor) -> Tensor:
        """Relative logits (<= 0) clamped at REL_LOGIT_FLOOR in place when -inf logits are possible."""
        return rel.clamp_(min=REL_LOGIT_FLOOR) if self.may_mask else rel

    def stats(self, h_c: Tensor, rows: slice, with_entropy: bool) -> RowStats:
        """`RowStats` of a row chunk (from `sums`)."""
        return stats_from_sums(*self.sums(h_c, rows, with_entropy), with_entropy)

    def sums(self, h_c: Tensor, rows: slice, with_entropy: bool) -> RowSums:
        """`RowSums` of a row chunk, online over vocab slices with sums relative to the running maximum."""
        n = rows.stop - rows.start
        dev = h_c.device
        m = torch.full((n,), float("-inf"), device=dev, dtype=self.acc)
        tail, t, zy = (torch.zeros(n, device=dev, dtype=self.acc) for _ in range(3))
        for cols in self.col_slices():
            z = self.logits(h_c, rows, cols)
            local, here = self.target_in(rows, cols)
            zy = torch.where(here, z.gather(1, local[:, None]).squeeze(1), zy)
            tile_max, arg = z.max(1)
            new = tile_max > m  # the row maximum moves into this slice, to its column `arg`
            m_new = torch.where(new, tile_max, m)
            shift = finite_or_zero(m_new)
            rel = self.floor_(z.sub_(shift[:, None]))
            e = rel.exp()
            e.scatter_(1, arg[:, None], torch.where(new, 0.0, e.gather(1, arg[:, None]).squeeze(1))[:, None])
            keep = torch.exp(m - shift)
            if with_entropy:
                moved = torch.where(torch.isneginf(m), 0.0, (1.0 + tail) * (m - shift))
                t = (t + moved) * keep + torch.linalg.vecdot(e, rel)
            tail = torch.where(new, 1.0 + tail, tail) * keep + e.sum(1)
            m = m_new
        return RowSums(m, tail, t, zy)

    def grad_raw_(
        self, z: Tensor, rows: slice, cols: slice, lse: Tensor, elp: Tensor, g_lp: Tensor, g_H: Tensor | None
    ) -> Tensor:
        """Overwrite the final-logits chunk `z` with dL/d(raw logits) for upstream (g_lp, g_H)."""
        factor = self.transform.chain_factor(z, rows)
        tgt_local, here = self.target_in(rows, cols)
        log_p = self.floor_(z.sub_(lse[:, None]))
        if g_H is None:
            dz = log_p.exp_().mul_(-g_lp[:, None])
        else:
            p = log_p.exp()
            dz = log_p.sub_(elp[:, None]).mul_(-g_H[:, None]).sub_(g_lp[:, None]).mul_(p)
        dz.scatter_add_(1, tgt_local[:, None], (g_lp * here)[:, None])
        return self.transform.backprop_(dz, factor, rows)

    def accumulate_(
        self,
        d_raw: Tensor,
        h_c: Tensor,
        rows: slice,
        cols: slice,
        dh: Tensor,
        dW: Tensor | None,
        db: Tensor | None,
    ) -> None:
        """dh[rows] += d_raw W[cols];  dW[cols] += d_raw^T h;  db[cols] += sum_rows d_raw (fp32 buffers).
        bf16/fp16 CUDA inputs: d_raw enters the GEMMs in the input dtype (tensor cores, fp32 accumulation)."""
        if db is not None:
            db[cols].add_(d_raw.sum(0))
        d_op = d_raw.to(h_c.dtype) if _lowp_cuda(h_c) else d_raw
        addmm_acc_(dh[rows], d_op, self.weight[cols].to(self.compute_dtype))
        if dW is not None:
            addmm_acc_(dW[cols], d_op.T, h_c)


#: torch.mm / torch.addmm with out_dtype=float32 on CUDA bf16/fp16 operands exist from torch 2.8
_LOWP_GEMM_F32_OUT = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 8)


def _lowp_cuda(a: Tensor) -> bool:
    return a.is_cuda and a.dtype in (torch.float16, torch.bfloat16) and _LOWP_GEMM_F32_OUT


def gemm_f32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b with an fp32 result: bf16/fp16 CUDA operands stay low precision (tensor cores, fp32 output),
    anything else is upcast to fp32."""
    if _lowp_cuda(a):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def addmm_acc_(acc: Tensor, a: Tensor, b: Tensor, beta: float = 1.0) -> None:
    """acc = beta acc + a @ b in place (acc fp32 or fp64), without an [acc]-sized temporary; beta = 0 ignores
    acc's contents (an uninitialised buffer needs no zero-fill). Goes through the out= form of addmm, which
    FLOP counters see (they miss `addmm_`); bf16/fp16 CUDA operands stay low precision."""
    if _lowp_cuda(a) and acc.dtype == torch.float32 and torch.compiler.is_compiling():
        # FakeTensor rejects addmm's out_dtype overload before torch 2.12 (pytorch#163880): an mm, then the update
        prod = torch.mm(a, b, out_dtype=torch.float32)
        if beta == 0:
            acc.copy_(prod)
        else:
            acc.mul_(beta).add_(prod)
    elif _lowp_cuda(a) and acc.dtype == torch.float32:
        torch.addmm(acc, a, b, beta=beta, out_dtype=torch.float32, out=acc)
    else:
        torch.addmm(acc, a.to(acc.dtype), b.to(acc.dtype), beta=beta, out=acc)


class LinearLogprobsFunction(torch.autograd.Function):
    """Generic mode: forward saves (lse, elp); backward recomputes logits chunk by chunk (8NDV total).
    `head_args = (transform, chunks, ignore_index)`, `chunks` as `ChunkedHead` takes it."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, head_args, with_entropy, merge_sums=None):  # type: ignore[override]
        """`merge_sums(RowSums) -> RowStats` combines the sums of a vocabulary shard into the statistics of the
        whole vocabulary (vocab-parallel); None for an unsharded weight."""
        transform, chunks, ignore_index = head_args
        head = ChunkedHead(hidden, weight, bias, targets, transform, chunks, ignore_index)
        parts = [head.sums(head.h_rows(rows), rows, with_entropy) for rows in head.row_chunks()]
        empty = torch.empty(0, device=hidden.device, dtype=head.acc)
        sums = RowSums(*(torch.cat(x) for x in zip(*parts))) if parts else RowSums(*[empty] * 4)
        stats = stats_from_sums(*sums, with_entropy) if merge_sums is None else merge_sums(sums)
        lse, elp = stats.lse, stats.elp
        zero = torch.zeros_like(lse)
        logprobs = torch.where(head.valid, stats.zy - lse, zero)
        entropy = torch.where(head.valid, stats.entropy, zero) if with_entropy else zero
        ctx.save_for_backward(hidden, weight, bias, targets, lse, elp)
        ctx.head_args = head_args
        ctx.with_entropy = with_entropy
        ctx.mark_non_differentiable(lse)
        return logprobs, entropy, lse

    @staticmethod
    def backward(ctx, g_lp, g_H, _g_lse):  # type: ignore[override]
        hidden, weight, bias, targets, lse, elp = ctx.saved_tensors
        transform, chunks, ignore_index = ctx.head_args
        head = ChunkedHead(hidden, weight, bias, targets, transform, chunks, ignore_index)
        valid = head.valid.to(head.acc)
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.to(head.acc) * valid
        g_H = None if (g_H is None or not ctx.with_entropy) else g_H.to(head.acc) * valid
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        acc = {"device": hidden.device, "dtype": head.acc}
        dh = torch.zeros(head.N, hidden.shape[1], **acc)
        dW = torch.zeros(weight.shape, **acc) if need_w else None
        db = torch.zeros(head.V, **acc) if (need_b and bias is not None) else None
        for rows in head.row_chunks():
            h_c = head.h_rows(rows)
            for cols in head.col_slices():
                z = head.logits(h_c, rows, cols)
                d_raw = head.grad_raw_(
                    z, rows, cols, lse[rows], elp[rows], g_lp[rows], None if g_H is None else g_H[rows]
                )
                head.accumulate_(d_raw, h_c, rows, cols, dh, dW, db)
        return (
            dh.to(hidden.dtype) if need_h else None,
            dW.to(weight.dtype) if dW is not None else None,
            db.to(bias.dtype) if db is not None else None,
            None,
            None,
            None,
            None,
        )
