"""Fused-loss mode of the head: the loss gradient is formed in the forward pass (cost model in docs/kernels.md).

A loss is a differentiable scalar function `objective(lp, H, sel)` of the per-token log-probs lp [n] and
entropies H [n] of the head rows (`sel`: a slice of the rows, or None for all of them). For upstream
per-token gradients g_lp = dL/dlp, g_H = dL/dH the head's logit gradient is

    dz_j = g_lp (1[j=y] - p_j) - g_H p_j (z_j - E_p z),    then the chain rule through 1/T, softcap, scale.

Token-local losses (g at token t depends only on lp_t, H_t and constants): one pass over token chunks.
Per chunk: logits z = h W^T once (2 n D V), lse / E_p z / z_y from z, (g_lp, g_H) by autograd of the
objective on the chunk's O(n) vectors, z overwritten by d(raw) in place, then dh += d(raw) W and
dW += d(raw)^T h (4 n D V). Forward + backward = 6NDV; backward only scales dh, dW, db by grad_output (the
triton backend with one token chunk whose d(raw) buffer is no larger than dW instead keeps d(raw) and forms
dW = d(raw)^T (grad_output h) in the backward: no pass over the [V, D] gradient beyond the GEMM that writes it).

Sequence-coupled losses (g at t depends on other tokens: sequence ratios, per-response max entropy,
batch quantiles): pass 1 computes lp and H of all tokens without gradients (2NDV), the objective's
gradient on the whole O(N) vectors gives every (g_lp, g_H), then the same chunk loop forms the head
gradients (6NDV): 8NDV in all; when one chunk holds every row, the second pass takes the first pass's chunk
with its logits (6NDV in all). When fewer than 16 whole vocabulary rows fit in the chunk budget the
vocabulary is sliced and the token-local path needs a statistics sweep first (8NDV as well).
A coupled loss whose tokens couple only within groups (`FusedPlan.groups`: a preference pair, a sequence)
runs the token-local single pass on row chunks made of whole groups when every group fits a chunk (6NDV); on
the CPU without a caller's budget such a chunk may grow to GROUP_CHUNK_GROWTH default chunks to fit a group.

No path allocates [N, V]: chunk rows (and vocabulary slices) come from `ludic_fast.ops.plan.plan_head` under
`memory_budget` bytes (or the `chunk_elements` override): large token chunks amortise the fp32 dW
read-modify-write that every chunk costs.

Backends: 'torch' (any device: chunk GEMM, then an in-place epilogue with one exp per logit) and 'triton'
with the plan's strategy (env LUDIC_FAST_TRITON_STRATEGY forces one): 'workspace' (GEMM into an fp32
workspace, the Triton row kernel for statistics and d(raw), GEMMs for dh, dW) or 'fused' (tl.dot statistics
with no logits in memory, then the tl.dot gradient kernel recomputes the logits into a d(raw) buffer of the
input dtype: 8NDV with 6 bytes per logit element). A sliced vocabulary always runs the torch chunk code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ludic_fast._common import autocast_as_matmul
from ludic_fast.ops.budget import env_chunk_elements
from ludic_fast.ops.plan import HeadPlan, plan_head, strategy_requested
from ludic_fast.ops.torch_head import ChunkedHead, HeadTransform, RowStats, finite_or_zero, stats_from_sums

#: objective(lp, H or None, rows or None) -> scalar loss; `rows` selects the chunk (None: all tokens). A forward
#: calls it on all tokens (rows None) exactly once, at the final (lp, H): its value is the loss.
Objective = Callable[[Tensor, Tensor | None, slice | None], Tensor]


@dataclass
class FusedPlan:
    """What the fused head needs besides tensors: the head transform, the loss and how it couples tokens."""

    transform: HeadTransform
    objective: Objective
    coupled: bool
    with_entropy: bool
    chunk_elements: int | None = None
    backend: str = "torch"  # 'torch' or 'triton' (CUDA, or CPU under TRITON_INTERPRET=1)
    # coupled losses whose tokens couple only within groups (e.g. a preference pair): the sorted token offsets
    # where each group starts. When every group fits one row chunk, chunks keep groups whole: one pass (6NDV).
    groups: list[int] | None = None
    # triton backend: token rows whose d(raw) is staged for one dW GEMM (None: the plan's; see _DwStage)
    dw_stage_rows: int | None = None
    memory_budget: int | str | None = None  # bytes (None: the device default of `plan.plan_head`)


class _RowEpilogue:
    """In-place epilogue on a chunk z [n, V] of final logits with whole vocabulary rows: one exp per logit.

    `stats()`: the `RowStats` of the rows (`torch_head`: sums relative to the row maximum m). By `mode`, z is
    left holding e = exp(z - m) ('exp': no entropy, no softcap), z - m ('relative': entropy, no softcap) or
    itself ('keep': a softcap, whose chain factor `ChunkedHead.grad_raw_` reads from z). Without a softcap
    `grad_()` then turns z into d(raw) = [g_lp (1[j=y] - p_j) - g_H p_j (log p_j - elp)] * row_scale,
    row_scale = logit_scale / T, in place. (Row blocks sized to stay in cache were slower here: on a loaded
    2-core machine the per-op overhead of thousands of small ops outweighs the saved memory traffic.)
    """

    def __init__(self, z: Tensor, targets: Tensor, mode: str, head: ChunkedHead):
        self.z, self.tgt, self.mode, self.head = z, targets[:, None], mode, head
        self.s: Tensor | None = None  # row sums of e while z holds e
        self.m: Tensor | None = None  # row maxima (as shifts) once `stats()` ran

    def stats(self) -> RowStats:
        z = self.z
        zy = z.gather(1, self.tgt).squeeze(1)
        m, arg = z.max(1)
        self.m = shift = finite_or_zero(m)
        if self.mode == "exp":
            self.s = s = z.sub_(shift[:, None]).exp_().sum(1)
            return stats_from_sums(m, s - 1.0, torch.zeros_like(s), zy, with_entropy=False)
        rel = self.head.floor_(z.sub_(shift[:, None]) if self.mode == "relative" else z.sub(shift[:, None]))
        e = rel.exp().scatter_(1, arg[:, None], 0.0)  # the tail: the maximum's own e^0 = 1 left out
        return stats_from_sums(m, e.sum(1), torch.linalg.vecdot(e, rel), zy, with_entropy=True)

    def grad_(self, lse: Tensor, elp: Tensor, g_lp: Tensor, g_H: Tensor | None, row_scale: Tensor) -> Tensor:
        z = self.z
        if self.s is not None:  # z holds e = p * s
            z.mul_((-g_lp * row_scale / self.s)[:, None])
        else:  # z holds z - m, or z itself when `stats()` did not run (the second pass of a coupled loss)
            log_p = self.head.floor_(z.sub_((lse if self.m is None else lse - self.m)[:, None]))
            if g_H is None:
                log_p.exp_().mul_((-g_lp * row_scale)[:, None])
            else:
                p = log_p.exp()
                log_p.sub_(elp[:, None]).mul_(-g_H[:, None]).sub_(g_lp[:, None]).mul_(p).mul_(row_scale[:, None])
        return z.scatter_add_(1, self.tgt, (g_lp * row_scale)[:, None])


class _TorchRows:
    """One token chunk on the torch backend, whole vocabulary rows: one GEMM, then `_RowEpilogue`."""

    def __init__(self, head: ChunkedHead, plan: FusedPlan, rows: slice):
        self.head, self.plan, self.rows, self.cols = head, plan, rows, slice(0, head.V)
        self.h_c = head.h_rows(rows)
        self.softcap = plan.transform.softcap is not None
        self.z = head.logits(self.h_c, rows, self.cols)
        mode = "keep" if self.softcap else "relative" if plan.with_entropy else "exp"
        self.epi = _RowEpilogue(self.z, head.targets[rows], mode, head)

    def stats(self) -> RowStats:
        return self.epi.stats()

    def backward_(self, lse, elp, g_lp, g_H, dh, dW, db) -> None:
        if self.softcap:  # the softcap chain factor needs the final logits: ChunkedHead's general form
            d_raw = self.head.grad_raw_(self.z, self.rows, self.cols, lse, elp, g_lp, g_H)
        else:
            t = self.plan.transform
            d_raw = self.epi.grad_(lse, elp, g_lp, g_H, t.inv_temperature[self.rows].to(lse.dtype) * t.logit_scale)
        self.head.accumulate_(d_raw, self.h_c, self.rows, self.cols, dh, dW, db)


class _TorchSlices:
    """One token chunk when fewer than 16 whole rows fit the budget: vocabulary slices, logits recomputed."""

    def __init__(self, head: ChunkedHead, plan: FusedPlan, rows: slice):
        self.head, self.plan, self.rows = head, plan, rows
        self.h_c = head.h_rows(rows)

    def stats(self) -> RowStats:
        return self.head.stats(self.h_c, self.rows, self.plan.with_entropy)

    def backward_(self, lse, elp, g_lp, g_H, dh, dW, db) -> None:
        for cols in self.head.col_slices():
            z = self.head.logits(self.h_c, self.rows, cols)
            d_raw = self.head.grad_raw_(z, self.rows, cols, lse, elp, g_lp, g_H)
            self.head.accumulate_(d_raw, self.h_c, self.rows, cols, dh, dW, db)


class _TritonRows:
    """One token chunk on the triton backend: a cuBLAS GEMM writes fp32 raw logits into the call's workspace
    `ws_buf` (beta = 0), the Triton row kernel (`triton_head.workspace_head_rows_`) forms statistics, then
    writes d(raw) in the GEMM operand dtype (over the workspace's own memory, or into `stage`'s buffer), and
    cuBLAS reads it for dh[rows] = d(raw) W (one contribution per row: written in the input dtype); `stage`
    forms dW."""

    def __init__(self, head: ChunkedHead, plan: FusedPlan, rows: slice, ws_buf: Tensor, stage: _DwStage):
        from ludic_fast.ops.triton_head import gemm_into

        self.head, self.plan, self.rows, self.stage = head, plan, rows, stage
        self.h_c = head.h_rows(rows)
        self.w = head.weight.to(head.compute_dtype)
        self.ws = ws_buf[: rows.stop - rows.start]
        gemm_into(self.ws, self.h_c, self.w.T, accumulate=False)
        t = plan.transform
        self.kw = {"bias": head.bias, "logit_scale": t.logit_scale, "softcap": t.softcap, "ignore_index": -100}
        self.tgt, self.inv_t = head.targets[rows], t.inv_temperature[rows]

    def stats(self) -> RowStats:
        from ludic_fast.ops.triton_head import workspace_head_rows_

        return RowStats(*workspace_head_rows_(self.ws, self.tgt, self.inv_t, entropy=self.plan.with_entropy,
                                              **self.kw))

    def backward_(self, lse, elp, g_lp, g_H, dh, dW, db) -> None:
        """dW is the stage's (the argument is the same buffer)."""
        from ludic_fast.ops.triton_head import gemm_into, operand_view, workspace_head_rows_

        d = self.stage.out(self.rows)
        d = operand_view(self.ws, self.h_c.dtype) if d is None else d
        workspace_head_rows_(self.ws, self.tgt, self.inv_t, entropy=g_H is not None, lse=lse, elp=elp, g_lp=g_lp,
                             g_H=g_H, out=d, **self.kw)
        if db is not None:
            db += d.sum(0, dtype=torch.float32)
        if dh is not None:
            gemm_into(dh[self.rows], d, self.w, accumulate=False)
        self.stage.add_(self.rows, d, self.h_c)


