"""A multi-turn verifiers 0.4 environment (`import verifiers.v1 as vf`), nothing to download: the taskset of
examples/verifiers_v04_toy_env.py ("copy: k") with an `Env` of its own that talks to the agent turn by turn
(`agent.interaction(task)`), as verifiers 0.4 writes multi-turn environments (0.3.1's `MultiTurnEnv.env_response`).

- The env answers a wrong reply with the letter ("no, it is k. copy: k") and stops at a right one; the agent
  has at most 3 turns (`max_turns`).
- Rewards: `exact` (weight 1.0: the last reply equals the letter) + `first_try` (weight 0.5: the first reply
  already did).
"""

from __future__ import annotations

import verifiers.v1 as vf
from verifiers_v04_toy_env import ToyConfig, ToyData, ToyTaskConfig, last_reply, rows


class CopyTask(vf.Task[ToyData, vf.State, ToyTaskConfig]):
    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        """1 when the last reply equals the answer."""
        return float(last_reply(trace) == self.data.answer)

    @vf.reward(weight=0.5)
    async def first_try(self, trace: vf.Trace) -> float:
        """1 when the first reply already equals the answer."""
        replies = trace.assistant_messages
        return float(bool(replies) and (replies[0].content or "").strip() == self.data.answer)


class CopyTaskset(vf.Taskset[CopyTask, ToyConfig]):
    def load(self) -> list[CopyTask]:
        c = self.config
        return [CopyTask(ToyData(prompt=q, answer=a, system_prompt=c.system), c.task)
                for q, a in rows("single", c.num_examples, c.seed)]


class CopyEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(max_turns=3)


class CopyUntilRight(vf.Env[CopyEnvConfig]):
    """Asks again, telling the letter, until the reply is right."""

    async def run(self, task: CopyTask, agents: vf.Agents) -> None:
        answer = task.data.answer
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()  # the task's prompt opens: the agent's first reply
            while not segment.terminated and segment.last_reply != answer:
                segment = await chat.turn(f"no, it is {answer}. copy: {answer}")


__all__ = ["CopyTaskset", "CopyUntilRight"]
