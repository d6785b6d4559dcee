"""The implementations a benchmark compares, each as a builder of one forward+backward step.

A builder takes (workload, inputs whose hidden/weight are fresh leaves) and returns a zero-argument `step`
that runs forward and backward once (gradients land in `hidden.grad` / `weight.grad`) and returns the
detached per-token outputs it has (`logprobs`, `entropy`) and the scalar `loss`, for the error check.

Roles: "ours" (ludic_fast through its public API; `ours-fused` / `ours-generic` are what a user gets, with
backend "auto": triton on CUDA, torch on CPU; the others force one backend or triton strategy), "reference"
(materialised logits as a user writes them: `F.linear` then `ludic_fast.reference`), "peer" (Liger, TRL,
verl, torch's and Apple's linear cross-entropy), "floor" (bare GEMMs: 2NDV forward; 6NDV for the forward
GEMM and the two gradient GEMMs — the physical limit of any head fwd+bwd).

Rows: every implementation scores the rows the workload needs where its API allows (`Impl.rows`): ours
and TRL the action positions of an RL batch; Liger's GRPO and preference losses take the [B, T-1] batch and
score every position; the reference materialises logits for all B*T positions.

Preference pairs (dpo, orpo): ours through `ludic_fast.losses` on the pair batch; Liger's chunked
`LigerFusedLinearDPOLoss` / `LigerFusedLinearORPOLoss` (chunk_size 1: one pair per chunk) on the same rows
reordered as Liger wants them ([chosen; rejected]), prompt tokens as ignore_index. Distillation (jsd): ours
`ludic_fast.linear_divergence`; Liger's chunked `LigerFusedLinearJSDLoss`; TRL's
`trl.kernels.chunked_divergence.ChunkedDivergenceFunction` (its token mean); the reference
`ludic_fast.reference.linear_divergence` (both [N, V] logits materialised).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ludic_fast.benchmark.workloads import Inputs, Shape, Workload

Step = Callable[[], dict[str, Tensor]]
Builder = Callable[[Workload, Inputs], Step]

#: TRL 1.16's vocabulary tile width for ChunkedLogProbFunction (`trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE`).
TRL_VOCAB_CHUNK = 32768


@dataclass(frozen=True)
class Impl:
    """A named implementation: its role, which workloads it covers, and why it may be unavailable."""

    name: str
    role: str
    description: str
    build: Builder
    covers: Callable[[Workload], str | None]  # None when the workload is covered, else the reason
    needs: tuple[str, ...] = ()  # packages that must be installed
    cuda_only: bool = False
    workload_independent: bool = False  # the floors: one measurement per (shape, scored rows) serves every workload
    useful_ndv: int = 6  # the useful matmul work of one step in units of N*D*V (fwd+bwd: 6; forward only: 2)
    rows: str = "scored"  # RL batches: "scored" (action rows), "shifted" (all B*(T-1)), "all" (all B*T)
    cuda_reason: str = "needs CUDA"
    cuda_kinds: tuple[str, ...] = ()  # workload kinds this implementation runs on CUDA only
    available: Callable[[], str | None] = lambda: None  # an installed-feature check (None: available)

    def unavailable(self, workload: Workload, device: str) -> str | None:
        """Why this implementation cannot run `workload` on `device` (None when it can)."""
        if (self.cuda_only or workload.kind in self.cuda_kinds) and not device.startswith("cuda"):
            return self.cuda_reason
        for mod in self.needs:
            if importlib.util.find_spec(mod) is None:
                return f"{mod} not installed"
        return self.available() or self.covers(workload)

    def rows_computed(self, workload: Workload, shape: Shape) -> int:
        """Rows this implementation pushes through the head for `workload` at `shape`."""
        if not workload.is_loss or self.rows == "scored":
            return workload.scored_rows(shape)
        b, t = workload.layout(shape)
        return b * (t - (1 if self.rows == "shifted" else 0))


# ------------------------------------------------------------------------------------------ helpers
def _head_objective(inp: Inputs, lp: Tensor, ent: Tensor) -> Tensor:
    return (lp * inp.g_lp).sum() + (ent * inp.g_h).sum()


def _outputs(lp: Tensor | None = None, ent: Tensor | None = None, loss: Tensor | None = None) -> dict[str, Tensor]:
    named = {"logprobs": lp, "entropy": ent, "loss": loss}
    return {k: v.detach() for k, v in named.items() if v is not None}


def _shifted(inp: Inputs) -> tuple[Tensor, Tensor, Tensor]:
    """(hidden rows that score a token [B, T-1, D], their targets [B, T-1], loss mask [B, T-1] float)."""
    return inp.hidden[:, :-1], inp.targets[:, 1:], inp.batch["action_mask"][:, 1:].float()


def _head_only(workload: Workload) -> str | None:
    return None if workload.kind == "head" else "head op only"


def _ce_only(workload: Workload) -> str | None:
    return None if workload.kind == "ce" else "cross-entropy only"


def _every(workload: Workload) -> str | None:
    return None


def _liger_covers(workload: Workload) -> str | None:
    if workload.kind == "head":
        return "no entropy output"
    covered = workload.kind == "ce" or workload.grpo_args is not None or workload.liger_loss is not None
    return None if covered else f"no {workload.name} loss"


def _trl_covers(workload: Workload) -> str | None:
    if workload.kind == "pair" and workload.name != "dpo":  # TRL's ORPO runs on materialised logits
        return f"no chunked {workload.name} loss"
    return None if (workload.kind != "rl" or workload.grpo_args is not None) else f"no {workload.name} loss"


@contextlib.contextmanager
def _strategy(strategy: str | None, tma: bool = False) -> Iterator[None]:
    """Force the triton strategy (the documented LUDIC_FAST_TRITON_STRATEGY switch) and, with `tma`, the tl.dot
    kernels' TMA variant (LUDIC_FAST_TMA=1) for one call."""
    forced = {} if strategy is None else {"LUDIC_FAST_TRITON_STRATEGY": strategy}
    if tma:
        forced["LUDIC_FAST_TMA"] = "1"
    old = {name: os.environ.get(name) for name in forced}
    os.environ.update(forced)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


