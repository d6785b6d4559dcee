"""Every loss of ludic_fast, under one roof: RL, preference, reward-model and distillation.

    base.py            HeadLoss (calling conventions, the head pass), Stats, helpers every loss shares
    rl.py              Ludic's REINFORCE / GSPO / SFT / KL / entropy-bonus losses
    policy.py          the token-level surrogates (PPO/GRPO/DAPO, CISPO, RL-ZVP, ScaleRL, SAPO) and PolicyOptions
    policy_terms.py    CISPO's weight, SAPO's gate, the k1/k2/k3 KL estimators (the TRL / verl integrations too)
    composite.py       LossTerm, CompositeLoss: several losses over one head pass
    preference/        DPO and TRL's loss types, IPO, CPO / AlphaPO, SimPO, ORPO, KTO; make_preference_loss
    reward.py          Bradley-Terry reward-model loss on a scalar value head
    linear_divergence  the fused two-head distillation divergence (forward / reverse KL, JSD), from ops

Calling conventions of the head losses (`HeadLoss`), all returning `(loss, stats)`:

    loss_fn(batch, hidden=h, weight=W, bias=None)   # fused: the gradient formed in the forward
    loss_fn(batch, logits=logits)                   # materialised logits, the same numbers
    loss_fn.compute(logits, batch)                  # Ludic's signature

`ludic_fast.reference` holds the float64-capable twin of each, the spec the tests compare against.
"""

from ludic_fast.losses.base import HeadLoss, Stats
from ludic_fast.losses.composite import CompositeLoss, LossTerm
from ludic_fast.losses.policy import (
    CISPOLoss,
    PolicyOptions,
    SAPOLoss,
    ScaleRLLoss,
    TokenClippedSurrogateLoss,
    ZVPCISPOLoss,
)
from ludic_fast.losses.policy_terms import cispo_weight, kl_estimate, sapo_gate
from ludic_fast.losses.preference import (
    CPO_LOSS_TYPES,
    DPO_LOSS_TYPES,
    PREFERENCE_LOSS_TYPES,
    CPOLoss,
    DPOLoss,
    IPOLoss,
    KTOLoss,
    ORPOLoss,
    SimPOLoss,
    make_preference_loss,
)
from ludic_fast.losses.reward import BradleyTerryLoss, sequence_rewards
from ludic_fast.losses.rl import (
    ClippedSurrogateLoss,
    EntropyBonus,
    KLLoss,
    MaskedCausalLMCrossEntropyLoss,
    ReinforceBaselineLoss,
    ReinforceLoss,
    TokenKLLoss,
)
from ludic_fast.ops.divergence import KINDS as DIVERGENCE_KINDS
from ludic_fast.ops.divergence import linear_divergence

__all__ = [
    # base
    "HeadLoss",
    "Stats",
    # RL
    "ReinforceLoss",
    "ReinforceBaselineLoss",
    "MaskedCausalLMCrossEntropyLoss",
    "ClippedSurrogateLoss",
    "TokenKLLoss",
    "KLLoss",
    "EntropyBonus",
    "PolicyOptions",
    "TokenClippedSurrogateLoss",
    "CISPOLoss",
    "ZVPCISPOLoss",
    "ScaleRLLoss",
    "SAPOLoss",
    "cispo_weight",
    "sapo_gate",
    "kl_estimate",
    "LossTerm",
    "CompositeLoss",
    # preference
    "DPOLoss",
    "IPOLoss",
    "SimPOLoss",
    "ORPOLoss",
    "KTOLoss",
    "CPOLoss",
    "make_preference_loss",
    "DPO_LOSS_TYPES",
    "CPO_LOSS_TYPES",
    "PREFERENCE_LOSS_TYPES",
    # reward model
    "BradleyTerryLoss",
    "sequence_rewards",
    # distillation
    "linear_divergence",
    "DIVERGENCE_KINDS",
]
