"""KTO (Ethayarajh et al., arXiv 2402.01306) on the fused head, on unpaired labelled examples."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ludic_fast.losses.base import HeadLoss, seq_logps
from ludic_fast.losses.preference.common import check_beta, group_starts, ref_seq_logps
from ludic_fast.token_batch import TokenBatch, widen


@dataclass
class KTOLoss(HeadLoss):
    """KTO (Ethayarajh et al., arXiv 2402.01306, eq. 8) on unpaired examples: batch['kto_label'] [S] is 1
    (desirable), 0 (undesirable) or -1 (a KL sample: a completion paired with another prompt, used only for
    the reference point). With r_b = L_b - R_b and z_0 = max(0, mean_{KL samples} r_b), detached,
    loss_b = λ_D (1 - σ(β (r_b - z_0))) for desirable, λ_U (1 - σ(β (z_0 - r_b))) for undesirable;
    loss = Σ_b loss_b / #labelled. A precomputed batch['kto_kl'] (0-d) replaces the in-batch estimate of
    z_0 (0 when neither is there).
    Defaults β = 0.1, λ_D = λ_U = 1 (the paper's). Rewards β r: mean over desirable (rewards_chosen) and
    undesirable (rewards_rejected) examples, rewards_margin their difference. float64 for float64 inputs."""

    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    length_normalize: bool = False
    coupled = True
    uses_reference: ClassVar[bool] = True
    needs_token_reference: ClassVar[bool] = False

    def __post_init__(self) -> None:
        check_beta(self.beta)
        if self.desirable_weight < 0 or self.undesirable_weight < 0:
            raise ValueError("desirable_weight and undesirable_weight must be >= 0, got "
                             f"{self.desirable_weight}, {self.undesirable_weight}")

    def _labels(self, tb: TokenBatch) -> Tensor:
        label = tb.batch.get("kto_label")
        if not isinstance(label, Tensor) or tuple(label.shape) != (tb.n_seq,):
            raise KeyError(f"KTOLoss requires batch['kto_label'] of shape [{tb.n_seq}] (1, 0 or -1 per sequence)")
        return label

    def coupling_groups(self, tb: TokenBatch) -> list[int] | None:
        if "kto_kl" not in tb.batch and bool((self._labels(tb) < 0).any()):  # KL samples couple the batch
            return None
        return group_starts(tb.seq)

    def objective(self, lp, H, tb, with_stats):
        label = self._labels(tb).to(lp.device)
        r = seq_logps(lp, tb, self.length_normalize) - ref_seq_logps(tb, self.length_normalize, "KTOLoss")
        if "kto_kl" in tb.batch:
            z0 = widen(tb.batch["kto_kl"]).reshape(())
        else:
            kl_rows = (label < 0).float()
            z0 = ((r.detach() * kl_rows).sum() / kl_rows.sum().clamp(min=1.0)).clamp(min=0.0)
        good, bad = (label == 1).float(), (label == 0).float()
        losses = (good * self.desirable_weight * (1.0 - torch.sigmoid(self.beta * (r - z0)))
                  + bad * self.undesirable_weight * (1.0 - torch.sigmoid(self.beta * (z0 - r))))
        loss = losses.sum() / (good + bad).sum().clamp(min=1.0)
        if not with_stats:
            return loss, {}
        rewards = self.beta * r.detach()
        chosen = (rewards * good).sum() / good.sum().clamp(min=1.0)
        rejected = (rewards * bad).sum() / bad.sum().clamp(min=1.0)
        return loss, {"loss": loss, "rewards_chosen": chosen, "rewards_rejected": rejected,
                      "rewards_margin": chosen - rejected, "kl": z0.detach()}

