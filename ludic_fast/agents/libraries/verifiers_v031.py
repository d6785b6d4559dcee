"""verifiers 0.3.1 environments (`load_environment()` modules) as environments of `ludic_fast.agents`.

verifiers (https://github.com/PrimeIntellect-ai/verifiers, `pip install 'ludic-fast[verifiers]'`) 0.3.1: its
classic API, `import verifiers as vf`: `SingleTurnEnv`, `MultiTurnEnv` with `env_response`, `ToolEnv`, `Rubric`s
of weighted reward functions. `ludic_fast.agents.libraries.verifiers.make_env` (the `--env` factory) builds a
`VerifiersEnv` under 0.3.1 and `verifiers_v04`'s under 0.4.0. `VerifiersEnv(vf_env)` plays rollouts of one loaded
environment, each an episode of our protocol, our sampler writing every turn:

- The environment's own `rollout(input, client, model)` runs (its state, stop conditions, `env_response`, tool
  calls, final response) as a task in the runner's event loop, with a client of ours in place of its OpenAI
  client. When the rollout asks the client for a response, the adapter hands the request's messages to the
  runner (the first request's as the episode's first messages, a later one's after the model's last turn as
  the observations) and answers it with the turn our sampler produced (content, tool calls). The runner builds
  the trained tokens from the sampled ids; nothing verifiers renders is re-tokenised.
- A request whose earlier messages are not the conversation so far (an environment that rewrites history) is
  an error: such a rollout cannot be trained token-exactly.
- Tools: the environment's `tool_defs` are the template's tool schemas; the runner parses the calls onto the
  turn (`tool_schemas`) and verifiers runs them (`ToolEnv.env_response`). A malformed call is left out of the
  turn's calls, as an OpenAI server's tool parser leaves it out.
- The reward: when the rollout ends, the environment's rubric scores it (`rubric.score_rollout(state)`):
  Σ_i w_i f_i(prompt, completion, answer, state, ...), the last step's reward; each function's score is in
  the step's `info["rewards"]` (logged as `train/episode_reward_<name>`).
- Row `seed % len(dataset)` of the environment's dataset (`split="eval"`: its eval dataset) is the episode's.
- Refused with a one-line error naming the need: an environment whose rollouts run in Prime sandboxes, one
  scored by a judge model behind an API (`JudgeRubric`), one whose rubric scores whole groups at once, one that
  is not a `MultiTurnEnv`, and missing API keys (`vf.ensure_keys`).

`load(env, **env_args)`: `env` is a `.py` file or an importable module with `load_environment(**env_args)` (or an
installed hub environment's id); each environment is loaded once per process and shared by its episodes.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import itertools
import json
import random
import time
from pathlib import Path
from typing import Any

from ludic_fast.agents.libraries import import_library
from ludic_fast.agents.protocol import AssistantTurn, Message, StepResult

#: model name the environment's rollouts record (our sampler does not read it)
MODEL_NAME = "ludic-fast"
SPLITS = ("train", "eval")
#: the verifiers releases driven here: 0.3.1 (its classic API, this module) and 0.4.0 (`verifiers.v1`,
#: ludic_fast.agents.libraries.verifiers_v04); any other is refused in one line
SUPPORTED_VERSIONS = ("0.3.1", "0.4.0")
_LOADED: dict[str, Any] = {}


def installed_version() -> str:
    """The installed verifiers release; ValueError (one line, naming the supported ones) for any other."""
    vf = import_library("verifiers", "verifiers", "verifiers environments")
    version = getattr(vf, "__version__", "unknown")
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(f"verifiers {version} is installed; ludic_fast.agents.libraries.verifiers supports verifiers "
                         f"{' and '.join(SUPPORTED_VERSIONS)} (pip install 'verifiers=={SUPPORTED_VERSIONS[-1]}')")
    return version


def _vf() -> Any:
    if installed_version() != "0.3.1":
        raise ValueError(f"verifiers {installed_version()} is installed: its environments are loaded by "
                         "ludic_fast.agents.libraries.verifiers_v04 (make_env picks it)")
    return import_library("verifiers", "verifiers", "verifiers environments")


def _text(content: Any, what: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = [p.get("text") if isinstance(p, dict) else getattr(p, "text", None) for p in content]
        if all(isinstance(p, str) for p in parts):
            return "".join(parts)
    raise TypeError(f"{what}: only text content is supported, got {content!r:.80}")


def to_message(message: Any) -> Message:
    """A verifiers message (pydantic or dict) as a chat message dict (text content, OpenAI tool calls)."""
    get = message.get if hasattr(message, "get") else message.model_dump().get  # 0.4's messages: plain pydantic
    out: Message = {"role": get("role"), "content": _text(get("content"), f"a {get('role')} message")}
    if get("tool_call_id"):
        out["tool_call_id"] = get("tool_call_id")
    calls = get("tool_calls") or []
    if calls:
        out["tool_calls"] = [{"type": "function", "function": {"name": c.get("name"),
                                                               "arguments": _arguments(c.get("arguments"))}}
                             for c in calls]
    return out


def _arguments(arguments: Any) -> Any:
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return arguments


def _rubrics(rubric: Any) -> list[Any]:
    return [rubric] + [r for sub in getattr(rubric, "rubrics", []) for r in _rubrics(sub)]


def check_runnable(vf_env: Any, name: str) -> None:
    """ValueError naming what the environment needs that an adapter run cannot give (module docstring)."""
    vf = _vf()
    if isinstance(vf_env, vf.SandboxEnv):
        raise ValueError(f"verifiers environment {name} runs its rollouts in Prime sandboxes (a remote sandbox "
                         "service and PRIME_API_KEY), which this adapter does not provide")
    if not isinstance(vf_env, vf.MultiTurnEnv):
        raise ValueError(f"verifiers environment {name} is a {type(vf_env).__name__}, not a MultiTurnEnv "
                         "(SingleTurnEnv, MultiTurnEnv, ToolEnv and their subclasses are supported)")
    rubrics = _rubrics(vf_env.rubric)
    if any(isinstance(r, vf.JudgeRubric) for r in rubrics):
        raise ValueError(f"verifiers environment {name} is scored by a judge model behind an OpenAI-compatible "
                         "API (JudgeRubric), which this adapter does not call")
    if vf_env.rubric.has_group_rewards:
        raise ValueError(f"verifiers environment {name} has group reward functions (scored over all rollouts of "
                         "an example at once), which per-episode scoring does not run")


def load(env: str, **env_args: Any) -> Any:
    """The verifiers Environment `env` (a .py file or a module with `load_environment`, or a hub id), loaded once
    per process for the same arguments and checked by `check_runnable`."""
    if not isinstance(env, str) or not env:
        raise ValueError(f"env must name a verifiers environment module or .py file, got {env!r}")
    key = json.dumps([env, sorted(env_args.items())], default=repr)
    if key in _LOADED:
        return _LOADED[key]
    vf = _vf()
    try:
        if env.endswith(".py"):
            vf_env = _load_file(Path(env), env_args)
        else:
            vf_env = vf.load_environment(env, **env_args)
    except vf.MissingKeyError as exc:
        raise ValueError(f"verifiers environment {env} needs an external API: {exc}") from None
    except RuntimeError as exc:  # verifiers' wrapping of load_environment's own errors
        raise ValueError(str(exc)) from None
    check_runnable(vf_env, env)
    _LOADED[key] = vf_env
    return vf_env


def _load_file(path: Path, env_args: dict[str, Any]) -> Any:
    if not path.is_file():
        raise ValueError(f"verifiers environment file {str(path)!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"ludic_fast_vf_env_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, "load_environment", None)
    if not callable(fn):
        raise ValueError(f"{path} defines no load_environment()")
    return fn(**env_args)


@functools.cache
def _turn_client_class() -> type:
    vf = _vf()

    class TurnClient(vf.Client):
        """A verifiers client whose responses come from outside: each request (prompt, tool definitions, a
        future for the response) is queued on `requests` and answered by whoever holds the future."""

        def __init__(self) -> None:
            super().__init__(None)
            self.requests: asyncio.Queue = asyncio.Queue()

        def setup_client(self, config: Any) -> Any:
            raise TypeError("TurnClient takes no client configuration")

        async def to_native_tool(self, tool: Any) -> Any:
            return tool

        async def to_native_prompt(self, messages: Any) -> tuple[Any, dict]:
            return messages, {}

        async def get_native_response(self, prompt: Any, model: str, sampling_args: Any, tools: Any = None,
                                      **kwargs: Any) -> Any:
            reply = asyncio.get_running_loop().create_future()
            await self.requests.put((list(prompt), list(tools or []), reply))
            return await reply

        async def raise_from_native_response(self, response: Any) -> None:
            return None

        async def from_native_response(self, response: Any) -> Any:
            return response

        async def close(self) -> None:
            return None

    return TurnClient


def tool_schema(tool: Any) -> dict[str, Any]:
    """A verifiers tool definition in the OpenAI function form chat templates render."""
    return {"type": "function", "function": {"name": tool.name, "description": tool.description,
                                             "parameters": dict(tool.parameters)}}


class VerifiersEnv:
    """Rollouts of the verifiers environment `vf_env` as episodes (module docstring).

    split: "train" (its dataset) or "eval" (its eval dataset; verifiers falls back to the dataset)."""

    def __init__(self, vf_env: Any, *, split: str = "train"):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.vf_env = vf_env
        self.rows = vf_env.get_dataset() if split == "train" else vf_env.get_eval_dataset()
        if len(self.rows) == 0:
            raise ValueError(f"the verifiers environment's {split} dataset is empty")
        self.max_turns = vf_env.max_turns if vf_env.max_turns > 0 else None
        # the environment's tools; a row's own (info["tool_defs"]) replace them at reset
        self.tool_schemas = [tool_schema(t) for t in vf_env.tool_defs or []] or None
        self._rollout: asyncio.Future | None = None
        self._client: Any = None
        self._reply: asyncio.Future | None = None
        self._sent: list[Message] = []
        self._calls = itertools.count()

    async def _next_request(self) -> tuple[list[Any], list[Any], asyncio.Future] | None:
        """The rollout's next request to the model, or None when the rollout ended instead."""
        getter = asyncio.ensure_future(self._client.requests.get())
        done, _ = await asyncio.wait({getter, self._rollout}, return_when=asyncio.FIRST_COMPLETED)
        if getter in done:
            return getter.result()
        getter.cancel()
        return None

    def _start(self, seed: int) -> None:
        row = dict(self.rows[seed % len(self.rows)])
        self._client = _turn_client_class()()
        self._rollout = asyncio.ensure_future(self.vf_env.rollout(row, self._client, MODEL_NAME, {}))

    def _ended(self) -> str:
        return f"error: {self._rollout.result().get('error')!r}"

    async def reset(self, seed: int) -> list[Message]:
        """Starts the rollout of row `seed % len(dataset)`; its first request's messages."""
        self._start(seed)
        request = await self._next_request()
        if request is None:
            raise RuntimeError(f"the verifiers rollout ended before asking the model ({self._ended()})")
        prompt, tools, self._reply = request
        self.tool_schemas = [tool_schema(t) for t in tools] or None
        self._sent = [to_message(m) for m in prompt]
        return list(self._sent)

    def _response(self, turn: AssistantTurn) -> Any:
        vf = _vf()
        calls = [vf.ToolCall(id=f"call_{next(self._calls)}", name=c.name, arguments=json.dumps(c.arguments))
                 for c in turn.tool_calls]
        message = vf.ResponseMessage(content=turn.content, tool_calls=calls or None,
                                  finish_reason="tool_calls" if calls else "stop", is_truncated=False)
        return vf.Response(id=f"ludic-fast-{random.getrandbits(64):016x}", created=int(time.time()),
                           model=MODEL_NAME, message=message)

    async def step(self, turn: AssistantTurn) -> StepResult:
        """Answers the pending request with `turn`; the next request's new messages, or the rubric's score."""
        if self._reply is None:
            raise RuntimeError("step before reset")
        response = self._response(turn)
        self._reply.set_result(response)
        self._reply = None
        said = to_message(response.message)
        request = await self._next_request()
        if request is None:
            return await self._score()
        prompt, _, self._reply = request
        messages = [to_message(m) for m in prompt]
        so_far = [*self._sent, said]
        if messages[: len(so_far)] != so_far:
            raise ValueError("the verifiers environment rewrote earlier messages of the conversation (its "
                             "get_prompt_messages is not append-only), so its rollouts cannot be trained token-exactly")
        self._sent = messages
        return StepResult(messages[len(so_far):])

    async def _score(self) -> StepResult:
        state = self._rollout.result()
        if state.get("error") is not None:
            raise RuntimeError(f"the verifiers rollout failed: {state['error']!r}")
        rubric = self.vf_env.rubric
        await rubric.score_rollout(state)
        await rubric.cleanup(state)
        final = [to_message(m) for m in state.get("final_env_response") or []]
        info = {"rewards": {k: float(v) for k, v in (state.get("metrics") or {}).items()},
                "verifiers": {"stop_condition": state.get("stop_condition"), "example_id": state.get("example_id")}}
        return StepResult(final, reward=float(state["reward"]), done=not state.get("is_truncated"),
                          truncated=bool(state.get("is_truncated")), info=info)

    async def close(self) -> None:
        """Cancels a rollout the runner ended early (limits, a failure)."""
        if self._rollout is not None and not self._rollout.done():
            self._rollout.cancel()
            try:
                await self._rollout
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the episode is already over
                pass

    def demonstrations(self, n: int, seed: int = 0) -> list[list[Message]]:
        """n conversations of rows drawn from `seed`: the row's prompt, then its `answer` as the one assistant
        turn (the SFT warm-up of a dataset whose answer column is the reply the rubric wants)."""
        if "answer" not in self.rows.column_names:
            raise ValueError("the verifiers environment's dataset has no answer column to demonstrate")
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            row = self.rows[rng.randrange(len(self.rows))]
            prompt = [to_message(m) for m in row["prompt"]]
            out.append([*prompt, {"role": "assistant", "content": str(row["answer"])}])
        return out


__all__ = ["MODEL_NAME", "SPLITS", "SUPPORTED_VERSIONS", "VerifiersEnv", "check_runnable", "installed_version", "load",
           "to_message", "tool_schema"]
