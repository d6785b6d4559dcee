"""Deprecated path: the transformers sampler lives in `ludic_fast.rollout.hf_sampler`
(HFGenerateEngine is now `HFSampler`).
Importing this module gives that module itself, so its names (and patches of them) are shared."""

import sys
import warnings

from ludic_fast.rollout import hf_sampler

warnings.warn("ludic_fast.rollout.engine is deprecated; import from ludic_fast.rollout.hf_sampler "
              "(HFGenerateEngine is HFSampler)", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = hf_sampler
