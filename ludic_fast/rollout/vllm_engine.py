"""Deprecated path: the in-process vLLM sampler lives in `ludic_fast.rollout.vllm_sampler`
(VLLMEngine is now `VLLMSampler`).
Importing this module gives that module itself, so its names (and patches of them) are shared."""

import sys
import warnings

from ludic_fast.rollout import vllm_sampler

warnings.warn("ludic_fast.rollout.vllm_engine is deprecated; import from ludic_fast.rollout.vllm_sampler "
              "(VLLMEngine is VLLMSampler)", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = vllm_sampler
