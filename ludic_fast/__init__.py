"""ludic_fast: fused LM-head kernels and RL losses from hidden states, without [tokens x vocab] logits."""

from ludic_fast._common import HeadOutput
from ludic_fast.ops import linear_cross_entropy, linear_logprobs

__version__ = "0.1.0"
__all__ = ["HeadOutput", "linear_logprobs", "linear_cross_entropy", "__version__"]
