"""verifiers 0.4 environments (`verifiers.v1`) as environments of `ludic_fast.agents`; used by
`ludic_fast.agents.libraries.verifiers.make_env` when verifiers 0.4.0 is installed.

verifiers 0.4 (`import verifiers.v1 as vf`): a `Taskset` yields `Task`s (their data: prompt, system prompt; their
weighted `@vf.reward` methods and `@vf.metric`s; their `toolsets`, MCP tool servers); an `Env` plays a task as an
episode: `SingleAgentEnv` for a plain taskset, or the taskset's own `Env` whose `run(task, agents)` drives its
agent (turn by turn through `agent.interaction(task)`: the multi-turn environments). The agent is a harness
program talking to the model through verifiers' interception server. `VerifiersV04Env(vf_env)` plays episodes of
our protocol with our sampler writing every turn:

- The episode runs as verifiers runs it, `vf_env.run_episode(task, ctx)` (the env's `run`, the harness program,
  the task's tool servers, the task's scoring), as a task in the runner's event loop, behind an interception
  server of its own whose model client is ours. Each model request the harness sends (verifiers' resolved
  prompt and tools) goes to the runner, the first request's messages as the episode's first messages, a later
  one's after the model's last turn as the observations, and is answered with the turn our sampler produced
  (content, tool calls). The trained tokens are the sampled ids; nothing verifiers renders is re-tokenised.
  A request whose earlier messages are not the conversation so far fails the episode (as for 0.3.1).
- The harness is verifiers' `null` (its chat loop: it calls the task's MCP tools and ends on a reply without
  tool calls), in verifiers' `subprocess` runtime: a local process per harness segment, prepared by `uv` as
  verifiers prepares it. Tools: the tools the harness offers (named `<server>_<tool>`) are the template's tool
  schemas; the runner parses the calls onto the turn and the harness runs them.
- The reward: the episode's trace reward, verifiers' own `Task.score`: Σ_i w_i r_i over the task's
  `@vf.reward`s, on the last step; each reward's score (unweighted) and each metric is in the step's
  `info["rewards"]` (logged as `train/episode_reward_<name>`).
- Task `seed % len(tasks)` of the taskset (a finite taskset, iterated once). SFT warm-up: `demonstrations` for
  tasks whose data has an `answer` field.
- Refused with a one-line error: an env with more than one agent seat (user simulators, judges as agents,
  best-of-n: ludic-fast trains one seat), a harness other than `null` (the others run the model's commands or
  agent CLIs in a container), an infinite taskset, an unknown taskset.

`load(env, harness="null", **taskset_args)`: `env` is a taskset id (an importable module exporting its
`Taskset`, and its `Env` if it has one) or a `.py` file of one (its folder is put on `sys.path` and on
`PYTHONPATH`, where verifiers' tool-server subprocesses import it); the other arguments are the taskset
config's fields.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import itertools
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from ludic_fast.agents.libraries import import_library
from ludic_fast.agents.libraries.verifiers_v031 import MODEL_NAME, VerifiersEnv, to_message
from ludic_fast.agents.protocol import AssistantTurn, Message, StepResult

#: the harness this adapter runs (verifiers' tool-less chat loop, which calls MCP tools)
HARNESSES = ("null",)
_LOADED: dict[str, Any] = {}


def _vf() -> Any:
    return import_library("verifiers.v1", "verifiers", "verifiers environments")


def _taskset_id(env: str) -> str:
    if not env.endswith(".py"):
        return env
    path = Path(env).resolve()
    if not path.is_file():
        raise ValueError(f"verifiers taskset file {env!r} does not exist")
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if folder not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([folder, *filter(None, paths)])
    return path.stem


def load(env: str, harness: str = "null", **taskset_args: Any) -> Any:
    """The verifiers 0.4 Env of taskset `env` (module docstring), loaded once per process for the same arguments,
    its one agent seat on `harness` in the subprocess runtime."""
    if not isinstance(env, str) or not env:
        raise ValueError(f"env must name a verifiers taskset module or .py file, got {env!r}")
    if harness not in HARNESSES:
        raise ValueError(f"harness must be one of {HARNESSES} (verifiers' chat loop; the other harnesses run the "
                         f"model's commands or agent programs), got {harness!r}")
    key = json.dumps([env, harness, sorted(taskset_args.items())], default=repr)
    if key in _LOADED:
        return _LOADED[key]
    vf = _vf()
    taskset_id = _taskset_id(env)
    try:
        config_cls = vf.env_config_type(taskset_id)
    except ModuleNotFoundError as exc:
        raise ValueError(str(exc).splitlines()[0]) from None
    seats = [name for name, field in config_cls.model_fields.items() if isinstance(field.default, vf.AgentConfig)]
    if len(seats) != 1:
        raise ValueError(f"verifiers environment {env} has {len(seats)} agent seats ({', '.join(seats)}); "
                         "ludic-fast trains environments of one seat")
    data = {"taskset": {**taskset_args, "id": taskset_id}, "interception": {"type": "server"},
            seats[0]: {"harness": {"id": harness}, "runtime": {"type": "subprocess"}}}
    try:
        vf_env = vf.load_environment(vf.resolve_env_config(data))
    except Exception as exc:  # pydantic's validation of the taskset arguments, the taskset's own checks
        raise ValueError(f"verifiers environment {env}: {' '.join(str(exc).split())}") from None
    if not vf_env.taskset.bounded:
        raise ValueError(f"verifiers environment {env} has an infinite taskset; episodes index a finite one")
    _LOADED[key] = vf_env
    return vf_env


@functools.cache
def _turn_client_class() -> type:
    vf = _vf()
    from verifiers.v1.clients.train import serialize_completion
    from verifiers.v1.dialects import ChatDialect

    class TurnClient(vf.Client):
        """A verifiers model client whose responses come from outside: each request (prompt, tools, a future for
        the `vf.Response`) is queued on `requests` and answered by whoever holds the future."""

        def __init__(self, config: Any) -> None:
            self.config = config
            self.requests: asyncio.Queue = asyncio.Queue()

        async def get_response(self, dialect: Any, body: dict, sampling: Any, session_id: str | None = None,
                               turn: Any = None, headers: Any = None) -> Any:
            if not isinstance(dialect, ChatDialect):
                raise NotImplementedError(f"only the chat-completions dialect is served, got {type(dialect).__name__}")
            if turn is not None:
                prompt, tools = turn.prompt, turn.tools
            else:
                request = dialect.parse_request(body)
                prompt, tools = request.messages, request.tools
            reply = asyncio.get_running_loop().create_future()
            await self.requests.put((list(prompt), list(tools or []), reply))
            response = await reply
            response.raw = serialize_completion(response, MODEL_NAME)  # what the harness's OpenAI SDK reads
            return response

    return TurnClient


async def _play(vf_env: Any, task: Any, client: Any) -> Any:
    """verifiers' episode of `task` behind an interception server of its own whose model client is `client`."""
    vf = _vf()
    env = copy.copy(vf_env)  # serving() keeps its interception server on the env: one per episode
    async with env.serving():
        env._interception.clients[client.config.model_dump_json()] = client
        return await env.run_episode(task, vf.ModelContext(model=MODEL_NAME, client=client.config))


