"""The implementations a benchmark compares, each as a builder of one forward+backward step.

A builder takes (workload, inputs whose hidden/weight are fresh leaves) and returns a zero-argument `step`
that runs forward and backward once (gradients land in `hidden.grad` / `weight.grad`) and returns the
detached per-token outputs it has (`logprobs`, `entropy`) and the scalar `loss`, for the error check.

Roles: "ours" (ludic_fast), "reference" (materialised logits as a user writes them: `F.linear` then
`ludic_fast.reference`), "peer" (Liger, TRL, verl), "floor" (bare GEMMs: 2NDV forward; 6NDV for the
forward GEMM and the two gradient GEMMs — the physical limit of any head fwd+bwd).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ludic_fast.benchmark.workloads import Inputs, Workload

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
    workload_independent: bool = False  # the floors: one measurement per shape serves every workload
    useful_ndv: int = 6  # the useful matmul work of one step in units of N*D*V (fwd+bwd: 6; forward only: 2)

    def unavailable(self, workload: Workload, device: str) -> str | None:
        """Why this implementation cannot run `workload` on `device` (None when it can)."""
        if self.cuda_only and not device.startswith("cuda"):
            return "needs CUDA"
        for mod in self.needs:
            if importlib.util.find_spec(mod) is None:
                return f"{mod} not installed"
        return self.covers(workload)


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
    return None if not workload.is_loss else "head op only"


def _every(workload: Workload) -> str | None:
    return None


def _liger_covers(workload: Workload) -> str | None:
    if not workload.is_loss:
        return "no entropy output"
    return None if workload.grpo_args is not None else f"no {workload.name} loss"


def _trl_covers(workload: Workload) -> str | None:
    return None if (not workload.is_loss or workload.grpo_args is not None) else f"no {workload.name} loss"


# ------------------------------------------------------------------------------------------ ours
def _build_ours(backend: str, fused: bool) -> Builder:
    """Head op: `linear_logprobs` + autograd. Losses: `loss_fn(batch, hidden=, weight=, fused=fused)`."""

    def build(workload: Workload, inp: Inputs) -> Step:
        from ludic_fast import linear_logprobs

        if workload.is_loss:
            loss_fn = _loss_class("ludic_fast.losses", workload.ours_loss)(**workload.loss_kwargs)

            def loss_step() -> dict[str, Tensor]:
                loss, _ = loss_fn(inp.batch, hidden=inp.hidden, weight=inp.weight, fused=fused, backend=backend)
                loss.backward()
                return _outputs(loss=loss)

            return loss_step

        def head_step() -> dict[str, Tensor]:
            out = linear_logprobs(inp.hidden, inp.weight, inp.targets, entropy=True, backend=backend)
            _head_objective(inp, out.logprobs, out.entropy).backward()
            return _outputs(out.logprobs, out.entropy)

        return head_step

    return build


def _loss_class(module: str, name: str):
    return getattr(importlib.import_module(module), name)


def _ours_covers(workload: Workload) -> str | None:
    if workload.is_loss and not hasattr(importlib.import_module("ludic_fast.losses"), workload.ours_loss):
        return f"ludic_fast.losses has no {workload.ours_loss}"
    return None


def _ours_fused_covers(workload: Workload) -> str | None:
    return _ours_covers(workload) if workload.is_loss else "the head op has no loss to fuse (see ours-generic)"


# ------------------------------------------------------------------------------------------ reference
def reference_loss(workload: Workload):
    """The workload's loss on materialised logits: `ludic_fast.reference`'s class, or, for losses the spec
    does not have (ZVP-CISPO), the logits path of `ludic_fast.losses` (`loss_fn(batch, logits=...)`)."""
    from ludic_fast import reference

    module = "ludic_fast.reference" if hasattr(reference, workload.reference_loss) else "ludic_fast.losses"
    return _loss_class(module, workload.reference_loss)(**workload.loss_kwargs)


def _build_reference(workload: Workload, inp: Inputs) -> Step:
    from ludic_fast import reference

    if not workload.is_loss:

        def head_step() -> dict[str, Tensor]:
            out = reference.logprobs_from_logits(F.linear(inp.hidden, inp.weight), inp.targets)
            _head_objective(inp, out.logprobs, out.entropy).backward()
            return _outputs(out.logprobs, out.entropy)

        return head_step
    loss_fn = reference_loss(workload)

    def loss_step() -> dict[str, Tensor]:
        loss, _ = loss_fn(inp.batch, logits=F.linear(inp.hidden, inp.weight))
        loss.backward()
        return _outputs(loss=loss)

    return loss_step


# ------------------------------------------------------------------------------------------ peers
def _build_liger(workload: Workload, inp: Inputs) -> Step:
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    # compiled=False: torch.compile only touches Liger's O(N) loss math and costs ~40 s per shape on CPU
    loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, compiled=False, **workload.grpo_args)
    h, y, mask = _shifted(inp)
    old = inp.batch["actor_logps"][:, 1:]

    def step() -> dict[str, Tensor]:
        loss, _ = loss_fn(h, inp.weight, y, mask, inp.batch["weight"], old_per_token_logps=old)
        loss.backward()
        return _outputs(loss=loss)

    return step


def trl_policy_loss(lp: Tensor, batch: dict[str, Tensor], args: dict) -> Tensor:
    """TRL 1.16's GRPO-family loss on per-token logprobs lp [B, T-1] (ref/trl-1.16-grpo.md), one process,
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


