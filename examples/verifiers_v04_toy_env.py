"""A small verifiers 0.4 taskset (`import verifiers.v1 as vf`), nothing to download: the single-turn and tool
environments `ludic_fast.agents.libraries.verifiers` is tested and shown on under verifiers 0.4.0 (the multi-turn
one is examples/verifiers_v04_toy_multiturn.py). The verifiers 0.3.1 counterpart is examples/verifiers_toy_env.py.

    taskset config: kind="single" | "tool", num_examples=64, seed=0, system=None (the tasks' system prompt)

- single (a plain taskset: verifiers plays it with its `SingleAgentEnv`): "copy: k" -> the reply "k". Rewards:
  `exact` (weight 1.0: the last reply equals the letter) + `short` (weight 0.2: it has at most 2 characters).
- tool: "a+b=?" with two-digit numbers and the tool server `calc` (`add(a, b)`, offered to the model as
  `calc_add`); reward `exact` (weight 1.0: the last reply is the sum).

Run as a module (`python -m verifiers_v04_toy_env`), it serves the `calc` tools: verifiers starts it so in a
subprocess for each episode of kind "tool".
"""

from __future__ import annotations

import random
from typing import Literal

import verifiers.v1 as vf
from pydantic import model_validator

LETTERS = "abcdefghij"


class CalcTools(vf.Toolset[vf.ToolsetConfig]):
    """The tool server of kind "tool"."""

    TOOL_PREFIX = "calc"

    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


class ToyData(vf.TaskData):
    answer: str


class ToyTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()
    kind: str = "single"


def last_reply(trace: vf.Trace) -> str:
    replies = trace.assistant_messages
    return (replies[-1].content or "").strip() if replies else ""


class ToyTask(vf.Task[ToyData, vf.State, ToyTaskConfig]):
    @classmethod
    def toolsets(cls, config: ToyTaskConfig) -> list[vf.Toolset]:
        return [CalcTools(config.tools)] if config.kind == "tool" else []

    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        """1 when the last reply equals the answer."""
        return float(last_reply(trace) == self.data.answer)

    @vf.reward(weight=0.2)
    async def short(self, trace: vf.Trace) -> float:
        """1 when the last reply has at most 2 characters (kind "single" only)."""
        return float(len(last_reply(trace)) <= 2) if self.config.kind == "single" else 0.0


class ToyConfig(vf.TasksetConfig):
    kind: Literal["single", "tool"] = "single"
    num_examples: int = 64
    seed: int = 0
    system: str | None = None
    task: ToyTaskConfig = ToyTaskConfig()

    @model_validator(mode="after")
    def _kind_to_tasks(self) -> ToyConfig:
        self.task = self.task.model_copy(update={"kind": self.kind})  # Task.toolsets reads it
        return self


def rows(kind: str, num_examples: int, seed: int) -> list[tuple[str, str]]:
    """(question, answer) rows of `kind`, drawn from `seed`."""
    rng = random.Random(seed)
    if kind == "tool":
        pairs = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(num_examples)]
        return [(f"{a}+{b}=?", str(a + b)) for a, b in pairs]
    letters = [rng.choice(LETTERS) for _ in range(num_examples)]
    return [(f"copy: {c}", c) for c in letters]


class ToyTaskset(vf.Taskset[ToyTask, ToyConfig]):
    def load(self) -> list[ToyTask]:
        c = self.config
        return [ToyTask(ToyData(prompt=q, answer=a, system_prompt=c.system), c.task)
                for q, a in rows(c.kind, c.num_examples, c.seed)]


__all__ = ["ToyTaskset"]

if __name__ == "__main__":
    CalcTools.run()
