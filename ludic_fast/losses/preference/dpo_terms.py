"""Per-pair terms of the DPO family (the loss types of TRL 1.16's `DPOTrainer`), as functions of log-ratios.

Inputs per pair i (`PairTerms`): the log-ratios c_w = L_w - R_w and c_l = L_l - R_l, their f-divergence
scores s_w, s_l (s = c for the reverse KL), Δs = s_w - s_l, the response lengths n_w, n_l, the policy and
reference sums for the batch-sorted AOT, the batch's chosen-token NLL; β, ε = label_smoothing, τ. With
x = β Δs and σ the logistic function (softplus(-x) = -log σ(x)):

    sigmoid        (1-ε) softplus(-x) + ε softplus(x)                     DPO, arXiv 2305.18290 (ε: cDPO)
    hinge          relu(1 - x)                                            SLiC, arXiv 2305.10425
    ipo            (s_w/n_w - s_l/n_l - 1/(2β))²                           IPO, arXiv 2310.12036
    exo_pair       σ(x)(log σ(x) - log(1-ε)) + σ(-x)(log σ(-x) - log ε)    EXO, arXiv 2402.00856 (ε > 0)
    nca_pair       softplus(-βc_w) + ½ softplus(βc_w) + ½ softplus(βc_l)   NCA, arXiv 2402.05369
    robust         [(1-ε) softplus(-x) - ε softplus(x)] / (1 - 2ε)         rDPO, arXiv 2403.00409
    bco_pair       softplus(-βc_w) + softplus(βc_l)                        BCO, arXiv 2404.04656
    sppo_hard      (c_w - 1/(2β))² + (c_l + 1/(2β))²                       SPPO, arXiv 2405.00675
    aot            sigmoid form of d = sort_i(L_w - L_l) - sort_i(R_w - R_l)  AOT, arXiv 2406.05882
    aot_unpaired   sigmoid form of d = sort_i(c_w) - sort_i(c_l)
    apo_zero       1 - σ(βc_w) + σ(βc_l)                                   APO, arXiv 2408.06266 eq. 7
    apo_down       σ(βc_w) + 1 - σ(β(c_w - c_l))                           APO eq. 8
    discopop       softplus(-x)(1 - σ(x/τ)) + e^{-x} σ(x/τ)                DiscoPOP, arXiv 2406.08414 eq. 5
    sigmoid_norm   (1-ε) softplus(-x') + ε softplus(x'), x' = β(s_w/n_w - s_l/n_l)
    sft            the batch's chosen-token NLL (the same value for every pair)

aot and aot_unpaired sort over the batch, so they couple all pairs; every other term couples a pair only.
f-divergence scores (f-DPO, arXiv 2309.16240): reverse_kl s = c; forward_kl s = 1 - e^{-c};
js_divergence s = log 2 + log σ(c); alpha_divergence s = (e^{(α-1)c} - 1)/(α - 1) (s = c at α = 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ludic_fast.losses.preference.common import smoothed_sigmoid_loss


@dataclass
class PairTerms:
    """The per-pair quantities a DPO-family term reads (module docstring)."""

    chosen: Tensor  # c_w [P]
    rejected: Tensor  # c_l [P]
    chosen_score: Tensor  # s_w [P]
    rejected_score: Tensor  # s_l [P]
    n_chosen: Tensor  # [P]
    n_rejected: Tensor  # [P]
    policy_margin: Tensor  # L_w - L_l [P]
    ref_margin: Tensor  # R_w - R_l [P]
    sft: Tensor  # 0-d
    beta: float
    eps: float
    tau: float

    @property
    def x(self) -> Tensor:
        return self.beta * (self.chosen_score - self.rejected_score)

    @property
    def x_norm(self) -> Tensor:
        return self.chosen_score / self.n_chosen - self.rejected_score / self.n_rejected


def _exo(t: PairTerms) -> Tensor:
    x = t.x
    return (torch.sigmoid(x) * (F.logsigmoid(x) - math.log1p(-t.eps))
            + torch.sigmoid(-x) * (F.logsigmoid(-x) - math.log(t.eps)))


def _robust(t: PairTerms) -> Tensor:
    x = t.x
    return ((1.0 - t.eps) * F.softplus(-x) - t.eps * F.softplus(x)) / (1.0 - 2.0 * t.eps)


def _discopop(t: PairTerms) -> Tensor:
    x = t.x
    mix = torch.sigmoid(x / t.tau)
    return F.softplus(-x) * (1.0 - mix) + torch.exp(-x) * mix


def _aot(t: PairTerms) -> Tensor:
    d = torch.sort(t.policy_margin).values - torch.sort(t.ref_margin).values
    return smoothed_sigmoid_loss(t.beta * d, t.eps)


def _aot_unpaired(t: PairTerms) -> Tensor:
    d = torch.sort(t.chosen).values - torch.sort(t.rejected).values
    return smoothed_sigmoid_loss(t.beta * d, t.eps)


TERMS: dict[str, Callable[[PairTerms], Tensor]] = {
    "sigmoid": lambda t: smoothed_sigmoid_loss(t.x, t.eps),
    "hinge": lambda t: torch.relu(1.0 - t.x),
    "ipo": lambda t: (t.x_norm - 1.0 / (2.0 * t.beta)).square(),
    "exo_pair": _exo,
    "nca_pair": lambda t: (F.softplus(-t.beta * t.chosen) + 0.5 * F.softplus(t.beta * t.chosen)
                           + 0.5 * F.softplus(t.beta * t.rejected)),
    "robust": _robust,
    "bco_pair": lambda t: F.softplus(-t.beta * t.chosen) + F.softplus(t.beta * t.rejected),
    "sppo_hard": lambda t: (t.chosen - 0.5 / t.beta).square() + (t.rejected + 0.5 / t.beta).square(),
    "aot": _aot,
    "aot_unpaired": _aot_unpaired,
    "apo_zero": lambda t: 1.0 - torch.sigmoid(t.beta * t.chosen) + torch.sigmoid(t.beta * t.rejected),
    "apo_down": lambda t: torch.sigmoid(t.beta * t.chosen) + 1.0 - torch.sigmoid(t.beta * (t.chosen - t.rejected)),
    "discopop": _discopop,
    "sigmoid_norm": lambda t: smoothed_sigmoid_loss(t.beta * t.x_norm, t.eps),
    "sft": lambda t: t.sft.expand(t.chosen.shape),
}
LOSS_TYPES = tuple(TERMS)
#: loss types that read label_smoothing ε
SMOOTHED = ("sigmoid", "sigmoid_norm", "exo_pair", "robust", "aot", "aot_unpaired")
#: loss types of the scores s, the only ones an f-divergence other than the reverse KL applies to
F_DIVERGENCE_TYPES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")
#: loss types that sort over the batch (they couple every pair)
BATCH_SORTED = ("aot", "aot_unpaired")
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")


def f_divergence_score(c: Tensor, divergence: str, alpha: float) -> Tensor:
    """The f-DPO score s of the log-ratio c (module docstring)."""
    if divergence == "reverse_kl" or (divergence == "alpha_divergence" and alpha == 1.0):
        return c
    if divergence == "forward_kl":
        return -torch.expm1(-c)
    if divergence == "js_divergence":
        return math.log(2.0) + F.logsigmoid(c)
    return torch.expm1((alpha - 1.0) * c) / (alpha - 1.0)
