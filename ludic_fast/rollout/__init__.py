"""Rollouts: samplers (the `Sampler` protocol and the `SAMPLERS` registry: transformers `generate`; vLLM
in-process or its OpenAI server, imported lazily), tasks and rewards (the `REWARD_FUNCS` registry), batch
sources (RolloutBatchSource with GRPO groups and DAPO dynamic sampling; DatasetBatchSource of recorded
rollouts and chat SFT data) and the eval loop."""

from ludic_fast._deprecation import renamed_attributes
from ludic_fast.rollout.dataset_source import DatasetBatchSource, chat_item
from ludic_fast.rollout.hf_sampler import HFSampler
from ludic_fast.rollout.prompts import encode_prompt, resolve_chat_template, sft_item
from ludic_fast.rollout.rewards import (
    REWARD_FUNCS,
    RewardEntry,
    WeightedReward,
    exact_match,
    format_reward,
    get_reward,
    numeric_match,
)
from ludic_fast.rollout.sampler import (
    SAMPLERS,
    Completion,
    Sampler,
    SamplerEntry,
    SamplerSettings,
    SamplingConfig,
)
from ludic_fast.rollout.sources import Evaluator, RolloutBatchSource
from ludic_fast.rollout.tasks import PromptAnswerTask, embedded_default_task
from ludic_fast.rollout.vllm_sampler import VLLMSampler, map_weights_for_vllm, vllm_weight_name
from ludic_fast.rollout.vllm_server import VLLMServer, VLLMServerSampler

#: the samplers' old names (they were called engines; the engine is the trainer's, ludic_fast.engine)
__getattr__ = renamed_attributes(__name__, globals(), {"HFGenerateEngine": "HFSampler", "VLLMEngine": "VLLMSampler",
                                                       "VLLMServerEngine": "VLLMServerSampler",
                                                       "OfflineBatchSource": "DatasetBatchSource"})

__all__ = [
    "Sampler",
    "SamplerEntry",
    "SamplerSettings",
    "SAMPLERS",
    "REWARD_FUNCS",
    "RewardEntry",
    "WeightedReward",
    "Completion",
    "HFSampler",
    "SamplingConfig",
    "VLLMSampler",
    "VLLMServer",
    "VLLMServerSampler",
    "vllm_weight_name",
    "map_weights_for_vllm",
    "DatasetBatchSource",
    "chat_item",
    "encode_prompt",
    "resolve_chat_template",
    "sft_item",
    "RolloutBatchSource",
    "Evaluator",
    "PromptAnswerTask",
    "embedded_default_task",
    "exact_match",
    "numeric_match",
    "format_reward",
    "get_reward",
]
