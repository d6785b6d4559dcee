"""The environment protocol: what an environment is, what it is given and what it answers.

An episode starts from a seed: `env.reset(seed)` returns the first messages (chat messages, dicts with
"role" and "content": a system prompt, the task). Then, turn by turn, the model writes an assistant turn
and the environment answers it: `env.step(turn)` returns a `StepResult` (observation messages, a reward,
whether the episode is done or truncated, free-form info). Tools are plain Python functions the model
calls in the chat template's tool-call format (`ludic_fast.agents.tools`); a turn that calls tools is
answered by the runner with the tools' results and never reaches `env.step`.

Either method may be a coroutine function (`async def`): the runner awaits it under its time limit; a
plain function runs in a daemon thread under the same limit. This mirrors Ludic's `SingleAgentEnv`
(reset -> observation, step -> outcome) on chat messages, as TRL's environments and `verifiers`' multi-turn
environments do.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

Message = dict[str, Any]
"""A chat message: {"role": "system" | "user" | "assistant" | "tool", "content": str, ...}."""

ROLES = ("system", "user", "assistant", "tool")


def check_messages(messages: Any, what: str) -> list[Message]:
    """Chat messages (dicts with a known "role", a str "content"), else TypeError/ValueError naming `what`."""
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"{what} must be a list of chat messages, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(f"{what}[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        if m.get("role") not in ROLES:
            raise ValueError(f"{what}[{i}] has role {m.get('role')!r}; expected one of {ROLES}")
        if not isinstance(m.get("content"), str):
            raise TypeError(f"{what}[{i}] content must be a str, got {type(m.get('content')).__name__}")
        out.append(dict(m))
    return out


@dataclass
class ToolCall:
    """One parsed tool call: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any]

    def to_message(self) -> dict[str, Any]:
        """The OpenAI / transformers form of the call, as chat templates render `tool_calls`."""
        return {"type": "function", "function": {"name": self.name, "arguments": dict(self.arguments)}}


@dataclass
class AssistantTurn:
    """What the model wrote in one turn: its text (special tokens dropped), the tool calls parsed from it, the
    parse errors of malformed calls, and the sampled token ids."""

    text: str
    token_ids: list[int]
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_errors: list[str] = field(default_factory=list)
    content: str = ""

    def to_message(self) -> Message:
        """The assistant message (content without the tool-call markup, tool_calls in OpenAI form)."""
        msg: Message = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = [c.to_message() for c in self.tool_calls]
        return msg


@dataclass
class StepResult:
    """The environment's answer to one assistant turn.

    observations: messages appended to the conversation (the model reads them next turn; "user" or "tool").
    reward: this step's reward r_t (finite); the episode's return is Σ_t r_t.
    done: the episode ended (terminated); truncated: it was cut short (a limit of the environment's own).
    info: JSON-compatible extras, copied to the step (and to its SAW item's meta). A key `rewards` holding
    {name: value} is logged per component (the reward functions' breakdown).
    """

    observations: list[Message] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.observations = check_messages(self.observations, "StepResult.observations")
        if isinstance(self.reward, bool) or not isinstance(self.reward, numbers.Real) or not math.isfinite(self.reward):
            raise ValueError(f"StepResult.reward must be a finite number, got {self.reward!r}")
        self.reward = float(self.reward)
        if not isinstance(self.info, Mapping):
            raise TypeError(f"StepResult.info must be a dict, got {type(self.info).__name__}")
        self.info = dict(self.info)
        if not (self.done or self.truncated) and not self.observations:
            raise ValueError("a StepResult that does not end the episode needs observation messages")


@runtime_checkable
class Env(Protocol):
    """An environment: `reset(seed) -> messages`, `step(turn) -> StepResult` (each may be `async`).

    Optional attributes read by the runner: `tools` (a sequence of `Tool` or plain functions the model may
    call; default none), `tool_schemas` (OpenAI function schemas of tools the environment runs itself, read
    after `reset`: the calls are parsed onto the turn and the turn goes to `step`), `max_turns` (this
    environment's turn limit when the runner sets none) and `close()` (awaited once the episode has ended).
    """

    def reset(self, seed: int) -> Sequence[Message]: ...

    def step(self, turn: AssistantTurn) -> StepResult: ...


__all__ = ["Message", "ROLES", "check_messages", "ToolCall", "AssistantTurn", "StepResult", "Env"]