# ------------------------------------------------------------------------------------------ ours
def _build_ours(backend: str, fused: bool, strategy: str | None = None, tma: bool = False,
                hold_logits: bool = False) -> Builder:
    """Head op: `linear_logprobs` + autograd. SFT: `linear_cross_entropy`. Losses:
    `loss_fn(batch, hidden=, weight=, fused=fused, backend=backend)`. `strategy` forces the triton one, `tma`
    the tl.dot kernels' TMA variant; `hold_logits`: the head op's memory_budget is 4 N V bytes, the fp32 logits
    of all N rows, which the workspace plan then holds from its forward to its backward."""

    def build(workload: Workload, inp: Inputs) -> Step:
        from ludic_fast import linear_cross_entropy, linear_divergence, linear_logprobs

        if workload.kind == "distill":
            h_t, w_t = inp.teacher

            def distill_step() -> dict[str, Tensor]:
                loss = linear_divergence(inp.hidden, inp.weight, h_t, w_t, backend=backend, **workload.loss_kwargs)
                loss.backward()
                return _outputs(loss=loss)

            return distill_step
        if workload.is_loss:
            loss_fn = _loss_class("ludic_fast.losses", workload.ours_loss)(**workload.loss_kwargs)

            def loss_step() -> dict[str, Tensor]:
                with _strategy(strategy, tma):
                    loss, _ = loss_fn(inp.batch, hidden=inp.hidden, weight=inp.weight, fused=fused,
                                      backend=backend)
                    loss.backward()
                return _outputs(loss=loss)

            return loss_step
        if workload.kind == "ce":

            def ce_step() -> dict[str, Tensor]:
                with _strategy(strategy, tma):
                    loss = linear_cross_entropy(inp.hidden, inp.weight, inp.targets, backend=backend)
                    loss.backward()
                return _outputs(loss=loss)

            return ce_step

        budget = 4 * inp.targets.numel() * inp.weight.shape[0] if hold_logits else None

        def head_step() -> dict[str, Tensor]:
            with _strategy(strategy, tma):
                out = linear_logprobs(inp.hidden, inp.weight, inp.targets, entropy=True, backend=backend,
                                      memory_budget=budget)
                _head_objective(inp, out.logprobs, out.entropy).backward()
            return _outputs(out.logprobs, out.entropy)

        return head_step

    return build


