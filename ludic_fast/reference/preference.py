"""Reference twins of the preference losses (`ludic_fast.losses.preference`) on materialised logits.

Plain PyTorch, padded layout `logits [B, T, V]`, float32 (float64 when the logits are: every value then
float64): position j scores
token j+1, M[b, j] = action_mask[b, j+1], L_b = Σ_j M ℓ (÷ max(1, Σ_j M) when length-normalised).
Sequences 2i / 2i+1 are the chosen / rejected responses of pair i. Formulas as in `ludic_fast.losses.preference`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
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
        self.entropy = -(logp.exp() * logp).sum(-1)
        self.log_sum_sq = torch.logsumexp(2.0 * logp, dim=-1)  # log Σ_v p_v²
        self.mask = batch["action_mask"][:, 1:].to(self.token_logp.dtype)
        self.raw = self.mask.sum(-1)
        self.batch = batch

    def policy(self, length_normalize: bool, token_weight: Tensor | None = None) -> Tensor:
        w = self.mask if token_weight is None else self.mask * token_weight
        total = (self.token_logp * w).sum(-1)
        return total / self.raw.clamp(min=1.0) if length_normalize else total

    def ref(self, length_normalize: bool, token_weight: Tensor | None = None) -> Tensor:
        if "ref_seq_logps" in self.batch and token_weight is None:
            total = self.batch["ref_seq_logps"].to(self.token_logp.dtype)
        else:
            w = self.mask if token_weight is None else self.mask * token_weight
            total = (self.batch["ref_logps"][:, 1:].to(self.token_logp.dtype) * w).sum(-1)
        return total / self.raw.clamp(min=1.0) if length_normalize else total

    def chosen_nll(self) -> Tensor:
        return -(self.token_logp * self.mask)[0::2].sum() / self.raw[0::2].sum().clamp(min=1.0)

    def side_means(self, per_token: Tensor) -> tuple[Tensor, Tensor]:
        """Token means of per_token [B, T-1] over the chosen rows and over the rejected rows."""
        x = per_token * self.mask
        return (x[0::2].sum() / self.raw[0::2].sum().clamp(min=1.0),
                x[1::2].sum() / self.raw[1::2].sum().clamp(min=1.0))

    def policy_stats(self, with_reference: bool, with_entropy: bool) -> Stats:
        out: Stats = {}
        if with_reference:
            if "ref_logps" in self.batch:
                ratio = self.token_logp - self.batch["ref_logps"][:, 1:].to(self.token_logp.dtype)
                out["kl_chosen"], out["kl_rejected"] = self.side_means(ratio)
            else:  # per-sequence sums only
                d = self.policy(False) - self.ref(False)
                out["kl_chosen"] = d[0::2].sum() / self.raw[0::2].sum().clamp(min=1.0)
                out["kl_rejected"] = d[1::2].sum() / self.raw[1::2].sum().clamp(min=1.0)
        if with_entropy:
            out["entropy_chosen"], out["entropy_rejected"] = self.side_means(self.entropy)
        return out


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


def _cdpo(x: Tensor, eps: float) -> Tensor:
    return -(1 - eps) * F.logsigmoid(x) - eps * F.logsigmoid(-x)


def _f_score(c: Tensor, divergence: str, alpha: float) -> Tensor:
    if divergence == "forward_kl":
        return 1 - torch.exp(-c)
    if divergence == "js_divergence":
        return math.log(2.0) + F.logsigmoid(c)
    if divergence == "alpha_divergence" and alpha != 1.0:
        return (torch.exp((alpha - 1) * c) - 1) / (alpha - 1)
    return c


def _ld_weights(mask: Tensor, ld_alpha: float) -> Tensor:
    """1 up to the pair's shorter response length (counted along the row), ld_alpha beyond."""
    pos = mask.cumsum(-1)
    n = mask.sum(-1)
    shared = torch.minimum(n[0::2], n[1::2]).repeat_interleave(2)[:, None]
    return torch.where(pos <= shared, torch.ones_like(mask), torch.full_like(mask, ld_alpha))


