"""Deprecated path: the transformers sampler lives in `ludic_fast.rollout.hf_sampler` (HFGenerateEngine is
HFSampler). Importing this module gives that module itself."""

from ludic_fast._deprecation import moved_module
from ludic_fast.rollout import hf_sampler

moved_module(__name__, hf_sampler, "HFGenerateEngine is HFSampler")
