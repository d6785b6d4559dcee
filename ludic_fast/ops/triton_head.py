"""The `triton` backend of the head: autograd glue and strategy dispatch around `ludic_fast.kernels`.

Math (see `ludic_fast.ops`): z = softcap(logit_scale (h W^T + b)) / T; per token lse, E_p z, logprob
z_y - lse and entropy lse - E_p z (fp32); backward for any per-token (g_lp, g_H):
dz_j = g_lp (1[j=y] - p_j) - g_H p_j (z_j - E_p z), chain rule to raw logits, then dh = draw W,
dW = draw^T h, db = sum_rows draw, all accumulated in fp32.

Two strategies, same numbers:
  fused      Triton tl.dot tiles with online statistics (kernels.head_fwd + head_merge), backward
             recomputes tiles and accumulates dh/dW with fp32 atomics (kernels.head_bwd). No workspace.
  workspace  torch.matmul (cuBLAS) writes a bounded fp32 chunk of raw logits; the Triton row kernel
             (kernels.head_rows) turns it into statistics, or into d(raw) in place; torch.matmul forms dh, dW.
             Forward chunks whole vocab rows; backward slices the vocabulary over all tokens so every dW row
             is produced by one GEMM (no cross-chunk dW read-modify-write) whenever the budget allows.
Rule (`choose_strategy`): `strategy=` argument, else env LUDIC_FAST_TRITON_STRATEGY (auto|fused|workspace),
else auto: fused when N < 128 (a single token tile: the GEMM is bound by reading W and the workspace round
trip is pure overhead) or when the chunk budget cannot hold 16 whole vocabulary rows; workspace otherwise
(cuBLAS GEMMs reach GEMM-class throughput, which a plain tl.dot kernel without TMA/persistence may not).
GPU speed of either strategy is unmeasured so far; revisit the rule with measurements.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from ludic_fast.kernels.head_bwd import launch_head_bwd
from ludic_fast.kernels.head_fwd import CONFIGS as FWD_CONFIGS
from ludic_fast.kernels.head_fwd import launch_head_fwd
from ludic_fast.kernels.head_merge import launch_head_merge
from ludic_fast.kernels.head_rows import launch_head_rows
from ludic_fast.ops.torch_head import HeadTransform, addmm_acc_, default_chunk_elements, gemm_f32

STRATEGIES = ("auto", "fused", "workspace")
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FUSED_MAX_TOKENS = 128
_MIN_WORKSPACE_ROWS = 16
_MIN_GRAD_COLS = 1024
#: programs the fused forward aims to launch (vocab splits fill the GPU when there are few token tiles)
_TARGET_PROGRAMS = 1024


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def choose_strategy(n_tokens: int, vocab: int, max_elements: int | None, strategy: str | None = None) -> str:
    """'fused' or 'workspace' for one call (see the module docstring for the rule)."""
    choice = strategy or os.environ.get("LUDIC_FAST_TRITON_STRATEGY", "auto")
    if choice not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {choice!r}")
    if choice != "auto":
        return choice
    budget = default_chunk_elements() if max_elements is None else max_elements
    if n_tokens < _FUSED_MAX_TOKENS or budget < _MIN_WORKSPACE_ROWS * vocab:
        return "fused"
    return "workspace"


@dataclass(frozen=True)
class _KernelConfig:
    """Compile-time (constexpr) parameters shared by the kernels of one call."""

    scale: float
    softcap: float | None
    upcast: bool  # interpreter only: bf16 tl.dot is wrong there, fp32 operands are exact
    precision: str  # tl.dot input precision: "ieee" keeps fp32 inputs exact (no tf32)
    max_elements: int

    @staticmethod
    def make(transform: HeadTransform, dtype: torch.dtype, max_elements: int | None) -> _KernelConfig:
        return _KernelConfig(
            scale=float(transform.logit_scale),
            softcap=None if transform.softcap is None else float(transform.softcap),
            upcast=_interpreting() and dtype == torch.bfloat16,
            precision="ieee" if dtype == torch.float32 else "tf32",
            max_elements=default_chunk_elements() if max_elements is None else int(max_elements),
        )


def kernel_targets(targets: Tensor, ignore_index: int) -> Tensor:
    """int32 targets with -1 at ignored rows (the kernels' convention)."""
    return torch.where(targets == ignore_index, torch.full_like(targets, -1), targets).to(torch.int32).contiguous()


def _upstream(g: Tensor | None, n: int) -> Tensor | None:
    return None if g is None else g.to(torch.float32).reshape(n).contiguous()


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
    ez: Tensor | None = None,
    g_lp: Tensor | None = None,
    g_H: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Triton epilogue on a chunk of raw logits; drop-in for `ChunkedHead.stats` + `ChunkedHead.grad_raw_`.

    ws [n, c]: raw logits `h_chunk @ W[col_start:col_start+c].T` WITHOUT bias or transform (fp32, bf16 or
    fp16, unit column stride, any row stride; written in place when gradients are given). targets [n]
    global vocab ids (ignore_index allowed), inv_temperature [n] (1/T per token, any float dtype),
    bias: the full [V] bias or None. With z = softcap(logit_scale (ws + b)) * inv_temperature:

    * `lse`/`ez` None: computes, per row, lse = log sum_j e^{z_j}, ez = E_p z (0 unless `entropy`) and the
      target logit z_y (0 at ignored rows); needs whole vocabulary rows (col_start = 0, c = V). Returns
      (lse, ez, z_y) fp32 [n] — the same triple as `ChunkedHead.stats` — so logprob = z_y - lse and
      entropy = lse - ez.
    * `g_lp` given (fp32-castable [n]; `g_H` too, or None for no entropy gradient): overwrites ws with
      d(raw)_j = [g_lp (1[j=y] - p_j) - g_H p_j (z_j - ez)] * inv_T * logit_scale * (1 - tanh^2), p = e^{z - lse},
      using the given lse/ez (any column slice) or the ones just computed (one call for stats and gradient).
      Ignored rows get a zero gradient. Then `dh = ws @ W[cols]`, `dW[cols] = ws.T @ h`, `db = ws.sum(0)`.
      Returns (lse, ez, None) when lse/ez were given.
    """
    n, c = ws.shape
    if ws.stride(1) != 1:
        raise ValueError("ws must have unit column stride")
    if g_lp is None and g_H is not None:
        raise ValueError("g_H needs g_lp (pass zeros for no logprob gradient)")
    if (lse is None) != (ez is None):
        raise ValueError("lse and ez must be given together")
    stats = lse is None
    if stats and (col_start != 0 or (bias is not None and c != bias.shape[0])):
        raise ValueError("statistics need whole vocabulary rows: col_start must be 0 and ws must hold all V columns")
    f32 = {"device": ws.device, "dtype": torch.float32}
    tgt = kernel_targets(targets.reshape(n), ignore_index)
    inv_t = inv_temperature.to(torch.float32).reshape(n).contiguous()
    if stats:
        lse, ez, zy = (torch.empty(n, **f32) for _ in range(3))
    else:
        lse, ez, zy = lse.to(torch.float32).contiguous(), ez.to(torch.float32).contiguous(), None
    if n:
        launch_head_rows(
            ws, bias, tgt, inv_t, lse, ez, zy, _upstream(g_lp, n), _upstream(g_H, n),
            col_start=int(col_start), scale=float(logit_scale), softcap=None if softcap is None else float(softcap),
            entropy=entropy, stats=stats,
        )
    return lse, ez, zy


def grad_blocks(n: int, v: int, budget: int) -> tuple[int, int]:
    """(tokens, vocab columns) of one backward workspace block: all tokens of a vocabulary slice if possible."""
    cols = min(v, budget // max(n, 1))
    if cols >= min(v, _MIN_GRAD_COLS):
        return n, cols
    cols = min(v, _MIN_GRAD_COLS)
    return max(1, budget // cols), cols


def fused_splits(n: int, v: int, elem_size: int = 2) -> tuple[int, int]:
    """(vocab splits, vocab blocks per split) of the fused forward grid for inputs of `elem_size` bytes: about
    `_TARGET_PROGRAMS` programs (token tiles x splits) to fill the GPU; every split starts inside the vocabulary."""
    config = FWD_CONFIGS[elem_size]
    row_tiles = -(-n // config["BLOCK_M"])
    vocab_blocks = -(-v // config["BLOCK_N"])
    per_split = -(-vocab_blocks // max(1, min(vocab_blocks, _TARGET_PROGRAMS // row_tiles)))
    return -(-vocab_blocks // per_split), per_split


class _HeadFunctionBase(torch.autograd.Function):
    """Shared forward/backward bookkeeping; subclasses implement `_stats` and `_grads`."""

    @classmethod
    def forward(cls, ctx, h, w, b, tgt, inv_t, cfg: _KernelConfig, with_entropy: bool):  # type: ignore[override]
        lse, ez, lp, ent = cls._stats(h, w, b, tgt, inv_t, cfg, with_entropy)
        ctx.save_for_backward(h, w, b, tgt, inv_t, lse, ez)
        ctx.cfg, ctx.with_entropy = cfg, with_entropy
        ctx.mark_non_differentiable(lse)
        return lp, ent, lse

    @classmethod
    def backward(cls, ctx, g_lp, g_H, _g_lse):  # type: ignore[override]
        h, w, b, tgt, inv_t, lse, ez = ctx.saved_tensors
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2] and b is not None)
        n = h.shape[0]
        g_lp = torch.zeros(n, device=h.device, dtype=torch.float32) if g_lp is None else _upstream(g_lp, n)
        g_H = _upstream(g_H, n) if ctx.with_entropy else None
        grads = cls._grads(h, w, b, tgt, inv_t, lse, ez, g_lp, g_H, need, ctx.cfg)
        return (
            *(None if g is None else g.to(x.dtype) for g, x in zip(grads, (h, w, b))),
            None,
            None,
            None,
            None,
        )


def _zeros_f32(shape, needed: bool, like: Tensor) -> Tensor | None:
    return torch.zeros(shape, device=like.device, dtype=torch.float32) if needed else None


class FusedHeadFunction(_HeadFunctionBase):
    """Fused strategy: forward (token tile x vocab split) + merge; backward recompute + fp32 atomics."""

    @staticmethod
    def _stats(h, w, b, tgt, inv_t, cfg, with_entropy):
        n, v = h.shape[0], w.shape[0]
        f32 = {"device": h.device, "dtype": torch.float32}
        out = [torch.zeros(n, **f32) for _ in range(4)]
        if n == 0:
            return out
        splits, per_split = fused_splits(n, v, h.element_size())
        part = torch.empty(4, splits, n, **f32)
        launch_head_fwd(h, w, b, tgt, inv_t, part, per_split, scale=cfg.scale, softcap=cfg.softcap,
                        entropy=with_entropy, upcast=cfg.upcast, precision=cfg.precision)
        launch_head_merge(part, tgt, *out, entropy=with_entropy)
        return out

    @staticmethod
    def _grads(h, w, b, tgt, inv_t, lse, ez, g_lp, g_H, need, cfg):
        """(dh, dW, db) in fp32 (None where not needed): atomics need fp32 buffers of the full size."""
        dh, dw, db = (_zeros_f32(shape, nd, h) for shape, nd in zip((h.shape, w.shape, w.shape[:1]), need))
        if h.shape[0] and any(need):
            launch_head_bwd(h, w, b, tgt, inv_t, lse, ez, g_lp, g_H, dh, dw, db, scale=cfg.scale,
                            softcap=cfg.softcap, upcast=cfg.upcast, precision=cfg.precision)
        return dh, dw, db


class WorkspaceHeadFunction(_HeadFunctionBase):
    """Workspace strategy: torch.matmul chunks + the Triton row kernel (statistics, or d(raw) in place)."""

    @staticmethod
    def _stats(h, w, b, tgt, inv_t, cfg, with_entropy):
        n, v = h.shape[0], w.shape[0]
        f32 = {"device": h.device, "dtype": torch.float32}
        lse, ez, zy = (torch.zeros(n, **f32) for _ in range(3))
        rows_per = max(1, cfg.max_elements // v)
        for r0 in range(0, n, rows_per):
            r = slice(r0, min(n, r0 + rows_per))
            ws = gemm_f32(h[r], w.T)
            launch_head_rows(ws, b, tgt[r], inv_t[r], lse[r], ez[r], zy[r], None, None, col_start=0,
                             scale=cfg.scale, softcap=cfg.softcap, entropy=with_entropy, stats=True)
        valid = tgt >= 0
        zero = torch.zeros_like(lse)
        ent = torch.where(valid, lse - ez, zero) if with_entropy else zero
        return lse, ez, torch.where(valid, zy - lse, zero), ent

    @staticmethod
    def _grads(h, w, b, tgt, inv_t, lse, ez, g_lp, g_H, need, cfg):
        """(dh fp32, dW, db fp32). When one token chunk covers all N, each dW slice comes from a single GEMM
        and is written straight in the weight dtype (no [V, D] fp32 buffer); otherwise dW accumulates fp32."""
        n, v = h.shape[0], w.shape[0]
        rows_per, cols_per = grad_blocks(n, v, cfg.max_elements)
        one_pass = 0 < n <= rows_per
        dh, db = _zeros_f32(h.shape, need[0], h), _zeros_f32(w.shape[:1], need[2], h)
        dw = _zeros_f32(w.shape, need[1] and not one_pass, h)
        if need[1] and one_pass:
            dw = torch.empty(w.shape, device=w.device, dtype=w.dtype)
        if n == 0 or not any(need):
            return dh, dw, db
        for c0 in range(0, v, cols_per):
            c = slice(c0, min(v, c0 + cols_per))
            for r0 in range(0, n, rows_per):
                r = slice(r0, min(n, r0 + rows_per))
                ws = gemm_f32(h[r], w[c].T)
                launch_head_rows(ws, b, tgt[r], inv_t[r], lse[r], ez[r], None, g_lp[r],
                                 None if g_H is None else g_H[r], col_start=c0, scale=cfg.scale,
                                 softcap=cfg.softcap, entropy=g_H is not None, stats=False)
                if db is not None:
                    db[c] += ws.sum(0)
                d_lo = ws.to(h.dtype)  # GEMM operands in the input dtype (tensor cores), fp32 outputs
                if dh is not None:
                    addmm_acc_(dh[r], d_lo, w[c])
                if dw is not None and one_pass:
                    dw[c] = gemm_f32(d_lo.T, h[r])
                elif dw is not None:
                    addmm_acc_(dw[c], d_lo.T, h[r])
        return dh, dw, db


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
) -> tuple[Tensor, Tensor, Tensor]:
    """(logprobs, entropy, lse), fp32 [N], of the head with the Triton kernels; differentiable w.r.t.
    h2 [N, D], weight [V, D] and bias [V] for any upstream gradients of logprobs and entropy.

    Inputs are validated by `ludic_fast.ops.linear_logprobs`. Supports float16/bfloat16/float32 (mixed
    inputs are promoted); `strategy` None|'auto'|'fused'|'workspace' (see `choose_strategy`)."""
    dtype = torch.promote_types(h2.dtype, weight.dtype)
    if dtype not in _KERNEL_DTYPES:
        raise TypeError(f"hidden/weight dtype {dtype} is not supported by the triton backend (fp16, bf16, fp32)")
    n, v = h2.shape[0], weight.shape[0]
    fn = FusedHeadFunction if choose_strategy(n, v, chunk_elements, strategy) == "fused" else WorkspaceHeadFunction
    cfg = _KernelConfig.make(transform, dtype, chunk_elements)
    tgt = kernel_targets(targets, ignore_index)
    inv_t = transform.inv_temperature.to(torch.float32).reshape(n).contiguous()
    return fn.apply(h2.to(dtype), weight.to(dtype), bias, tgt, inv_t, cfg, bool(entropy))
