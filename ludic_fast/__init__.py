"""ludic_fast: fused LM-head kernels and RL losses from hidden states, without [tokens x vocab] logits.

    ludic_fast.linear_logprobs(hidden, weight, targets, ...)   per-token logprob / entropy (the head op)
    ludic_fast.linear_cross_entropy(hidden, weight, targets)   SFT cross-entropy on the head op
    ludic_fast.linear_divergence(h_s, W_s, h_t, W_t)          fused two-head KL / JSD distillation
    ludic_fast.losses.CISPOLoss(...)(batch, hidden=h, weight=W) RL losses, gradient formed in the forward
    ludic_fast.reference                                        plain-PyTorch spec on materialised logits
"""

from ludic_fast import losses, reference
from ludic_fast._common import HeadOutput
from ludic_fast.ops import linear_cross_entropy, linear_divergence, linear_logprobs

__version__ = "0.1.0"
__all__ = [
    "HeadOutput",
    "linear_divergence",
    "linear_logprobs",
    "linear_cross_entropy",
    "losses",
    "reference",
    "__version__",
]
