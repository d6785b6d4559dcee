"""The executable spec: plain PyTorch on materialised logits.

Every op and loss of ludic_fast is tested against the functions and classes here. Nothing is chunked or
fused; clarity over speed. Logits are computed in float32 (float64 when an input is float64, for
finite-difference checks); log-softmax and entropy are taken from them in float64 (`token_entropy`: exact
for confident tokens and for masked columns of logit -inf) and returned as float32 (float64 for float64).

Head:   z = softcap(logit_scale * (h W^T + b)) / T,   softcap(x) = c * tanh(x / c)
        logprob_t = z_{t, y_t} - logsumexp(z_t),       H_t = -sum_v p_{t,v} log p_{t,v}

Losses follow Ludic master (joanvelja/ludic @ 321e8d7) exactly, on the causal shift: position j of the
logits scores token j+1; M[b,j] = action_mask[b,j+1]; n[b] = max(1, sum_j M[b,j]).

Modules by family: `head` (the head op), `tokens` (the causal shift and what the loss twins share),
`ludic_losses` (Ludic's RL losses), `surrogate` (the losses and options beyond Ludic), `preference` (DPO family,
KTO), `divergence` (distillation); every public name is re-exported here.
"""

from __future__ import annotations

from ludic_fast.reference.divergence import linear_divergence
from ludic_fast.reference.head import (
    head_logits,
    linear_cross_entropy,
    linear_logprobs,
    logprobs_from_logits,
    token_entropy,
)
from ludic_fast.reference.ludic_losses import (
    CISPOLoss,
    ClippedSurrogateLoss,
    CompositeLoss,
    EntropyBonus,
    KLLoss,
    LossTerm,
    MaskedCausalLMCrossEntropyLoss,
    ReinforceBaselineLoss,
    ReinforceLoss,
    TokenClippedSurrogateLoss,
    TokenKLLoss,
)
from ludic_fast.reference.preference import CPOLoss, DPOLoss, IPOLoss, KTOLoss, ORPOLoss, SimPOLoss
from ludic_fast.reference.surrogate import GSPOTokenLoss, SAPOLoss, ScaleRLLoss, TokenSurrogateLoss, ZVPCISPOLoss
from ludic_fast.reference.tokens import compute_logp_action, compute_token_entropy, compute_token_logp

__all__ = [
    "linear_divergence",
    "CPOLoss",
    "DPOLoss",
    "IPOLoss",
    "KTOLoss",
    "ORPOLoss",
    "SimPOLoss",
    "head_logits",
    "logprobs_from_logits",
    "linear_logprobs",
    "linear_cross_entropy",
    "compute_token_logp",
    "compute_token_entropy",
    "token_entropy",
    "compute_logp_action",
    "ReinforceLoss",
    "ReinforceBaselineLoss",
    "MaskedCausalLMCrossEntropyLoss",
    "ClippedSurrogateLoss",
    "TokenClippedSurrogateLoss",
    "CISPOLoss",
    "TokenKLLoss",
    "KLLoss",
    "EntropyBonus",
    "LossTerm",
    "CompositeLoss",
    "TokenSurrogateLoss",
    "ZVPCISPOLoss",
    "ScaleRLLoss",
    "SAPOLoss",
    "GSPOTokenLoss",
]