class _TritonDotRows:
    """One token chunk on the triton backend's fused strategy: statistics by the tl.dot forward kernel (no
    logits in memory); the tl.dot gradient kernel recomputes the logits and writes d(raw) in the operand dtype
    into the chunk's buffer `buf` (8NDV in all, no fp32 workspace); then dh[rows] = d(raw) W and `stage`'s dW."""

    def __init__(self, head: ChunkedHead, plan: FusedPlan, rows: slice, buf: Tensor, stage: _DwStage, cfg):
        from ludic_fast.ops.triton_head import kernel_targets

        self.head, self.plan, self.rows, self.stage, self.cfg = head, plan, rows, stage, cfg
        self.h_c = head.h_rows(rows)
        self.w = head.weight.to(head.compute_dtype)
        self.d = buf[: rows.stop - rows.start]
        self.tgt = kernel_targets(head.targets[rows], -100)
        self.inv_t = plan.transform.inv_temperature[rows].to(torch.float32).contiguous()

    def stats(self) -> RowStats:
        from ludic_fast.ops.triton_head import fused_stats

        lse, elp, lp, ent = fused_stats(self.h_c, self.w, self.head.bias, self.tgt, self.inv_t, self.cfg,
                                        self.plan.with_entropy)
        return RowStats(lse, elp, lp + lse, ent)  # z_y (lp is 0 on ignored rows, which the caller masks)

    def backward_(self, lse, elp, g_lp, g_H, dh, dW, db) -> None:
        """dW is the stage's (the argument is the same buffer)."""
        from ludic_fast.ops.triton_head import gemm_into, grad_launch, launch_head_grad

        cfg = self.cfg
        launch_head_grad(self.h_c, self.w, self.head.bias, self.tgt, self.inv_t, lse, elp, g_lp, g_H, self.d,
                         col_start=0, scale=cfg.scale, softcap=cfg.softcap, upcast=cfg.upcast,
                         precision=cfg.precision, **grad_launch(self.h_c, self.w, cfg.tma))
        if db is not None:
            db += self.d.sum(0, dtype=torch.float32)
        if dh is not None:
            gemm_into(dh[self.rows], self.d, self.w, accumulate=False)
        self.stage.add_(self.rows, self.d, self.h_c)


