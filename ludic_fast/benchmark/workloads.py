"""Benchmark workloads: shapes, deterministic inputs, and the float64 reference of each workload.

A workload is one of the head op (per-token logprob + entropy with fixed random upstream gradients,
objective `sum_t g_lp[t] logprob_t + g_H[t] H_t`), the SFT cross-entropy (mean over tokens of -log p(y_t),
on the same [N, D] rows), an RL policy loss in Ludic's batch layout (position t of `hidden` scores token
t+1; only action positions are scored), a preference loss on pairs in the same layout (kind "pair": an even
number of sequences, 2i chosen and 2i+1 rejected; reference-model log-probs 0, as Liger's
`use_ref_model=False`), or a distillation divergence (kind "distill": N student rows [N, D] against N teacher
rows of a second head [V, D], no [N, V] logits kept). Every implementation of a workload computes the same
numbers: the batch is built so that the peers' normalisers (Liger's and TRL's token mean over the batch)
equal Ludic's (every sequence has the same number of action tokens).

Inputs are a pure function of (shape, seed): hidden ~ N(0, 1), weight ~ N(0, s^2 / D) so logits are
~N(0, s^2) with s = `LOGIT_STD`; behaviour logprobs `actor_logps` are the target logit minus the Gaussian
log-partition `log V + s^2 / 2`, plus N(0, 0.02^2) noise, so importance ratios sit near 1 (a few clip).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

LOGIT_STD = 2.0
ACTOR_NOISE = 0.02
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Shape:
    """N tokens of hidden size D against a vocabulary of V, cut into sequences of about `seq_len` tokens.

    Loss workloads use B = max(1, round(N / seq_len)) sequences of T = N // B tokens (pair workloads an
    even B: `Workload.layout`), so `n_tokens` (= B * T) can be a little below the requested N when N is not
    a multiple of B. Their prompt is the first quarter of each sequence; with `same_rows` the first token
    only, so the rows to score are all B * (T - 1) shifted positions: the rows Liger's [B, T] losses
    compute, and every implementation scores the same rows."""

    n: int
    d: int
    v: int
    dtype: str = "float32"
    seq_len: int = 512
    same_rows: bool = False

    def __post_init__(self) -> None:
        for name in ("n", "d", "v", "seq_len"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"Shape.{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"Shape.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.batch_size * self.seq_tokens < 2 or self.seq_tokens < 2:
            raise ValueError(f"Shape needs sequences of >= 2 tokens, got n={self.n}, seq_len={self.seq_len}")

    @property
    def batch_size(self) -> int:
        return max(1, round(self.n / self.seq_len))

    @property
    def seq_tokens(self) -> int:
        return self.n // self.batch_size

    @property
    def n_tokens(self) -> int:
        return self.batch_size * self.seq_tokens

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def label(self) -> str:
        return f"N={self.n_tokens} D={self.d} V={self.v} {self.dtype}" + (", same rows" if self.same_rows else "")


@dataclass(frozen=True)
class Workload:
    """One benchmarked computation. `reference_loss` names the loss class of `ludic_fast.reference` (None
    for the head op) and `loss_kwargs` its constructor arguments (shared with ours); `ours_loss` the class
    of `ludic_fast.losses`; `grpo_args` the arguments of TRL 1.16's GRPOConfig / Liger's
    `LigerFusedLinearGRPOLoss` (they share the names) that give the same loss (None: neither has it)."""

    name: str
    description: str
    # "head" (the head op), "ce" (SFT cross-entropy on rows), "rl" (a loss on a Ludic batch), "pair" (a
    # preference loss on a pair batch) or "distill" (linear_divergence on rows)
    kind: str = "rl"
    reference_loss: str | None = None
    loss_kwargs: dict[str, Any] = field(default_factory=dict)
    ours_loss: str | None = None
    grpo_args: dict[str, Any] | None = None
    liger_loss: str | None = None  # the pair / distill workloads: Liger's chunked class and its arguments
    liger_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def is_loss(self) -> bool:
        """A loss on a batch of sequences ([B, T, D] hidden: RL or pair); False for the row workloads (head
        op, SFT CE, distillation)."""
        return self.kind in ("rl", "pair")

    def layout(self, shape: Shape) -> tuple[int, int]:
        """(sequences B, tokens per sequence T) of a loss batch: the shape's, with B rounded to an even
        count (>= 2) for pair workloads, T = N // B."""
        if self.kind != "pair":
            return shape.batch_size, shape.seq_tokens
        b = 2 * max(1, round(shape.n / (2 * shape.seq_len)))
        if shape.n // b < 2:
            raise ValueError(f"pair workload {self.name} needs >= 2 tokens per sequence, got n={shape.n}, B={b}")
        return b, shape.n // b

    def scored_rows(self, shape: Shape) -> int:
        """Rows the workload needs scored: every token of the row workloads; the action positions of a loss
        batch (positions 1..T-1 whose next token is an action: T - prompt per sequence)."""
        if not self.is_loss:
            return shape.n_tokens
        b, t = self.layout(shape)
        return b * (t - prompt_tokens(t, shape.same_rows))