@dataclass
class DPOLoss(_Ref):
    """Σ_k w_k mean_pairs ℓ_k over the loss types (TRL 1.16's DPO family; `ludic_fast.losses.preference.dpo_terms`),
    sigmoid: -(1-ε) log σ(u) - ε log σ(-u), u = β[(L_w - R_w) - (L_l - R_l)]."""

    beta: float = 0.1
    label_smoothing: float = 0.0
    length_normalize: bool = False
    loss_type: str | Sequence[str] = "sigmoid"
    loss_weights: Sequence[float] | None = None
    f_divergence: str = "reverse_kl"
    f_alpha: float | None = None
    ld_alpha: float | None = None
    use_weighting: bool = False
    discopop_tau: float | None = None
    entropy_stats: bool = False

    def _compute(self, s):
        b, eps = self.beta, self.label_smoothing
        tw = None if self.ld_alpha is None else _ld_weights(s.mask, self.ld_alpha)
        L, R = s.policy(self.length_normalize, tw), s.ref(self.length_normalize, tw)
        cw, cl = L[0::2] - R[0::2], L[1::2] - R[1::2]
        alpha = 0.5 if self.f_alpha is None else self.f_alpha
        sw, sl = _f_score(cw, self.f_divergence, alpha), _f_score(cl, self.f_divergence, alpha)
        nw, nl = s.raw[0::2].clamp(min=1.0), s.raw[1::2].clamp(min=1.0)
        x = b * (sw - sl)
        tau = self.discopop_tau or 0.05
        types = [self.loss_type] if isinstance(self.loss_type, str) else list(self.loss_type)
        weights = self.loss_weights or [1.0] * len(types)
        if self.use_weighting:
            lss = (s.batch["log_sum_sq_probs"][:, 1:].to(s.token_logp.dtype) if "log_sum_sq_probs" in s.batch
                   else s.log_sum_sq)
            seq_w = torch.exp(((s.token_logp - lss) * s.mask).sum(-1) / s.raw.clamp(min=1.0)).detach()
            pair_w = seq_w[0::2] * seq_w[1::2]
        loss = torch.zeros((), dtype=L.dtype)
        for name, w in zip(types, weights):
            if name == "sigmoid":
                per = _cdpo(x, eps)
            elif name == "hinge":
                per = torch.relu(1 - x)
            elif name == "ipo":
                per = (sw / nw - sl / nl - 1 / (2 * b)) ** 2
            elif name == "exo_pair":
                per = (torch.sigmoid(x) * (F.logsigmoid(x) - math.log(1 - eps))
                       + torch.sigmoid(-x) * (F.logsigmoid(-x) - math.log(eps)))
            elif name == "nca_pair":
                per = -F.logsigmoid(b * cw) - 0.5 * F.logsigmoid(-b * cw) - 0.5 * F.logsigmoid(-b * cl)
            elif name == "robust":
                per = (-(1 - eps) * F.logsigmoid(x) + eps * F.logsigmoid(-x)) / (1 - 2 * eps)
            elif name == "bco_pair":
                per = -F.logsigmoid(b * cw) - F.logsigmoid(-b * cl)
            elif name == "sppo_hard":
                per = (cw - 0.5 / b) ** 2 + (cl + 0.5 / b) ** 2
            elif name == "aot":
                d = torch.sort(L[0::2] - L[1::2]).values - torch.sort(R[0::2] - R[1::2]).values
                per = _cdpo(b * d, eps)
            elif name == "aot_unpaired":
                per = _cdpo(b * (torch.sort(cw).values - torch.sort(cl).values), eps)
            elif name == "apo_zero":
                per = 1 - torch.sigmoid(b * cw) + torch.sigmoid(b * cl)
            elif name == "apo_down":
                per = torch.sigmoid(b * cw) + 1 - torch.sigmoid(b * (cw - cl))
            elif name == "discopop":
                mix = torch.sigmoid(x / tau)
                per = -F.logsigmoid(x) * (1 - mix) + torch.exp(-x) * mix
            elif name == "sigmoid_norm":
                per = _cdpo(b * (sw / nw - sl / nl), eps)
            elif name == "sft":
                per = s.chosen_nll().expand(cw.shape)
            else:
                raise ValueError(f"unknown loss type {name!r}")
            if self.use_weighting:
                per = per * pair_w
            loss = loss + w * per.mean()
        stats = _stats(loss, b * cw, b * cl, L[0::2], L[1::2])
        stats.update(s.policy_stats(True, self.entropy_stats))
        if self.use_weighting:
            stats["wpo_weight"] = pair_w.mean()
        return loss, stats