def _build_trl(workload: Workload, inp: Inputs) -> Step:
    from trl.kernels import ChunkedLogProbFunction

    def head(h: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        lp, ent, *_ = ChunkedLogProbFunction.apply(
            h, inp.weight, None, y, 1.0, TRL_VOCAB_CHUNK, None, 1.0, ("entropy",)
        )
        return lp, ent

    if not workload.is_loss:

        def head_step() -> dict[str, Tensor]:
            lp, ent = head(inp.hidden, inp.targets)
            _head_objective(inp, lp, ent).backward()
            return _outputs(lp, ent)

        return head_step
    h, y, mask = _shifted(inp)

    def loss_step() -> dict[str, Tensor]:
        # off Triton devices TRL scores every position and zeroes the masked ones afterwards
        lp, _ = head(h.reshape(-1, h.shape[-1]), y.reshape(-1))
        lp = lp.view(mask.shape).masked_fill(mask == 0, 0.0)
        loss = trl_policy_loss(lp, inp.batch, workload.grpo_args)
        loss.backward()
        return _outputs(loss=loss)

    return loss_step


def _build_verl(workload: Workload, inp: Inputs) -> Step:
    from verl.utils.experimental.torch_functional import FusedLinearForPPO

    fused = FusedLinearForPPO()

    def step() -> dict[str, Tensor]:
        lp, ent = fused(inp.hidden, inp.weight, inp.targets, temperature=1.0)
        _head_objective(inp, lp, ent).backward()
        return _outputs(lp, ent)

    return step


# ------------------------------------------------------------------------------------------ floors
def _flat(inp: Inputs) -> Tensor:
    return inp.hidden.reshape(-1, inp.hidden.shape[-1])


def _build_gemm_fwd_bwd(workload: Workload, inp: Inputs) -> Step:
    """z = h W^T (the logits, 2NDV); then z stands in for dL/dz: dh = z W, dW = z^T h (4NDV)."""

    def step() -> dict[str, Tensor]:
        with torch.no_grad():
            h = _flat(inp)
            z = h @ inp.weight.T
            inp.hidden.grad = (z @ inp.weight).view_as(inp.hidden)
            inp.weight.grad = z.T @ h
        return {}

    return step


def _build_gemm_fwd(workload: Workload, inp: Inputs) -> Step:
    def step() -> dict[str, Tensor]:
        with torch.no_grad():
            _flat(inp) @ inp.weight.T
        return {}

    return step


IMPLS: dict[str, Impl] = {
    i.name: i
    for i in (
        Impl("ours-fused", "ours", "ludic_fast.losses, hidden=/weight= (fused-loss mode: 6NDV, coupled 8NDV)",
             _build_ours("torch", fused=True), _ours_fused_covers),
        Impl("ours-generic", "ours", "ludic_fast.linear_logprobs (torch backend) + autograd (8NDV)",
             _build_ours("torch", fused=False), _ours_covers),
        Impl("ours-triton", "ours", "ludic_fast.linear_logprobs, triton backend + autograd",
             _build_ours("triton", fused=False), _ours_covers, cuda_only=True),
        Impl("reference", "reference", "F.linear logits [N, V] + ludic_fast.reference", _build_reference,
             _every),
        Impl("liger", "peer", "Liger LigerFusedLinearGRPOLoss (chunked, torch ops)", _build_liger,
             _liger_covers, needs=("liger_kernel",)),
        Impl("trl", "peer", "TRL 1.16 trl.kernels.ChunkedLogProbFunction (+ TRL's loss math)", _build_trl,
             _trl_covers, needs=("trl",)),
        Impl("verl", "peer", "verl FusedLinearForPPO (torch)", _build_verl, _head_only, needs=("verl",)),
        Impl("gemm-fwd+bwd", "floor", "bare GEMMs z=hW^T, dh=zW, dW=z^T h (6NDV)", _build_gemm_fwd_bwd, _every,
             workload_independent=True),
        Impl("gemm-fwd", "floor", "bare forward GEMM z=hW^T (2NDV)", _build_gemm_fwd, _every,
             workload_independent=True, useful_ndv=2),
    )
}

FLOOR = "gemm-fwd+bwd"

#: Modules the builders import. The worker imports every installed one before measuring, so each process
#: carries the same runtime and peak-RSS figures compare the implementations, not their imports.
PRELOAD = ("ludic_fast.losses", "liger_kernel.chunked_loss", "trl.kernels", "trl.trainer.utils",
    "verl.utils.experimental.torch_functional")


def preload() -> None:
    """Import every installed module of `PRELOAD`."""
    for mod in PRELOAD:
        if importlib.util.find_spec(mod.split(".")[0]) is not None:
            importlib.import_module(mod)


def get_impl(name: str) -> Impl:
    if name not in IMPLS:
        raise ValueError(f"implementation must be one of {sorted(IMPLS)}, got {name!r}")
    return IMPLS[name]
