"""Deprecated path: the in-process vLLM sampler lives in `ludic_fast.rollout.vllm_sampler` (VLLMEngine is
VLLMSampler). Importing this module gives that module itself."""

from ludic_fast._deprecation import moved_module
from ludic_fast.rollout import vllm_sampler

moved_module(__name__, vllm_sampler, "VLLMEngine is VLLMSampler")