class _DwStage:
    """dW (+)= d(raw)^T h over groups of consecutive token chunks of at most `stage_rows` tokens.

    With several chunks in a group, each chunk's d(raw) is written (input dtype) into its rows of a
    [group rows, V] staging buffer and the group takes one dW GEMM, so an fp32 dW is read-modify-written once
    per group rather than once per chunk, and a single group needs no fp32 dW at all (written once in the input
    dtype). With one chunk per group d(raw) stays in the chunk's workspace memory. The first group's GEMM
    overwrites dW (beta = 0), later ones accumulate.

    `deferred` (one token chunk whose d(raw) memory is no larger than dW): the GEMM waits for the backward, which
    forms dW = d(raw)^T (g h) with the upstream gradient g folded into the [n, D] rows (`operands`): dW is
    written once in the input dtype and never rescaled (no read-modify-write pass over [V, D])."""

    def __init__(self, chunks: list[slice], stage_rows: int, head: ChunkedHead, need_dw: bool, d_bytes: int = 0):
        from ludic_fast.ops.triton_head import new_workspace

        self.head = head
        self.groups: list[slice] = []
        for rows in chunks:
            g = self.groups[-1] if self.groups else None
            if g is not None and rows.stop - g.start <= stage_rows:
                self.groups[-1] = slice(g.start, rows.stop)
            else:
                self.groups.append(rows)
        self.group_of = {}  # chunk start -> its group
        for g in self.groups:
            self.group_of.update({c.start: g for c in chunks if g.start <= c.start < g.stop})
        staged = len(self.groups) < len(chunks)
        width = max((g.stop - g.start for g in self.groups), default=0)
        self.buf = new_workspace(width, head.V, head.hidden.device, head.compute_dtype) if staged else None
        # one group: each dW row gets one contribution, written in the input dtype; else an fp32 accumulator
        dtype = head.compute_dtype if len(self.groups) <= 1 else head.acc
        dw_bytes = head.weight.numel() * torch.empty((), dtype=dtype).element_size()
        self.deferred = need_dw and len(chunks) == 1 and d_bytes <= dw_bytes
        self.operands: tuple[Tensor, Tensor] | None = None  # deferred: (d(raw) [n, V], h [n, D]) once written
        alloc = torch.empty if self.groups else torch.zeros
        make = need_dw and not self.deferred
        self.dW = alloc(head.weight.shape, device=head.hidden.device, dtype=dtype) if make else None

    def out(self, rows: slice) -> Tensor | None:
        """Where the chunk writes d(raw): its rows of the staging buffer, or None (its own workspace)."""
        if self.buf is None:
            return None
        g0 = self.group_of[rows.start].start
        return self.buf[rows.start - g0 : rows.stop - g0]

    def add_(self, rows: slice, d: Tensor, h_c: Tensor) -> None:
        """After the chunk's d(raw) is written: the group's dW GEMM once its last chunk is in."""
        from ludic_fast.ops.triton_head import gemm_into

        if self.deferred:
            self.operands = (d, h_c)
            return
        g = self.group_of[rows.start]
        if self.dW is None or rows.stop != g.stop:
            return
        first = g.start == self.groups[0].start
        if self.buf is None:
            gemm_into(self.dW, d.T, h_c, accumulate=not first)
        else:
            gemm_into(self.dW, self.buf[: g.stop - g.start].T, self.head.h_rows(g), accumulate=not first)