class VerifiersV04Env(VerifiersEnv):
    """Episodes of the verifiers 0.4 Env `vf_env` (module docstring). split: "train" only (0.4 tasksets select
    their rows through their own config)."""

    def __init__(self, vf_env: Any, *, split: str = "train"):
        if split != "train":
            raise ValueError(f"split must be 'train' for a verifiers 0.4 taskset (it has no eval split), got {split!r}")
        self.vf_env = vf_env
        self.rows = list(vf_env.taskset)
        if not self.rows:
            raise ValueError("the verifiers taskset is empty")
        (seat,) = [value for _, value in vf_env.config if isinstance(value, _vf().AgentConfig)]
        self.max_turns = seat.max_turns
        self.tool_schemas = None  # the harness lists the tools with its first request
        self._rollout: asyncio.Future | None = None
        self._client: Any = None
        self._reply: asyncio.Future | None = None
        self._sent: list = []
        self._calls = itertools.count()

    def _start(self, seed: int) -> None:
        # a "train" client config: the interception server asks the client for whole responses (as it asks
        # prime-rl's renderer client) instead of relaying a provider's stream
        vf = _vf()
        config = vf.TrainClientConfig(base_url=f"http://ludic-fast.invalid/{random.getrandbits(64):016x}",
                                     api_key_var="LUDIC_FAST_NO_KEY")
        self._client = _turn_client_class()(config)
        self._rollout = asyncio.ensure_future(_play(self.vf_env, self.rows[seed % len(self.rows)], self._client))

    def _ended(self) -> str:
        return _errors(self._rollout.result()) or "no error"

    def _response(self, turn: AssistantTurn) -> Any:
        vf = _vf()
        calls = [vf.ToolCall(id=f"call_{next(self._calls)}", name=c.name, arguments=json.dumps(c.arguments))
                 for c in turn.tool_calls]
        message = vf.AssistantMessage(content=turn.content, tool_calls=calls or None)
        return vf.Response(id=f"ludic-fast-{random.getrandbits(64):016x}", created=int(time.time()),
                           model=MODEL_NAME, message=message, finish_reason="tool_calls" if calls else "stop")

    async def _score(self) -> StepResult:
        episode = self._rollout.result()
        errors = _errors(episode)
        if errors:
            raise RuntimeError(f"the verifiers episode failed: {errors}")
        (trace,) = episode.traces
        rewards = {name: float(r.score) for name, r in trace.rewards.items() if r is not None}
        rewards.update({name: float(v) for name, v in trace.metrics.items() if v is not None})
        info = {"rewards": rewards, "verifiers": {"stop_condition": trace.stop_condition, "task": episode.task.key}}
        return StepResult([], reward=float(trace.reward), done=not trace.is_truncated,
                          truncated=trace.is_truncated, info=info)

    def demonstrations(self, n: int, seed: int = 0) -> list[list[Message]]:
        """n conversations of tasks drawn from `seed`: the task's system prompt and prompt as the `null` harness
        sends them, then its data's `answer` field as the one assistant turn (the SFT warm-up of a taskset whose
        answer is the reply its rewards want)."""
        if not all(isinstance(getattr(task.data, "answer", None), str) for task in self.rows):
            raise ValueError("the verifiers taskset's tasks have no `answer` field to demonstrate")
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            data = self.rows[rng.randrange(len(self.rows))].data
            system = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
            prompt = [{"role": "user", "content": data.prompt}] if isinstance(data.prompt, str) else \
                [to_message(m) for m in data.prompt or []]
            out.append([*system, *prompt, {"role": "assistant", "content": data.answer}])
        return out


def _errors(episode: Any) -> str:
    errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
    return "; ".join(f"{e.type}: {' '.join(e.message.split())[:300]}" for e in errors)


def make_env(env: str, split: str = "train", **env_args: Any) -> VerifiersV04Env:
    """The `--env` factory under verifiers 0.4 (`ludic_fast.agents.libraries.verifiers:make_env` calls it)."""
    return VerifiersV04Env(load(env, **env_args), split=split)


__all__ = ["HARNESSES", "VerifiersV04Env", "load", "make_env"]
