"""Agents in environments: multi-turn episodes with tools, trained token-exactly (docs/agents.md).

protocol: `Env` (reset(seed) -> messages, step(turn) -> StepResult), `AssistantTurn`, `ToolCall`.
tools: `Tool.from_function` (JSON schema from signature + docstring), the Hermes tool-call parser.
episode: the token sequence built turn by turn from sampled ids (`ChatTokens`, `EpisodeTokens`).
runner: `EpisodeRunner` (concurrent episodes, time limits, turn/token limits, failures isolated).
items: episodes -> credit -> SAW items (one per step or per episode). rewards: `WeightedRewards`.
source: `EnvBatchSource` (the trainer's batch source). envs: the embedded environments.
selfplay: two-player games, both seats the policy (`SelfPlayRunner`) or one against a fixed opponent (`VersusEnv`).
"""

from ludic_fast.agents.episode import ChatTokens, EpisodeTokens
from ludic_fast.agents.items import episode_items, trainable_groups
from ludic_fast.agents.protocol import AssistantTurn, Env, Message, StepResult, ToolCall
from ludic_fast.agents.rewards import WeightedRewards
from ludic_fast.agents.runner import CallTimeout, Episode, EpisodeJob, EpisodeLimits, EpisodeRunner
from ludic_fast.agents.selfplay import SelfPlayRunner, TwoPlayerGame, VersusEnv
from ludic_fast.agents.source import EnvBatchSource
from ludic_fast.agents.tools import HermesToolCallParser, Tool

__all__ = [
    "AssistantTurn", "CallTimeout", "ChatTokens", "Env", "EnvBatchSource", "Episode", "EpisodeJob",
    "EpisodeLimits", "EpisodeRunner", "EpisodeTokens", "HermesToolCallParser", "Message", "SelfPlayRunner",
    "StepResult", "Tool", "ToolCall", "TwoPlayerGame", "VersusEnv", "WeightedRewards", "episode_items",
    "trainable_groups",
]