def _loss_class(module: str, name: str):
    return getattr(importlib.import_module(module), name)


def _ours_covers(workload: Workload) -> str | None:
    if workload.kind == "distill":
        return "linear_divergence has one mode (see ours-fused)"
    if workload.is_loss and not hasattr(importlib.import_module("ludic_fast.losses"), workload.ours_loss):
        return f"ludic_fast.losses has no {workload.ours_loss}"
    return None


def _ours_fused_covers(workload: Workload) -> str | None:
    if workload.kind == "distill":
        return None
    if not workload.is_loss:
        return f"the {workload.name} workload is linear_logprobs / linear_cross_entropy (see ours-generic)"
    return _ours_covers(workload)


# ------------------------------------------------------------------------------------------ reference
def reference_loss(workload: Workload):
    """The workload's loss on materialised logits: `ludic_fast.reference`'s class, or, for losses the spec
    does not have (ZVP-CISPO), the logits path of `ludic_fast.losses` (`loss_fn(batch, logits=...)`)."""
    from ludic_fast import reference

    module = "ludic_fast.reference" if hasattr(reference, workload.reference_loss) else "ludic_fast.losses"
    return _loss_class(module, workload.reference_loss)(**workload.loss_kwargs)


def _build_reference(workload: Workload, inp: Inputs) -> Step:
    from ludic_fast import reference

    if workload.kind == "head":

        def head_step() -> dict[str, Tensor]:
            out = reference.logprobs_from_logits(F.linear(inp.hidden, inp.weight), inp.targets)
            _head_objective(inp, out.logprobs, out.entropy).backward()
            return _outputs(out.logprobs, out.entropy)

        return head_step
    if workload.kind == "ce":

        def ce_step() -> dict[str, Tensor]:
            loss = F.cross_entropy(F.linear(inp.hidden, inp.weight).float(), inp.targets)
            loss.backward()
            return _outputs(loss=loss)

        return ce_step
    if workload.kind == "distill":
        h_t, w_t = inp.teacher

        def distill_step() -> dict[str, Tensor]:
            loss = reference.linear_divergence(inp.hidden, inp.weight, h_t, w_t, **workload.loss_kwargs)
            loss.backward()
            return _outputs(loss=loss)

        return distill_step
    loss_fn = reference_loss(workload)

    def loss_step() -> dict[str, Tensor]:
        loss, _ = loss_fn(inp.batch, logits=F.linear(inp.hidden, inp.weight))
        loss.backward()
        return _outputs(loss=loss)

    return loss_step


