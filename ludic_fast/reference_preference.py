"""Reference twins of the preference losses (`ludic_fast.preference`) on materialised logits.

Plain PyTorch, padded layout `logits [B, T, V]`, float32 (float64 when the logits are): position j scores
token j+1, M[b, j] = action_mask[b, j+1], L_b = Σ_j M ℓ (÷ max(1, Σ_j M) when length-normalised).
Sequences 2i / 2i+1 are the chosen / rejected responses of pair i. Formulas as in `ludic_fast.preference`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

Batch = Mapping[str, Tensor]
Stats = dict[str, Any]


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 - e^x), x capped at -1e-12."""
    x = x.clamp(max=-1e-12)
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x.clamp(min=-math.log(2.0)))),
                       torch.log1p(-torch.exp(x.clamp(max=-math.log(2.0)))))


class _Sequences:
    """Per-sequence sums of the policy's (from logits) and the reference model's (from the batch) log-probs."""

    def __init__(self, logits: Tensor, batch: Batch):
        ids = batch["input_ids"]
        z = logits[:, :-1]
        logp = torch.log_softmax(z if z.dtype == torch.float64 else z.float(), dim=-1)
        self.token_logp = logp.gather(-1, ids[:, 1:, None].long()).squeeze(-1)
        self.mask = batch["action_mask"][:, 1:].to(self.token_logp.dtype)
        self.raw = self.mask.sum(-1)
        self.batch = batch

    def policy(self, length_normalize: bool) -> Tensor:
        total = (self.token_logp * self.mask).sum(-1)
        return total / self.raw.clamp(min=1.0) if length_normalize else total

    def ref(self, length_normalize: bool) -> Tensor:
        if "ref_seq_logps" in self.batch:
            total = self.batch["ref_seq_logps"].to(self.token_logp.dtype)
        else:
            total = (self.batch["ref_logps"][:, 1:].to(self.token_logp.dtype) * self.mask).sum(-1)
        return total / self.raw.clamp(min=1.0) if length_normalize else total


def _stats(loss: Tensor, rw: Tensor, rl: Tensor, lw: Tensor, ll: Tensor) -> Stats:
    return {"loss": loss, "rewards_chosen": rw.mean(), "rewards_rejected": rl.mean(),
            "rewards_margin": (rw - rl).mean(), "rewards_accuracy": (rw > rl).float().mean(),
            "logps_chosen": lw.mean(), "logps_rejected": ll.mean()}


def _detach(stats: Stats) -> Stats:
    return {k: v.detach() for k, v in stats.items()}


class _Ref:
    def __call__(self, batch: Batch, *, logits: Tensor) -> tuple[Tensor, Stats]:
        loss, stats = self._compute(_Sequences(logits, batch))
        return loss, _detach(stats)

    def compute(self, logits: Tensor, batch: Batch) -> tuple[Tensor, Stats]:
        return self(batch, logits=logits)

    def _compute(self, s: _Sequences) -> tuple[Tensor, Stats]:  # pragma: no cover
        raise NotImplementedError


@dataclass
class DPOLoss(_Ref):
    """-(1-ε) log σ(u) - ε log σ(-u), u = β[(L_w - R_w) - (L_l - R_l)], mean over pairs."""

    beta: float = 0.1
    label_smoothing: float = 0.0
    length_normalize: bool = False

    def _compute(self, s):
        L, R = s.policy(self.length_normalize), s.ref(self.length_normalize)
        rw, rl = self.beta * (L[0::2] - R[0::2]), self.beta * (L[1::2] - R[1::2])
        u = rw - rl
        eps = self.label_smoothing
        loss = (-(1 - eps) * F.logsigmoid(u) - eps * F.logsigmoid(-u)).mean()
        return loss, _stats(loss, rw, rl, L[0::2], L[1::2])


@dataclass
class IPOLoss(_Ref):
    """(h - 1/(2β))², h = (L_w - R_w) - (L_l - R_l), mean over pairs (length-normalised by default)."""

    beta: float = 0.1
    length_normalize: bool = True

    def _compute(self, s):
        L, R = s.policy(self.length_normalize), s.ref(self.length_normalize)
        cw, cl = L[0::2] - R[0::2], L[1::2] - R[1::2]
        loss = ((cw - cl - 0.5 / self.beta) ** 2).mean()
        return loss, _stats(loss, self.beta * cw, self.beta * cl, L[0::2], L[1::2])


@dataclass
class SimPOLoss(_Ref):
    """-(1-ε) log σ(u) - ε log σ(-u), u = β L̄_w - β L̄_l - γ, mean over pairs; L̄ length-normalised."""

    beta: float = 2.0
    gamma: float = 1.0
    label_smoothing: float = 0.0

    def _compute(self, s):
        L = s.policy(True)
        rw, rl = self.beta * L[0::2], self.beta * L[1::2]
        u = rw - rl - self.gamma
        eps = self.label_smoothing
        loss = (-(1 - eps) * F.logsigmoid(u) - eps * F.logsigmoid(-u)).mean()
        return loss, _stats(loss, rw, rl, L[0::2], L[1::2])


@dataclass
class ORPOLoss(_Ref):
    """nll_coeff · (token-mean NLL of the chosen responses) - β mean log σ(log odds_w - log odds_l),
    log odds = L̄ - log(1 - e^L̄)."""

    beta: float = 0.1
    nll_coeff: float = 1.0

    def _compute(self, s):
        L = s.policy(True)
        lw, ll = L[0::2], L[1::2]
        log_odds = (lw - ll) - (_log1mexp(lw) - _log1mexp(ll))
        ratio = F.logsigmoid(log_odds)
        nll = -(s.token_logp * s.mask)[0::2].sum() / s.raw[0::2].sum().clamp(min=1.0)
        loss = self.nll_coeff * nll - self.beta * ratio.mean()
        stats = _stats(loss, self.beta * lw, self.beta * ll, lw, ll)
        stats.update(nll=nll, log_odds_ratio=ratio.mean(), log_odds_chosen=log_odds.mean())
        return loss, stats


@dataclass
class KTOLoss(_Ref):
    """Mean over labelled examples of λ_D(1 - σ(β(r - z0))) (label 1) or λ_U(1 - σ(β(z0 - r))) (label 0),
    r = L - R, z0 = batch['kto_kl'] or max(0, mean of r over label -1), detached."""

    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    length_normalize: bool = False

    def _compute(self, s):
        label = s.batch["kto_label"]
        r = s.policy(self.length_normalize) - s.ref(self.length_normalize)
        if "kto_kl" in s.batch:
            z0 = s.batch["kto_kl"].to(r.dtype)
        else:
            kl = r.detach()[label < 0]
            z0 = kl.mean().clamp(min=0.0) if kl.numel() else torch.zeros((), dtype=r.dtype)
        good, bad = label == 1, label == 0
        losses = torch.cat([self.desirable_weight * (1 - torch.sigmoid(self.beta * (r[good] - z0))),
                            self.undesirable_weight * (1 - torch.sigmoid(self.beta * (z0 - r[bad])))])
        loss = losses.sum() / max(1, losses.numel())
        rewards = self.beta * r.detach()
        zero = torch.zeros((), dtype=r.dtype)
        chosen = rewards[good].mean() if good.any() else zero
        rejected = rewards[bad].mean() if bad.any() else zero
        return loss, {"loss": loss, "rewards_chosen": chosen, "rewards_rejected": rejected,
                      "rewards_margin": chosen - rejected, "kl": z0.detach()}


__all__ = ["DPOLoss", "IPOLoss", "SimPOLoss", "ORPOLoss", "KTOLoss"]