def prompt_tokens(seq_tokens: int, same_rows: bool = False) -> int:
    """The prompt length of each benchmark sequence: the first quarter (at least one token); with
    `same_rows` one token."""
    return 1 if same_rows else max(1, seq_tokens // 4)


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("head", "head op: per-token logprob + entropy, fwd+bwd of sum(g_lp*lp + g_H*H)", kind="head"),
        Workload("sft", "SFT cross-entropy: mean over the N rows of -log p(y), fwd+bwd", kind="ce"),
        Workload(
            "cispo",
            "CISPO (Ludic CISPOLoss defaults: eps_high=0.2, length-normalised)",
            reference_loss="CISPOLoss",
            loss_kwargs={"clip_eps_high": 0.2},
            ours_loss="CISPOLoss",
            grpo_args={"loss_type": "cispo", "epsilon_high": 1.2},
        ),
        Workload(
            "grpo",
            "token-clipped GRPO (TokenClippedSurrogateLoss eps 0.2/0.27, length-normalised)",
            reference_loss="TokenClippedSurrogateLoss",
            loss_kwargs={"clip_eps_low": 0.2, "clip_eps_high": 0.27, "length_normalize": True},
            ours_loss="TokenClippedSurrogateLoss",
            grpo_args={"loss_type": "grpo", "epsilon_low": 0.2, "epsilon_high": 0.27},
        ),
        Workload(
            "gspo",
            "GSPO (ClippedSurrogateLoss, geometric-mean sequence ratio, eps 3e-4/4e-4)",
            reference_loss="ClippedSurrogateLoss",
            loss_kwargs={"clip_eps_low": 3e-4, "clip_eps_high": 4e-4, "length_normalize": True},
            ours_loss="ClippedSurrogateLoss",
            grpo_args={
                "loss_type": "grpo",
                "epsilon_low": 3e-4,
                "epsilon_high": 4e-4,
                "importance_sampling_level": "sequence",
            },
        ),
        Workload(
            "zvp_cispo",
            "ZVP-CISPO (alpha 0.1; entropy-shaped advantages on zero-variance groups)",
            reference_loss="ZVPCISPOLoss",
            ours_loss="ZVPCISPOLoss",
            loss_kwargs={"alpha_zvp": 0.1},
        ),
        Workload(
            "dpo",
            "DPO (sigmoid, beta 0.1; reference log-probs 0) on pairs of sequences",
            kind="pair",
            reference_loss="DPOLoss",
            loss_kwargs={"beta": 0.1},
            ours_loss="DPOLoss",
            liger_loss="LigerFusedLinearDPOLoss",
            liger_kwargs={"beta": 0.1, "use_ref_model": False},
        ),
        Workload(
            "orpo",
            "ORPO (beta 0.1, NLL on the chosen responses) on pairs of sequences",
            kind="pair",
            reference_loss="ORPOLoss",
            loss_kwargs={"beta": 0.1},
            ours_loss="ORPOLoss",
            liger_loss="LigerFusedLinearORPOLoss",
            liger_kwargs={"beta": 0.1},
        ),
        Workload(
            "jsd",
            "distillation: generalised JSD (beta 0.5, T 1) of student vs teacher rows, token mean",
            kind="distill",
            reference_loss="linear_divergence",
            loss_kwargs={"kind": "jsd", "beta": 0.5},
            liger_loss="LigerFusedLinearJSDLoss",
            liger_kwargs={"beta": 0.5, "weight_hard_loss": 0.0, "weight_soft_loss": 1.0},
        ),
        *(Workload(  # the peers' generalised JSD at beta 0 / 1 is forward / reverse KL
            kind_name,
            f"distillation: {kind_name.replace('_', ' ')} (T 1) of student vs teacher rows, token mean",
            kind="distill",
            reference_loss="linear_divergence",
            loss_kwargs={"kind": kind_name, "beta": peer_beta},
            liger_loss="LigerFusedLinearJSDLoss",
            liger_kwargs={"beta": peer_beta, "weight_hard_loss": 0.0, "weight_soft_loss": 1.0},
        ) for kind_name, peer_beta in (("forward_kl", 0.0), ("reverse_kl", 1.0))),
    )
}


def get_workload(name: str) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"workload must be one of {sorted(WORKLOADS)}, got {name!r}")
    return WORKLOADS[name]