@dataclass
class IPOLoss(_Ref):
    """(h - 1/(2β))², h = (L_w - R_w) - (L_l - R_l), mean over pairs (length-normalised by default)."""

    beta: float = 0.1
    length_normalize: bool = True
    entropy_stats: bool = False

    def _compute(self, s):
        L, R = s.policy(self.length_normalize), s.ref(self.length_normalize)
        cw, cl = L[0::2] - R[0::2], L[1::2] - R[1::2]
        loss = ((cw - cl - 0.5 / self.beta) ** 2).mean()
        stats = _stats(loss, self.beta * cw, self.beta * cl, L[0::2], L[1::2])
        stats.update(s.policy_stats(True, self.entropy_stats))
        return loss, stats


@dataclass
class CPOLoss(_Ref):
    """TRL's CPO: ρ = L (L̄ for ipo / simpo) or (1 - exp(L)^(-α))/α; Δ = ρ_w - ρ_l; sigmoid / simpo (margin γ):
    cDPO of βΔ (- γ), hinge relu(1 - βΔ), ipo (Δ - 1/(2β))²; + cpo_alpha · NLL of the chosen tokens."""

    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    simpo_gamma: float | None = None
    alpha: float = 0.0
    cpo_alpha: float = 1.0
    entropy_stats: bool = False

    def _compute(self, s):
        L = s.policy(self.loss_type in ("ipo", "simpo"))
        rho = L if self.alpha == 0 else (1 - torch.exp(L) ** (-self.alpha)) / self.alpha
        d = rho[0::2] - rho[1::2]
        b = self.beta
        if self.loss_type == "hinge":
            per = torch.relu(1 - b * d)
        elif self.loss_type == "ipo":
            per = (d - 1 / (2 * b)) ** 2
        else:
            gamma = (0.5 if self.simpo_gamma is None else self.simpo_gamma) if self.loss_type == "simpo" else 0.0
            per = _cdpo(b * d - gamma, self.label_smoothing)
        nll = s.chosen_nll()
        loss = per.mean() + self.cpo_alpha * nll
        stats = _stats(loss, b * rho[0::2], b * rho[1::2], L[0::2], L[1::2])
        stats.update(s.policy_stats(False, self.entropy_stats), nll=nll)
        return loss, stats


@dataclass
class SimPOLoss(_Ref):
    """-(1-ε) log σ(u) - ε log σ(-u), u = β L̄_w - β L̄_l - γ, mean over pairs, + nll_coeff · NLL(chosen)."""

    beta: float = 2.0
    gamma: float = 1.0
    label_smoothing: float = 0.0
    nll_coeff: float = 0.0
    entropy_stats: bool = False

    def _compute(self, s):
        L = s.policy(True)
        rw, rl = self.beta * L[0::2], self.beta * L[1::2]
        nll = s.chosen_nll()
        loss = _cdpo(rw - rl - self.gamma, self.label_smoothing).mean() + self.nll_coeff * nll
        stats = _stats(loss, rw, rl, L[0::2], L[1::2])
        stats.update(s.policy_stats(False, self.entropy_stats), nll=nll)
        return loss, stats


@dataclass
class ORPOLoss(_Ref):
    """nll_coeff · (token-mean NLL of the chosen responses) - β mean log σ(log odds_w - log odds_l),
    log odds = L̄ - log(1 - e^L̄)."""

    beta: float = 0.1
    nll_coeff: float = 1.0
    entropy_stats: bool = False

    def _compute(self, s):
        L = s.policy(True)
        lw, ll = L[0::2], L[1::2]
        log_odds = (lw - ll) - (_log1mexp(lw) - _log1mexp(ll))
        ratio = F.logsigmoid(log_odds)
        nll = s.chosen_nll()
        loss = self.nll_coeff * nll - self.beta * ratio.mean()
        stats = _stats(loss, self.beta * lw, self.beta * ll, lw, ll)
        stats.update(s.policy_stats(False, self.entropy_stats))
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


__all__ = ["CPOLoss", "DPOLoss", "IPOLoss", "SimPOLoss", "ORPOLoss", "KTOLoss"]
