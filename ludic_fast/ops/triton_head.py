"""The `triton` backend of the head: autograd glue and strategy dispatch around `ludic_fast.kernels`.

Math (see `ludic_fast.ops` and `ludic_fast.ops.torch_head`): z = softcap(logit_scale (h W^T + b)) / T; per
token lse, elp = E_p z - lse, logprob z_y - lse and entropy H (fp32, online sums relative to the row maximum);
backward for any per-token (g_lp, g_H): dz_j = g_lp (1[j=y] - p_j) - g_H p_j (log p_j - elp), chain rule to
raw logits, then dh = draw W, dW = draw^T h, db = sum_rows draw, accumulated in fp32.

Two strategies, same numbers:
  workspace  forward: a cuBLAS GEMM writes a bounded fp32 chunk of raw logits (whole vocabulary rows); the
             Triton row kernel (kernels.head_rows) turns it into statistics. Backward blocks: a GEMM writes
             fp32 raw logits, the row kernel writes d(raw) in the GEMM operand dtype over the same memory
             (`operand_view`).
  fused      forward: Triton tl.dot tiles with online statistics (kernels.head_fwd + head_merge), no logits
             workspace. Backward blocks: a tl.dot kernel (kernels.head_grad) recomputes the logit tile and
             writes d(raw) in the operand dtype from registers (no fp32 logits in memory at all).
Backward (both): vocabulary slices over all tokens (token chunks too when the budget needs them); per block
cuBLAS forms dh and dW from d(raw). A gradient that gets one contribution per element (dh when one slice
spans the vocabulary, dW when one token chunk spans all tokens) is written by one GEMM in the input dtype;
otherwise it accumulates in fp32, the first GEMM with beta = 0 (no zero-fill). Held logits (workspace,
`HeadPlan.hold_logits`): the forward's one chunk of all rows is kept and the backward's one block writes
d(raw) over it, with no logits GEMM (6NDV in all); a second backward through the graph recomputes them.
Plan (`ludic_fast.ops.plan.plan_head`): the `strategy=` argument, else env LUDIC_FAST_TRITON_STRATEGY
(auto|fused|workspace), else auto: the strategy, forward chunk rows and backward blocks the cost model
predicts fastest within the memory budget.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from ludic_fast.kernels.head_fwd import launch_config, launch_head_fwd
from ludic_fast.kernels.head_grad import grad_config, launch_head_grad
from ludic_fast.kernels.head_merge import launch_head_merge
from ludic_fast.kernels.head_rows import launch_head_rows
from ludic_fast.kernels.tma import tma_ready
from ludic_fast.ops.plan import HeadPlan, plan_head, strategy_requested
from ludic_fast.ops.torch_head import HeadTransform, addmm_acc_

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: workspace row strides are multiples of this many elements (16-byte aligned GEMM operands)
_ALIGN = 128
#: programs the fused forward aims to launch off CUDA (the interpreter); on CUDA: one per SM (the default
#: configs hold one CTA per SM), so vocab splits fill the GPU when there are few token tiles
_TARGET_PROGRAMS = 132


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class KernelConfig:
    """Compile-time (constexpr) parameters shared by the kernels of one call."""

    scale: float
    softcap: float | None
    upcast: bool  # interpreter only: bf16 tl.dot is wrong there, fp32 operands are exact
    precision: str  # tl.dot input precision: "ieee" keeps fp32 inputs exact (no tf32)
    rows: int  # token rows of one forward workspace chunk (whole vocabulary rows)
    grad_block: tuple[int, int]  # (token rows, vocab columns) of one backward block
    hold: bool = False  # workspace strategy: the forward's one chunk of all rows is kept for the backward
    tma: bool = False  # the tl.dot kernels' TMA variant (opt-in, env LUDIC_FAST_TMA=1; see `tma_requested`)

    @staticmethod
    def make(transform: HeadTransform, dtype: torch.dtype, plan: HeadPlan) -> KernelConfig:
        return KernelConfig(
            scale=float(transform.logit_scale),
            softcap=None if transform.softcap is None else float(transform.softcap),
            upcast=_interpreting() and dtype == torch.bfloat16,
            precision="ieee" if dtype == torch.float32 else "tf32",
            rows=plan.token_rows,
            grad_block=(plan.grad_rows, plan.grad_cols),
            hold=plan.hold_logits,
            tma=tma_requested(),
        )


def tma_requested() -> bool:
    """Env LUDIC_FAST_TMA=1 asks the fused strategy's tl.dot kernels for their TMA variant (descriptor loads;
    persistent backward grid). It exists for bf16/fp16 on sm_90+ and needs TMA-aligned h and W
    (`kernels.tma.tma_ready`); elsewhere the pointer-load kernels run. Off by default: unmeasured on a GPU."""
    return os.environ.get("LUDIC_FAST_TMA", "0") == "1"


def kernel_targets(targets: Tensor, ignore_index: int) -> Tensor:
    """int32 targets with -1 at ignored rows (the kernels' convention)."""
    return torch.where(targets == ignore_index, torch.full_like(targets, -1), targets).to(torch.int32).contiguous()


def _upstream(g: Tensor | None, n: int) -> Tensor | None:
    return None if g is None else g.to(torch.float32).reshape(n).contiguous()


# --------------------------------------------------------------------------------- workspace and GEMMs
def new_workspace(rows: int, cols: int, device: torch.device | str, dtype: torch.dtype = torch.float32) -> Tensor:
    """An uninitialised [rows, cols] workspace whose row stride is a multiple of `_ALIGN` elements (16-byte
    aligned rows for cuBLAS, also in a narrower `operand_view`)."""
    ld = -(-max(cols, 1) // _ALIGN) * _ALIGN
    return torch.empty(rows, ld, device=device, dtype=dtype)[:, :cols]


def operand_view(ws: Tensor, dtype: torch.dtype) -> Tensor:
    """The [n, c] tensor of `dtype` the row kernel writes d(raw) into: `ws` itself for the same dtype, else a
    view of ws's memory whose row i starts at the first byte of ws's row i (bf16/fp16 over an fp32
    workspace: no second buffer; `kernels.head_rows` orders its loads and stores for this aliasing)."""
    if dtype == ws.dtype:
        return ws
    if torch.empty((), dtype=dtype).element_size() > ws.element_size() or ws.stride(1) != 1:
        raise ValueError(f"operand_view: cannot view a {ws.dtype} workspace as {dtype}")
    return ws.view(dtype)[:, : ws.shape[1]]


def gemm_into(out: Tensor, a: Tensor, b: Tensor, *, accumulate: bool) -> None:
    """out (+)= a @ b. Without `accumulate` the GEMM overwrites `out` (beta = 0: no zero-fill needed) and,
    when out has the operands' dtype, writes it directly (fp32 accumulation inside the GEMM; a split-K GEMM may
    add its partial sums in the output dtype, as every bf16/fp16 `torch.mm` does unless
    `torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction` / `..._fp16_...` is off)."""
    if accumulate:
        addmm_acc_(out, a, b)
    elif out.dtype == a.dtype:
        torch.mm(a, b, out=out)
    else:
        addmm_acc_(out, a, b, beta=0.0)


# --------------------------------------------------------------------------------- workspace row kernel
def workspace_head_rows_(
    ws: Tensor,
    targets: Tensor,
    inv_temperature: Tensor,
    *,
    bias: Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    entropy: bool = True,
    ignore_index: int = -100,
    col_start: int = 0,
    lse: Tensor | None = None,
    elp: Tensor | None = None,
    g_lp: Tensor | None = None,
    g_H: Tensor | None = None,
    out: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Triton epilogue on a chunk of raw logits; drop-in for `ChunkedHead.stats` + `ChunkedHead.grad_raw_`.

    ws [n, c]: raw logits `h_chunk @ W[col_start:col_start+c].T` WITHOUT bias or transform (fp32, bf16 or
    fp16, unit column stride, any row stride). targets [n] global vocab ids (ignore_index allowed),
    inv_temperature [n] (1/T per token, any float dtype), bias: the full [V] bias or None. With
    z = softcap(logit_scale (ws + b)) * inv_temperature:

    * `lse`/`elp` None: computes, per row, lse = log sum_j e^{z_j}, elp = E_p z - lse and the entropy H (0
      unless `entropy`) and the target logit z_y (0 at ignored rows); needs whole vocabulary rows
      (col_start = 0, c = V). Returns (lse, elp, z_y, H) fp32 [n] — the fields of `torch_head.RowStats`, as
      `ChunkedHead.stats` — so logprob = z_y - lse.
    * `g_lp` given (fp32-castable [n]; `g_H` too, or None for no entropy gradient): writes
      d(raw)_j = [g_lp (1[j=y] - p_j) - g_H p_j (log p_j - elp)] * inv_T * logit_scale * (1 - tanh^2),
      log p = z - lse,
      into `out` (default: ws in place; else [n, c] in any float dtype, e.g. `operand_view(ws, torch.bfloat16)`
      so the gradient GEMMs read bf16 with no conversion pass), using the given lse/elp (any column slice) or
      the ones just computed (one call for stats and gradient). Ignored rows get a zero gradient. Then
      `dh = out @ W[cols]`, `dW[cols] = out.T @ h`, `db = out.sum(0)`. Returns (lse, elp, None, None) when
      lse/elp were given.
    """
    n, c = ws.shape
    if ws.stride(1) != 1:
        raise ValueError("ws must have unit column stride")
    if g_lp is None and g_H is not None:
        raise ValueError("g_H needs g_lp (pass zeros for no logprob gradient)")
    if (lse is None) != (elp is None):
        raise ValueError("lse and elp must be given together")
    out = ws if out is None else out
    if out.shape != ws.shape or out.stride(1) != 1:
        raise ValueError(f"out must be [n, c] = {tuple(ws.shape)} with unit column stride, got {tuple(out.shape)}")
    _check_alias(ws, out)
    stats = lse is None
    if stats and (col_start != 0 or (bias is not None and c != bias.shape[0])):
        raise ValueError("statistics need whole vocabulary rows: col_start must be 0 and ws must hold all V columns")
    f32 = {"device": ws.device, "dtype": torch.float32}
    tgt = kernel_targets(targets.reshape(n), ignore_index)
    inv_t = inv_temperature.to(torch.float32).reshape(n).contiguous()
    if stats:
        lse, elp, zy, ent = (torch.empty(n, **f32) for _ in range(4))
    else:
        lse, elp, zy, ent = lse.to(torch.float32).contiguous(), elp.to(torch.float32).contiguous(), None, None
    if n:
        launch_head_rows(
            ws, bias, tgt, inv_t, lse, elp, zy, _upstream(g_lp, n), _upstream(g_H, n),
            col_start=int(col_start), scale=float(logit_scale), softcap=None if softcap is None else float(softcap),
            entropy=entropy, stats=stats, d=out, ent=ent,
        )
    return lse, elp, zy, ent


def _check_alias(ws: Tensor, out: Tensor) -> None:
    """`out` may share memory with ws only as ws itself or as its `operand_view` (row i at ws's row i)."""
    if out is ws or out.untyped_storage().data_ptr() != ws.untyped_storage().data_ptr():
        return
    row_bytes = out.stride(0) * out.element_size() == ws.stride(0) * ws.element_size()
    if not (out.data_ptr() == ws.data_ptr() and row_bytes and out.element_size() <= ws.element_size()):
        raise ValueError("out overlaps ws other than as ws itself or operand_view(ws, dtype)")


def fused_splits(n: int, v: int, config: dict, programs: int) -> tuple[int, int]:
    """(vocab splits, vocab blocks per split) of the fused forward grid with `config`'s tiles: about
    `programs` programs (token tiles x splits) to fill the GPU; every split starts inside the vocabulary."""
    row_tiles = -(-n // config["BLOCK_M"])
    vocab_blocks = -(-v // config["BLOCK_N"])
    per_split = -(-vocab_blocks // max(1, min(vocab_blocks, programs // row_tiles)))
    return -(-vocab_blocks // per_split), per_split


def _device_arch_and_programs(device: torch.device) -> tuple[int, int]:
    """(80 or 90: the launch-config family, target program count) for tensors on `device`."""
    if device.type != "cuda":
        return 90, _TARGET_PROGRAMS
    props = torch.cuda.get_device_properties(device)
    return (90 if props.major >= 9 else 80), props.multi_processor_count


def grad_launch(h: Tensor, w: Tensor, tma: bool) -> dict:
    """`launch_head_grad`'s `config` and `programs` for rows `h` against weight rows `w` (by element size and
    device arch; the TMA + persistent variant when `tma` and both are TMA-aligned)."""
    arch, programs = _device_arch_and_programs(h.device)
    return {"config": grad_config(h.element_size(), arch, tma=tma and tma_ready(h, w)), "programs": programs}


class _HeadFunctionBase(torch.autograd.Function):
    """Shared forward/backward bookkeeping; subclasses implement `_stats` (the statistics, and the raw logits
    of all rows when the plan holds them, else None) and choose the backward's d(raw) producer
    (`_TL_DOT_GRAD`: the tl.dot gradient kernel, else GEMM + row kernel)."""

    _TL_DOT_GRAD = False

    @classmethod
    def forward(cls, ctx, h, w, b, tgt, inv_t, cfg: KernelConfig, with_entropy: bool):  # type: ignore[override]
        lse, elp, lp, ent, held = cls._stats(h, w, b, tgt, inv_t, cfg, with_entropy)
        ctx.save_for_backward(h, w, b, tgt, inv_t, lse, elp)
        ctx.cfg, ctx.with_entropy, ctx.held = cfg, with_entropy, held
        ctx.mark_non_differentiable(lse)
        return lp, ent, lse

    @classmethod
    def backward(cls, ctx, g_lp, g_H, _g_lse):  # type: ignore[override]
        h, w, b, tgt, inv_t, lse, elp = ctx.saved_tensors
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2] and b is not None)
        n = h.shape[0]
        g_lp = torch.zeros(n, device=h.device, dtype=torch.float32) if g_lp is None else _upstream(g_lp, n)
        g_H = _upstream(g_H, n) if ctx.with_entropy else None
        # d(raw) overwrites the held logits: a second backward (retain_graph) recomputes them
        held, ctx.held = ctx.held, None
        grads = _block_grads(h, w, b, tgt, inv_t, lse, elp, g_lp, g_H, need, ctx.cfg, cls._TL_DOT_GRAD, held)
        return (
            *(None if g is None else g.to(x.dtype) for g, x in zip(grads, (h, w, b))),
            None,
            None,
            None,
            None,
        )


def _block_grads(h, w, b, tgt, inv_t, lse, elp, g_lp, g_H, need, cfg, tl_dot: bool, held: Tensor | None = None):
    """(dh, dW, db), None where not needed. Blocks of the plan (vocabulary slices over all tokens when the
    budget allows). Per block, d(raw) in the input dtype: `tl_dot` — the tl.dot gradient kernel recomputes
    the logits in registers (a [block] buffer of the input dtype); else fp32 raw logits (GEMM, beta = 0, or
    `held`: the forward's [N, V] raw logits, the plan's one block), then the row kernel over the same memory.
    Then dh[r] (+)= d W[c], dW[c] (+)= d^T h[r]. dh is fp32 only when there are several slices, dW only when
    there are several token chunks; otherwise each is one GEMM into the input dtype."""
    n, v = h.shape[0], w.shape[0]
    rows_per, cols_per = cfg.grad_block
    row_chunks, slices = -(-n // rows_per), -(-v // cols_per)
    dev = h.device
    dh = torch.empty(h.shape, device=dev, dtype=h.dtype if slices == 1 else torch.float32) if need[0] else None
    dw = torch.empty(w.shape, device=dev, dtype=w.dtype if row_chunks <= 1 else torch.float32) if need[1] else None
    db = torch.zeros(v, device=dev, dtype=torch.float32) if need[2] else None
    if n == 0 or not any(need):
        return tuple(None if g is None else g.zero_() for g in (dh, dw, db))
    if held is not None and held.shape != (n, v):
        raise ValueError(f"held logits must be [N, V] = {(n, v)}, got {tuple(held.shape)}")
    buf = held if held is not None else new_workspace(min(rows_per, n), min(cols_per, v), dev,
                                                      h.dtype if tl_dot else torch.float32)
    launch = grad_launch(h, w, cfg.tma) if tl_dot else None
    for ci, c0 in enumerate(range(0, v, cols_per)):
        c = slice(c0, min(v, c0 + cols_per))
        for ri, r0 in enumerate(range(0, n, rows_per)):
            r = slice(r0, min(n, r0 + rows_per))
            ws = buf[: r.stop - r.start, : c.stop - c.start]
            g_H_r = None if g_H is None else g_H[r]
            if tl_dot:
                d = ws
                launch_head_grad(h[r], w[c], b, tgt[r], inv_t[r], lse[r], elp[r], g_lp[r], g_H_r, d, col_start=c0,
                                 scale=cfg.scale, softcap=cfg.softcap, upcast=cfg.upcast, precision=cfg.precision,
                                 **launch)
            else:
                if held is None:
                    gemm_into(ws, h[r], w[c].T, accumulate=False)
                d = operand_view(ws, h.dtype)
                launch_head_rows(ws, b, tgt[r], inv_t[r], lse[r], elp[r], None, g_lp[r], g_H_r, col_start=c0,
                                 scale=cfg.scale, softcap=cfg.softcap, entropy=g_H is not None, stats=False, d=d)
            if db is not None:
                db[c] += d.sum(0, dtype=torch.float32)
            if dh is not None:
                gemm_into(dh[r], d, w[c], accumulate=ci > 0)
            if dw is not None:
                gemm_into(dw[c], d.T, h[r], accumulate=ri > 0)
    return dh, dw, db


def fused_stats(h, w, b, tgt, inv_t, cfg: KernelConfig, with_entropy: bool) -> list[Tensor]:
    """(lse, elp = E_p z - lse, logprob, entropy), fp32 [N], of rows `h` against the whole weight `w` by the tl.dot
    forward kernel (token tile x vocabulary split) and the merge of the splits; no logits in memory."""
    n, v = h.shape[0], w.shape[0]
    f32 = {"device": h.device, "dtype": torch.float32}
    out = [torch.zeros(n, **f32) for _ in range(4)]
    if n == 0:
        return out
    arch, programs = _device_arch_and_programs(h.device)
    config = launch_config(h.element_size(), arch, n, tma=cfg.tma and tma_ready(h, w))
    splits, per_split = fused_splits(n, v, config, programs)
    part = torch.empty(4, splits, n, **f32)
    launch_head_fwd(h, w, b, tgt, inv_t, part, per_split, scale=cfg.scale, softcap=cfg.softcap,
                    entropy=with_entropy, upcast=cfg.upcast, precision=cfg.precision, config=config)
    launch_head_merge(part, tgt, *out, entropy=with_entropy)
    return out


class FusedHeadFunction(_HeadFunctionBase):
    """Fused strategy: forward by `fused_stats`, no logits workspace; backward blocks from the tl.dot gradient
    kernel."""

    _TL_DOT_GRAD = True

    @staticmethod
    def _stats(h, w, b, tgt, inv_t, cfg, with_entropy):
        return *fused_stats(h, w, b, tgt, inv_t, cfg, with_entropy), None


class WorkspaceHeadFunction(_HeadFunctionBase):
    """Workspace strategy: cuBLAS GEMM into an fp32 chunk of whole vocabulary rows + the row kernel; with
    `cfg.hold` the one chunk of all rows is returned for the backward (the row kernel leaves it unchanged)."""

    @staticmethod
    def _stats(h, w, b, tgt, inv_t, cfg, with_entropy):
        n, v = h.shape[0], w.shape[0]
        f32 = {"device": h.device, "dtype": torch.float32}
        lse, elp, zy, ent = (torch.zeros(n, **f32) for _ in range(4))
        rows_per = max(1, min(n, cfg.rows))
        buf = new_workspace(rows_per, v, h.device) if n else None
        for r0 in range(0, n, rows_per):
            r = slice(r0, min(n, r0 + rows_per))
            ws = buf[: r.stop - r.start]
            gemm_into(ws, h[r], w.T, accumulate=False)
            launch_head_rows(ws, b, tgt[r], inv_t[r], lse[r], elp[r], zy[r], None, None, col_start=0,
                             scale=cfg.scale, softcap=cfg.softcap, entropy=with_entropy, stats=True, ent=ent[r])
        valid = tgt >= 0
        zero = torch.zeros_like(lse)
        ent = torch.where(valid, ent, zero) if with_entropy else zero
        return lse, elp, torch.where(valid, zy - lse, zero), ent, buf if cfg.hold else None


@torch.compiler.disable  # outside torch.compile: see ludic_fast.ops
def triton_linear_logprobs(
    h2: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    transform: HeadTransform,
    entropy: bool,
    ignore_index: int,
    *,
    strategy: str | None = None,
    chunk_elements: int | None = None,
    memory_budget: int | str | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(logprobs, entropy, lse), fp32 [N], of the head with the Triton kernels; differentiable w.r.t.
    h2 [N, D], weight [V, D] and bias [V] for any upstream gradients of logprobs and entropy.

    Inputs are validated by `ludic_fast.ops.linear_logprobs`. Supports float16/bfloat16/float32 (mixed
    inputs are promoted); `strategy` None|'auto'|'fused'|'workspace' (None: env LUDIC_FAST_TRITON_STRATEGY,
    default auto); chunking and strategy from `plan.plan_head` under `memory_budget` bytes or `chunk_elements`."""
    dtype = torch.promote_types(h2.dtype, weight.dtype)
    if dtype not in _KERNEL_DTYPES:
        raise TypeError(f"hidden/weight dtype {dtype} is not supported by the triton backend (fp16, bf16, fp32)")
    n, v = h2.shape[0], weight.shape[0]
    grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (h2, weight, bias))
    plan = plan_head(n, h2.shape[1], v, dtype=dtype, mode="generic" if grad else "forward", device=h2.device,
                     memory_budget=memory_budget, chunk_elements=chunk_elements,
                     strategy=strategy or strategy_requested())
    fn = FusedHeadFunction if plan.strategy == "fused" else WorkspaceHeadFunction
    cfg = KernelConfig.make(transform, dtype, plan)
    tgt = kernel_targets(targets, ignore_index)
    inv_t = transform.inv_temperature.to(torch.float32).reshape(n).contiguous()
    return fn.apply(h2.to(dtype), weight.to(dtype), bias, tgt, inv_t, cfg, bool(entropy))