@dataclass
class Inputs:
    """Leaves and batch of one workload run. `hidden` is [N, D] (head) or [B, T, D] (losses)."""

    hidden: Tensor
    weight: Tensor
    targets: Tensor  # head: [N] target ids; losses: input_ids [B, T]
    g_lp: Tensor | None = None  # head only: upstream gradients of logprob / entropy, [N] float32
    g_h: Tensor | None = None
    batch: dict[str, Tensor] = field(default_factory=dict)
    teacher: tuple[Tensor, Tensor] | None = None  # distill only: teacher rows [N, D] and head [V, D], no grad

    def leaves(self) -> tuple[Tensor, Tensor]:
        return self.hidden, self.weight

    def fresh(self) -> Inputs:
        """A copy whose hidden/weight are new leaves requiring grad (so runs never share .grad)."""
        return Inputs(
            self.hidden.detach().clone().requires_grad_(),
            self.weight.detach().clone().requires_grad_(),
            self.targets,
            self.g_lp,
            self.g_h,
            dict(self.batch),
            self.teacher,
        )

    def head_rows(self, k: int) -> Inputs:
        """The first k tokens of a row input (head op, SFT CE, distillation: the error check's sub-sample)."""
        cut = [None if g is None else g[:k] for g in (self.g_lp, self.g_h)]
        teacher = None if self.teacher is None else (self.teacher[0][:k], self.teacher[1])
        return Inputs(self.hidden[:k], self.weight, self.targets[:k], *cut, teacher=teacher)

    def sequences(self, k: int) -> Inputs:
        """The first k sequences of a loss input (the error check's sub-sample)."""
        return Inputs(
            self.hidden[:k], self.weight, self.targets[:k], batch={key: t[:k] for key, t in self.batch.items()}
        )


def make_inputs(workload: str, shape: Shape, seed: int = 0, device: str | torch.device = "cpu") -> Inputs:
    """Deterministic inputs for `workload` at `shape`, drawn in float32 on `device` by a generator of that device
    (a CUDA generator draws other numbers than the CPU one: the inputs are a function of shape, seed and device
    type), then cast. On a GPU this takes milliseconds where the CPU's V x D draw takes seconds."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    w = get_workload(workload)
    B, T = w.layout(shape)
    N = B * T if w.is_loss else shape.n_tokens
    D, V = shape.d, shape.v
    dt = shape.torch_dtype
    hidden = torch.randn(N, D, generator=g, device=dev)
    weight = torch.randn(V, D, generator=g, device=dev).mul_(LOGIT_STD / math.sqrt(D))
    ids = torch.randint(0, V, (N,), generator=g, device=dev)
    kind = w.kind
    if kind == "distill":
        teacher = (torch.randn(N, D, generator=g, device=dev),
                   torch.randn(V, D, generator=g, device=dev).mul_(LOGIT_STD / math.sqrt(D)))
        return Inputs(
            hidden.to(device=device, dtype=dt),
            weight.to(device=device, dtype=dt),
            ids.to(device),
            teacher=tuple(t.to(device=device, dtype=dt) for t in teacher),
        )
    if kind not in ("rl", "pair"):
        g_lp = torch.randn(N, generator=g, device=dev)
        g_h = torch.randn(N, generator=g, device=dev)
        return Inputs(
            hidden.to(device=device, dtype=dt),
            weight.to(device=device, dtype=dt),
            ids.to(device),
            g_lp.to(device) if kind == "head" else None,
            g_h.to(device) if kind == "head" else None,
        )
    input_ids = ids.reshape(B, T)
    h3 = hidden.reshape(B, T, D)
    batch = _ludic_batch(h3, weight, input_ids, g, prompt_tokens(T, shape.same_rows))
    if kind == "pair":
        batch["ref_seq_logps"] = torch.zeros(B, device=dev)
    return Inputs(
        h3.to(device=device, dtype=dt),
        weight.to(device=device, dtype=dt),
        input_ids.to(device),
        batch={k: v.to(device) for k, v in batch.items()},
    )


def _ludic_batch(
    hidden: Tensor, weight: Tensor, input_ids: Tensor, g: torch.Generator, prompt: int
) -> dict[str, Tensor]:
    """Ludic batch: the first `prompt` tokens of each sequence are prompt (action_mask 0), the rest actions."""
    B, T = input_ids.shape
    V = weight.shape[0]
    dev = input_ids.device
    action_mask = torch.zeros(B, T, dtype=torch.long, device=dev)
    action_mask[:, prompt:] = 1
    target_logit = torch.einsum("btd,btd->bt", hidden[:, :-1], weight[input_ids[:, 1:]])
    approx_lse = math.log(V) + LOGIT_STD**2 / 2
    actor = torch.zeros(B, T, device=dev)
    actor[:, 1:] = target_logit - approx_lse + ACTOR_NOISE * torch.randn(B, T - 1, generator=g, device=dev)
    actor = actor * action_mask
    directions = torch.tensor([1, -1, 0], dtype=torch.long, device=dev).repeat(B // 3 + 1)[:B]
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones(B, T, dtype=torch.long, device=dev),
        "action_mask": action_mask,
        "weight": torch.randn(B, generator=g, device=dev),
        "actor_logps": actor,
        "old_logp_action": actor[:, 1:].sum(-1),
        "zvp_direction": directions,
        "group_id": torch.arange(B, device=dev) // 2,
    }