def _token_grads(objective: Objective, lp: Tensor, H: Tensor | None, rows: slice | None):
    """(dL/dlp, dL/dH or None, L detached) of the objective at (lp, H), by autograd on O(n) vectors."""
    with torch.enable_grad():
        lp_v = lp.detach().requires_grad_(True)
        H_v = None if H is None else H.detach().requires_grad_(True)
        loss = objective(lp_v, H_v, rows)
        inputs = (lp_v,) if H_v is None else (lp_v, H_v)
        if not loss.requires_grad:
            return torch.zeros_like(lp), None, loss.detach()
        grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    g_lp = torch.zeros_like(lp) if grads[0] is None else grads[0]
    g_H = grads[1] if len(grads) > 1 else None
    return g_lp, g_H, loss.detach()


class FusedLossFunction(torch.autograd.Function):
    """loss, lp, H = objective(head(hidden)) with d(loss)/d(hidden, weight, bias) formed in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, plan: FusedPlan):  # type: ignore[override]
        head_plan = _head_plan(hidden, weight, plan)
        head = ChunkedHead(hidden, weight, bias, targets, plan.transform, head_plan.blocks, -100)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        acc = {"device": hidden.device, "dtype": head.acc}
        n, V = head.N, head.V
        lp, lse, elp = (torch.zeros(n, **acc) for _ in range(3))
        H = torch.zeros(n, **acc) if plan.with_entropy else None
        if head.v_chunk < V:
            chunk_cls = _TorchSlices
        elif plan.backend == "triton":
            chunk_cls = _TritonDotRows if head_plan.strategy == "fused" else _TritonRows
        else:
            chunk_cls = _TorchRows
        group_chunks = (_group_chunks(plan.groups, head.n_chunk, n, _group_limit(plan, head, hidden))
                        if plan.coupled else None)
        chunks = list(head.row_chunks()) if group_chunks is None else group_chunks
        db = torch.zeros(V, **acc) if (need_b and bias is not None) else None
        if chunk_cls in (_TritonRows, _TritonDotRows):  # lean buffers: see _TritonRows and _DwStage
            from ludic_fast.ops.triton_head import KernelConfig, new_workspace

            tl_dot = chunk_cls is _TritonDotRows  # d(raw) in the operand dtype is the chunk's only buffer
            width = max((c.stop - c.start for c in chunks), default=0)
            buf = new_workspace(width, V, hidden.device, head.compute_dtype if tl_dot else torch.float32)
            stage_rows = head.n_chunk if tl_dot else plan.dw_stage_rows or head_plan.stage_rows or head.n_chunk
            lowp = {"device": hidden.device, "dtype": head.compute_dtype}
            dh = torch.empty(n, hidden.shape[1], **lowp) if need_h else None
            stage = _DwStage(chunks, stage_rows, head, need_w, buf.untyped_storage().nbytes())
            dW = stage.dW
            cfg = KernelConfig.make(plan.transform, head.compute_dtype, head_plan) if tl_dot else None

            def make(rows: slice):
                if tl_dot:
                    return _TritonDotRows(head, plan, rows, buf, stage, cfg)
                return _TritonRows(head, plan, rows, buf, stage)

        else:
            stage = None

            def make(rows: slice):
                return chunk_cls(head, plan, rows)

            dh = torch.zeros(n, hidden.shape[1], **acc)
            dW = torch.zeros(weight.shape, **acc) if need_w else None

        valid = head.valid.to(head.acc)  # rows whose target is ignore_index (-100): lp = H = 0, no gradient

        def set_stats(rows: slice, stats: RowStats) -> None:
            lse[rows], elp[rows] = stats.lse, stats.elp
            ok = head.valid[rows]
            lp[rows] = torch.where(ok, stats.zy - stats.lse, 0.0)
            if H is not None:
                H[rows] = torch.where(ok, stats.entropy, 0.0)

        two_pass = plan.coupled and group_chunks is None
        whole = None  # the objective's value on all tokens, once a gradient call took it (the loss then)
        kept = None  # two passes over one chunk: the first pass's chunk (its logits made) serves the second
        if two_pass:  # pass 1: statistics of every token, then all per-token gradients at once
            for rows in chunks:
                chunk = make(rows)
                set_stats(rows, chunk.stats())
                kept = chunk if len(chunks) == 1 else None
                del chunk
            g_lp, g_H, whole = _token_grads(plan.objective, lp, H, None)
        for rows in chunks:
            chunk = kept if kept is not None else make(rows)
            kept = None
            if two_pass:
                g_lp_c, g_H_c = g_lp[rows], None if g_H is None else g_H[rows]
            else:
                set_stats(rows, chunk.stats())
                every = rows.start == 0 and rows.stop == n  # one chunk: the objective of all tokens, as the loss
                g_lp_c, g_H_c, value = _token_grads(plan.objective, lp[rows], None if H is None else H[rows],
                                                    None if every else rows)
                whole = value if every else None
            g_lp_c = g_lp_c * valid[rows]
            g_H_c = None if g_H_c is None else g_H_c * valid[rows]
            chunk.backward_(lse[rows], elp[rows], g_lp_c, g_H_c, dh, dW, db)
            del chunk
        loss = _value(plan.objective, lp, H) if whole is None else whole
        d_raw, h_rows = (None, None) if stage is None or stage.operands is None else stage.operands
        ctx.save_for_backward(dh if need_h else None, dW, db, d_raw, h_rows)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.acc = head.acc
        ctx.used = False
        ctx.mark_non_differentiable(lp, *(() if H is None else (H,)))
        return loss, lp, H

    @staticmethod
    def backward(ctx, g_loss, _g_lp, _g_H):  # type: ignore[override]
        if ctx.used:
            raise RuntimeError("the fused loss scales its stored gradients in place; backward it only once")
        ctx.used = True
        dh, dW, db, d_raw, h_rows = ctx.saved_tensors
        h_dt, w_dt, b_dt = ctx.dtypes
        # the triton path holds dh (and dW with one token chunk) in the input dtype: scaling rounds once more, as
        # does g h for a deferred dW (exact when g is a power of two, e.g. 1)
        g = g_loss.to(ctx.acc)
        if d_raw is not None:  # deferred (one token chunk): dW = d(raw)^T (g h), one GEMM, no pass over [V, D]
            dW = torch.mm(d_raw.T, h_rows * g)
            return _scaled(dh, g, h_dt), dW.to(w_dt), _scaled(db, g, b_dt), None, None
        return _scaled(dh, g, h_dt), _scaled(dW, g, w_dt), _scaled(db, g, b_dt), None, None


def _scaled(grad: Tensor | None, g: Tensor, dtype: torch.dtype) -> Tensor | None:
    """grad * g in `dtype`: in place when grad has that dtype, else one pass that writes the product (computed
    in grad's dtype, as an in-place scale then a conversion would round it) straight in `dtype`."""
    if grad is None:
        return None
    if grad.dtype == dtype:
        return grad.mul_(g)
    return torch.mul(grad, g, out=torch.empty_like(grad, dtype=dtype))


def _head_plan(hidden: Tensor, weight: Tensor, plan: FusedPlan) -> HeadPlan:
    """The cost model's plan (`plan_head`): strategy (triton: env LUDIC_FAST_TRITON_STRATEGY, default auto),
    chunk rows, vocab columns, dW staging rows."""
    mode = "coupled" if plan.coupled and plan.groups is None else "fused_loss"
    strategy = strategy_requested() if plan.backend == "triton" else None
    return plan_head(
        hidden.shape[0], hidden.shape[1], weight.shape[0], dtype=torch.promote_types(hidden.dtype, weight.dtype),
        mode=mode, device=hidden.device, backend=plan.backend, memory_budget=plan.memory_budget,
        chunk_elements=plan.chunk_elements, strategy=strategy,
    )


#: CPU, no budget given: a group chunk may hold this many times the default chunk's rows (a pair of long
#: responses then runs one pass, 6NDV, instead of two, 8NDV; measured 0.69x the time at V=151936)
GROUP_CHUNK_GROWTH = 4


def _group_limit(plan: FusedPlan, head: ChunkedHead, hidden: Tensor) -> int:
    """The largest group a chunk may grow to hold: the plan's chunk rows, or on the CPU with no budget from the
    caller (argument or $LUDIC_FAST_CHUNK_ELEMENTS) and whole vocabulary rows GROUP_CHUNK_GROWTH times them."""
    explicit = plan.memory_budget is not None or plan.chunk_elements is not None or env_chunk_elements() is not None
    if explicit or hidden.is_cuda or head.v_chunk < head.V:
        return head.n_chunk
    return GROUP_CHUNK_GROWTH * head.n_chunk


def _group_chunks(starts: list[int] | None, n_chunk: int, n: int, grow_to: int | None = None) -> list[slice] | None:
    """Row chunks made of whole groups (greedy) of at most max(n_chunk, the largest group) rows, or None when
    the largest group exceeds `grow_to` (default n_chunk)."""
    if starts is None:
        return None
    bounds = [0, *(s for s in starts if 0 < s < n), n]
    largest = max((b - a for a, b in zip(bounds, bounds[1:])), default=0)
    if largest > (n_chunk if grow_to is None else grow_to):
        return None
    limit = max(n_chunk, largest)
    chunks, c0, prev = [], 0, 0
    for b in bounds[1:]:
        if b - c0 > limit:
            chunks.append(slice(c0, prev))
            c0 = prev
        prev = b
    if n > c0:
        chunks.append(slice(c0, n))
    return chunks


def _value(objective: Objective, lp: Tensor, H: Tensor | None) -> Tensor:
    with torch.no_grad():
        return objective(lp, H, None).detach()


@autocast_as_matmul("hidden", "weight", "bias")  # see ludic_fast.ops
def fused_head_loss(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, plan: FusedPlan
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(loss, lp, H) for head rows `hidden [n, D]` scoring `targets [n]`; loss differentiable w.r.t. hidden,
    weight and bias at 6NDV (token-local) or 8NDV (coupled; 6NDV in one chunk) matmul FLOPs; lp and H are
    detached."""
    if hidden.ndim != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be [n, D] and targets [n]; got {tuple(hidden.shape)}, {tuple(targets.shape)}")
    apply = _apply_outside_compile if plan.backend == "triton" else FusedLossFunction.apply  # see ludic_fast.ops
    return apply(hidden, weight, bias, targets, plan)


_apply_outside_compile = torch.compiler.disable(FusedLossFunction.apply)


__all__ = ["FusedPlan", "FusedLossFunction", "fused_head_loss"]