# ------------------------------------------------------------------------------------------ peers
def _build_liger(workload: Workload, inp: Inputs) -> Step:
    """GRPO family: `LigerFusedLinearGRPOLoss` on the [B, T-1] batch (it scores every position). SFT:
    `LigerFusedLinearCrossEntropyLoss`. torch.compile as Liger ships it on CUDA; off on CPU, where it only
    touches Liger's O(N) loss math and costs ~40 s per shape."""
    compiled = inp.hidden.is_cuda
    if workload.kind == "ce":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        ce = LigerFusedLinearCrossEntropyLoss()

        def ce_step() -> dict[str, Tensor]:
            loss = ce(inp.weight, inp.hidden, inp.targets)
            loss.backward()
            return _outputs(loss=loss)

        return ce_step
    if workload.liger_loss is not None:
        return _build_liger_chunked(workload, inp, compiled)
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, compiled=compiled, **workload.grpo_args)
    h, y, mask = _shifted(inp)
    old = inp.batch["actor_logps"][:, 1:]

    def step() -> dict[str, Tensor]:
        loss, _ = loss_fn(h, inp.weight, y, mask, inp.batch["weight"], old_per_token_logps=old)
        loss.backward()
        return _outputs(loss=loss)

    return step


def _build_liger_chunked(workload: Workload, inp: Inputs, compiled: bool) -> Step:
    """Liger's chunked preference loss (one pair per chunk) on [chosen; rejected] rows of the [B, T-1] batch,
    prompt positions ignore_index; or its chunked JSD on the distillation rows."""
    import liger_kernel.chunked_loss as chunked

    cls = getattr(chunked, workload.liger_loss)
    if workload.kind == "distill":
        loss_fn = cls(compiled=compiled, **workload.liger_kwargs)
        h_t, w_t = inp.teacher
        labels = torch.zeros(inp.hidden.shape[0], dtype=torch.long, device=inp.hidden.device)  # no hard loss

        def distill_step() -> dict[str, Tensor]:
            loss = loss_fn(inp.hidden, inp.weight, h_t, w_t, labels)
            loss.backward()
            return _outputs(loss=loss)

        return distill_step
    loss_fn = cls(compiled=compiled, chunk_size=1, **workload.liger_kwargs)
    b = inp.hidden.shape[0]
    order = torch.cat([torch.arange(0, b, 2), torch.arange(1, b, 2)]).to(inp.hidden.device)
    _, y, mask = _shifted(inp)
    target = torch.where(mask > 0, y, -100)[order]

    def step() -> dict[str, Tensor]:
        out = loss_fn(inp.weight, inp.hidden[:, :-1][order], target)
        loss = out[0] if isinstance(out, tuple) else out
        loss.backward()
        return _outputs(loss=loss)

    return step


def trl_policy_loss(lp: Tensor, batch: dict[str, Tensor], args: dict) -> Tensor:
    """TRL 1.16's GRPO-family loss on per-token logprobs lp [B, T-1] (huggingface/trl v1.16 GRPOTrainer), one process,
    no gradient accumulation: r = exp(lp - old) (sequence level: exp of the masked mean log-ratio);
    cispo: -sg(min(r, eps_high)) A lp normalised by the batch's loss tokens; grpo: -min(rA, clip(r)A),
    the mean over rows of each row's masked token mean."""
    mask = batch["action_mask"][:, 1:].to(lp.dtype)
    adv = batch["weight"].to(lp.dtype)[:, None]
    log_ratio = lp - batch["actor_logps"][:, 1:].to(lp.dtype)
    if args.get("importance_sampling_level", "token") == "sequence":
        log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    ratio = log_ratio.exp()
    if args["loss_type"] == "cispo":
        per_token = -ratio.clamp(max=args["epsilon_high"]).detach() * adv * lp
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    clipped = ratio.clamp(1 - args.get("epsilon_low", 0.2), 1 + args.get("epsilon_high", 0.2))
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


#: the per-token outputs TRL 1.16's DPOTrainer asks its fused head for (without WPO weighting)
TRL_DPO_OUTPUTS = ("entropy", "mean_logits", "is_top1")


def trl_dpo_loss(lp: Tensor, batch: dict[str, Tensor], beta: float) -> Tensor:
    """TRL 1.16's sigmoid DPO loss with precomputed reference sums (`precompute_ref_log_probs`) on per-token
    logprobs lp [B, T-1] (zero off the completion): -mean log σ(β[(L_w - R_w) - (L_l - R_l)]), rows 2i / 2i+1
    the chosen / rejected responses of pair i."""
    ratio = lp.sum(-1) - batch["ref_seq_logps"].to(lp.dtype)
    return -torch.nn.functional.logsigmoid(beta * (ratio[0::2] - ratio[1::2])).mean()


def _build_trl(workload: Workload, inp: Inputs) -> Step:
    """`ChunkedLogProbFunction` (TRL's head): the head op with entropy; SFT as -mean logprob; jsd through
    TRL's `ChunkedDivergenceFunction` (per-token divergences, their mean); the GRPO family and DPO on the action
    rows only (gathered inside the step, as ours selects them inside its call, as TRL's head does on Triton
    devices), its logprobs scattered back to [B, T-1] for TRL's loss math (DPO with the outputs DPOTrainer
    requests: entropy, mean logits, top-1)."""
    if workload.kind == "distill":
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

        h_t, w_t = inp.teacher
        beta, temperature = workload.loss_kwargs["beta"], workload.loss_kwargs.get("temperature", 1.0)

        def distill_step() -> dict[str, Tensor]:
            loss = ChunkedDivergenceFunction.apply(inp.hidden, inp.weight, None, h_t, w_t, None, beta,
                                                   temperature)[0].mean()
            loss.backward()
            return _outputs(loss=loss)

        return distill_step
    from trl.kernels import ChunkedLogProbFunction

    def head(h: Tensor, y: Tensor, outputs: tuple[str, ...] = ("entropy",)) -> tuple[Tensor, Tensor]:
        lp, ent, *_ = ChunkedLogProbFunction.apply(h, inp.weight, None, y, 1.0, TRL_VOCAB_CHUNK, None, 1.0, outputs)
        return lp, ent

    if workload.kind == "head":

        def head_step() -> dict[str, Tensor]:
            lp, ent = head(inp.hidden, inp.targets)
            _head_objective(inp, lp, ent).backward()
            return _outputs(lp, ent)

        return head_step
    if workload.kind == "ce":

        def ce_step() -> dict[str, Tensor]:
            lp, _ = head(inp.hidden, inp.targets, ())
            loss = -lp.mean()
            loss.backward()
            return _outputs(loss=loss)

        return ce_step
    h, y, mask = _shifted(inp)
    pair = workload.kind == "pair"

    def loss_step() -> dict[str, Tensor]:
        keep = mask.reshape(-1) > 0
        lp_rows, _ = head(h.reshape(-1, h.shape[-1])[keep], y.reshape(-1)[keep], TRL_DPO_OUTPUTS if pair else ())
        lp = torch.zeros(mask.shape, dtype=lp_rows.dtype, device=lp_rows.device).masked_scatter(mask > 0, lp_rows)
        if pair:
            loss = trl_dpo_loss(lp, inp.batch, workload.loss_kwargs["beta"])
        else:
            loss = trl_policy_loss(lp, inp.batch, workload.grpo_args)
        loss.backward()
        return _outputs(loss=loss)

    return loss_step


def _torch_lce_available() -> str | None:
    if not hasattr(F, "linear_cross_entropy") or not hasattr(torch.nn, "LinearCrossEntropyOptions"):
        return f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy (PyTorch >= 2.13)"
    return None


def _build_torch_lce(workload: Workload, inp: Inputs) -> Step:
    """PyTorch's chunked `F.linear_cross_entropy` (options=LinearCrossEntropyOptions(): its auto policy)."""
    options = torch.nn.LinearCrossEntropyOptions()

    def step() -> dict[str, Tensor]:
        loss = F.linear_cross_entropy(inp.hidden, inp.weight, inp.targets, options=options)
        loss.backward()
        return _outputs(loss=loss)

    return step


def _build_cce(workload: Workload, inp: Inputs) -> Step:
    """Apple's Cut Cross-Entropy (`cut_cross_entropy.linear_cross_entropy`, its defaults: impl "cce",
    gradient filtering filter_eps="high")."""
    from cut_cross_entropy import linear_cross_entropy

    def step() -> dict[str, Tensor]:
        loss = linear_cross_entropy(inp.hidden, inp.weight, inp.targets)
        loss.backward()
        return _outputs(loss=loss)

    return step


def _build_verl(workload: Workload, inp: Inputs) -> Step:
    from verl.utils.experimental.torch_functional import FusedLinearForPPO

    fused = FusedLinearForPPO()

    def step() -> dict[str, Tensor]:
        lp, ent = fused(inp.hidden, inp.weight, inp.targets, temperature=1.0)
        _head_objective(inp, lp, ent).backward()
        return _outputs(lp, ent)

    return step


# ------------------------------------------------------------------------------------------ floors
def _rows(workload: Workload, inp: Inputs) -> Tensor:
    """The hidden rows the workload scores: all N of a row workload, the action rows of an RL batch (taken
    once at build time: the floor is the bare GEMMs of those rows)."""
    if not workload.is_loss:
        return inp.hidden
    h, _, mask = _shifted(inp)
    return h.reshape(-1, h.shape[-1])[mask.reshape(-1) > 0].detach()


def _build_gemm_fwd_bwd(workload: Workload, inp: Inputs) -> Step:
    """z = h W^T (the logits, 2NDV); then z stands in for dL/dz: dh = z W, dW = z^T h (4NDV)."""
    h = _rows(workload, inp)

    def step() -> dict[str, Tensor]:
        with torch.no_grad():
            z = h @ inp.weight.T
            z @ inp.weight  # dh
            z.T @ h  # dW
        return {}

    return step


def _build_gemm_fwd(workload: Workload, inp: Inputs) -> Step:
    h = _rows(workload, inp)

    def step() -> dict[str, Tensor]:
        with torch.no_grad():
            h @ inp.weight.T
        return {}

    return step


IMPLS: dict[str, Impl] = {
    i.name: i
    for i in (
        Impl("ours-fused", "ours", "ludic_fast.losses, hidden=/weight= (fused-loss mode, backend auto: 6NDV, "
             "coupled 8NDV): what a loss user gets", _build_ours("auto", fused=True), _ours_fused_covers),
        Impl("ours-generic", "ours", "ludic_fast.linear_logprobs / linear_cross_entropy + autograd (backend auto); "
             "losses with fused=False (8NDV)", _build_ours("auto", fused=False), _ours_covers),
        # each strategy forced: the head op's (row workloads, losses in generic mode), then the fused-loss mode's
        Impl("ours-generic-held", "ours", "as ours-generic (head op) with memory_budget = 4 N V bytes: the "
             "workspace plan holds the forward's fp32 logits for the backward (6NDV)",
             _build_ours("auto", fused=False, hold_logits=True), _head_only, cuda_only=True,
             cuda_reason="needs CUDA: the held logits are the triton workspace plan's (CPU's auto backend is torch)"),
        Impl("ours-triton-fused", "ours", "as ours-generic, triton backend, fused strategy forced (tl.dot tiles, "
             "no workspace)", _build_ours("triton", fused=False, strategy="fused"), _ours_covers, cuda_only=True),
        Impl("ours-triton-fused-tma", "ours", "as ours-triton-fused with the tl.dot kernels' TMA variant "
             "(LUDIC_FAST_TMA=1: descriptor loads, flattened/persistent tile loops; bf16/fp16 on sm_90+)",
             _build_ours("triton", fused=False, strategy="fused", tma=True), _ours_covers, cuda_only=True),
        Impl("ours-triton-workspace", "ours", "as ours-generic, triton backend, workspace strategy forced "
             "(cuBLAS GEMM chunks + Triton row kernel)", _build_ours("triton", fused=False, strategy="workspace"),
             _ours_covers, cuda_only=True),
        Impl("ours-fused-tl-dot", "ours", "as ours-fused, triton backend, fused strategy forced (tl.dot "
             "statistics and d(raw) recompute, no fp32 workspace: 8NDV)",
             _build_ours("triton", fused=True, strategy="fused"), _ours_fused_covers, cuda_only=True),
        Impl("ours-fused-tl-dot-tma", "ours", "as ours-fused-tl-dot with the tl.dot kernels' TMA variant "
             "(LUDIC_FAST_TMA=1; bf16/fp16 on sm_90+)",
             _build_ours("triton", fused=True, strategy="fused", tma=True), _ours_fused_covers, cuda_only=True),
        Impl("ours-fused-workspace", "ours", "as ours-fused, triton backend, workspace strategy forced (cuBLAS "
             "GEMM chunks + Triton row kernel: 6NDV)", _build_ours("triton", fused=True, strategy="workspace"),
             _ours_fused_covers, cuda_only=True),
        Impl("ours-torch", "ours", "the user's default call (as ours-fused / ours-generic) on the torch backend",
             _build_ours("torch", fused=True), _ours_covers, cuda_only=True,
             cuda_reason="on CPU backend auto is torch: ours-fused / ours-generic are this"),
        Impl("reference", "reference", "F.linear logits [N, V] + ludic_fast.reference", _build_reference,
             _every, rows="all"),
        Impl("liger", "peer", "Liger LigerFusedLinearGRPOLoss / LigerFusedLinearCrossEntropyLoss (chunked; "
             "the GRPO loss scores every position of [B, T-1])", _build_liger, _liger_covers,
             needs=("liger_kernel",), rows="shifted", cuda_kinds=("ce",),
             cuda_reason="Liger's fused linear cross-entropy is a Triton kernel: needs CUDA"),
        Impl("trl", "peer", "TRL trl.kernels.ChunkedLogProbFunction on the scored rows (+ TRL's loss math)",
             _build_trl, _trl_covers, needs=("trl",)),
        Impl("verl", "peer", "verl FusedLinearForPPO (torch)", _build_verl, _head_only, needs=("verl",)),
        Impl("torch-lce", "peer", "torch.nn.functional.linear_cross_entropy, chunked (LinearCrossEntropyOptions())",
             _build_torch_lce, _ce_only, available=_torch_lce_available),
        Impl("cce", "peer", "Apple Cut Cross-Entropy cut_cross_entropy.linear_cross_entropy (defaults)",
             _build_cce, _ce_only, needs=("cut_cross_entropy",), cuda_only=True),
        Impl("gemm-fwd+bwd", "floor", "bare GEMMs z=hW^T, dh=zW, dW=z^T h (6NDV)", _build_gemm_fwd_bwd, _every,
             workload_independent=True),
        Impl("gemm-fwd", "floor", "bare forward GEMM z=hW^T (2NDV)", _build_gemm_fwd, _every,
             workload_independent=True, useful_ndv=2),
    )
}

FLOOR = "gemm-fwd+bwd"

#: Modules the builders import. The worker imports every installed one before measuring, so each process
#: carries the same runtime and peak-RSS figures compare the implementations, not their imports.
PRELOAD = ("ludic_fast.losses", "liger_kernel.chunked_loss", "liger_kernel.transformers",
           "trl.kernels", "trl.kernels.chunked_divergence", "trl.trainer.utils",
           "verl.utils.experimental.torch_functional", "cut_cross_entropy")


def preload() -> None:
    """Import every installed module of `PRELOAD`."""
    for mod in PRELOAD:
        if importlib.util.find_spec(mod.split(".")[0]) is not None:
            with contextlib.suppress(ModuleNotFoundError):  # an older peer without that module
                importlib.import_module(mod)


def get_impl(name: str) -> Impl:
    if name not in IMPLS:
        raise ValueError(f"implementation must be one of {sorted(IMPLS)}, got {name!r}")
    return IMPLS[name]
