"""Many episodes at once: the model's turns batched through the sampler, environments and tools concurrent.

`EpisodeRunner.run(jobs)` plays every job (an environment, its seed, meta) to its end in lock-step rounds: each
round samples one turn of every live episode in one `sampler.generate` call, then answers all those turns
concurrently (asyncio): a turn with tool calls gets the tools' results, any other turn goes to `env.step`. An
environment that runs its tools itself gives their schemas as `tool_schemas` instead of `tools` (read after
`reset`): the template renders them, the calls are parsed, and the turn goes to `env.step`. When an episode ends,
however it ends, the environment's optional `close()` is awaited (under the same time limit; its error is logged).
Every `reset`, `step` and tool call runs under its time limit (a plain function in a daemon thread, a coroutine
awaited); one that raises or runs past its limit ends that episode as failed — status "failed", the error kept and
logged — and no other. A malformed tool call (bad JSON, unknown tool, wrong arguments) is answered with an error
observation and adds `format_penalty` to the turn's reward.

Limits: `max_turns` model turns (None: the environment's `max_turns` attribute, else 8; then "truncated",
reason "max_turns"), `max_tokens` in the whole episode (each turn may sample at most what is left; reason
"max_tokens"; an episode whose first prompt alone is `max_tokens` tokens or more is not played: status "failed",
reason "prompt_length", the error naming its length), `max_new_tokens` per turn (a turn cut there without a
stop token ends the episode: reason "turn_length"; its conversation message holds the cut text, an unfinished
tool call included, and "cut": True).
An environment's own truncation has
reason "env". The sequence is built as `ludic_fast.agents.episode` describes: trained tokens are sampled
tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import logging
import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ludic_fast.agents.episode import ChatTokens, EpisodeTokens
from ludic_fast.agents.protocol import AssistantTurn, Env, Message, StepResult, check_messages
from ludic_fast.agents.tools import HermesToolCallParser, ParsedTurn, Tool, ToolCallParser, as_tools
from ludic_fast.data.types import Rollout, Step, TokenTrace
from ludic_fast.rollout.sampler import SamplingConfig

log = logging.getLogger("ludic_fast.agents")


#: model turns of an episode when neither the limits nor the environment say
DEFAULT_MAX_TURNS = 8
#: the reason of a failed episode whose prompt alone fills `max_tokens`
PROMPT_TOO_LONG = "prompt_length"


class CallTimeout(Exception):
    """An environment or tool call ran past its time limit."""


def _in_daemon_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> asyncio.Future:
    """`fn(*args, **kwargs)` in a daemon thread, as a future of this loop (a hung call never blocks exit)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if not fut.done():
            fut.set_exception(error) if error is not None else fut.set_result(value)

    def run() -> None:
        try:
            value, error = fn(*args, **kwargs), None
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting episode
            value, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the loop closed while the call hung: nobody waits for it any more
            pass

    threading.Thread(target=run, daemon=True, name=f"ludic-fast-call-{getattr(fn, '__name__', 'fn')}").start()
    return fut


async def call_with_timeout(fn: Callable[..., Any], timeout_s: float, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` (awaited when it is a coroutine function), CallTimeout past `timeout_s` seconds."""
    if inspect.iscoroutinefunction(fn):
        awaitable: Any = fn(*args, **kwargs)
    else:
        awaitable = _in_daemon_thread(fn, *args, **kwargs)
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except asyncio.TimeoutError:
        raise CallTimeout(f"timed out after {timeout_s:g} s") from None


@dataclass(frozen=True)
class EpisodeLimits:
    """Turn, token and time limits of an episode, and the reward added per malformed tool call."""

    max_turns: int | None = None
    max_tokens: int = 1024
    max_new_tokens: int = 64
    env_timeout_s: float = 30.0
    tool_timeout_s: float = 30.0
    format_penalty: float = 0.0

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_tokens", "max_new_tokens"):
            value = getattr(self, name)
            if name == "max_turns" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("env_timeout_s", "tool_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")


@dataclass
class EpisodeJob:
    """One episode to play: a fresh environment, its seed, and meta copied onto the rollout."""

    env: Env
    seed: int
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Episode:
    """A played episode: its rollout (one Step per model turn, each with its TokenTrace), its token sequence,
    the conversation, status "done" | "truncated" | "failed", the truncation reason or error, and counts."""

    rollout: Rollout
    tokens: EpisodeTokens
    messages: list[Message]
    status: str = "running"
    reason: str | None = None
    error: str | None = None
    tool_calls: int = 0
    tool_errors: int = 0

    @property
    def turns(self) -> int:
        return len(self.rollout.steps)

    @property
    def live(self) -> bool:
        return self.status == "running"

    def end(self, status: str, reason: str | None = None, error: str | None = None) -> None:
        self.status, self.reason, self.error = status, reason, error
        self.rollout.meta.update(episode_status=status, episode_reason=reason, episode_error=error)

    def to_record(self) -> dict[str, Any]:
        """A JSON record for reading: the conversation, status, rewards and counts."""
        return {
            "rollout_id": self.rollout.id, "env_seed": self.rollout.meta.get("env_seed"),
            "group_id": self.rollout.meta.get("group_id"), "status": self.status, "reason": self.reason,
            "error": self.error, "total_reward": self.rollout.total_reward,
            "step_rewards": [s.reward for s in self.rollout.steps], "turns": self.turns,
            "tool_calls": self.tool_calls, "tool_errors": self.tool_errors, "tokens": len(self.tokens.ids),
            "action_tokens": sum(self.tokens.action_mask), "messages": self.messages,
        }


@dataclass
class _State:
    job: EpisodeJob
    episode: Episode
    first: list[Message] = field(default_factory=list)
    chat: ChatTokens | None = None
    tools: dict[str, Tool] = field(default_factory=dict)
    max_turns: int = 0
    parse_calls: bool = False
    pending_obs: list[Message] = field(default_factory=list)


class EpisodeRunner:
    """Plays episodes with `sampler` (`generate(prompts, sampling, seed=) -> [Completion]`, e.g.
    HFSampler or VLLMSampler) and `tokenizer` (its chat template builds the context tokens).

    stop_ids: the sampler's stop tokens (default: the tokenizer's eos); parser: the tool-call format
    (default Hermes `<tool_call>` JSON); template_kwargs go to `apply_chat_template`.
    """

    def __init__(self, sampler: Any, tokenizer: Any, *, sampling: SamplingConfig | None = None,
                 limits: EpisodeLimits | None = None, parser: ToolCallParser | None = None,
                 stop_ids: Sequence[int] | None = None, template_kwargs: dict[str, Any] | None = None):
        self.sampler, self.tokenizer = sampler, tokenizer
        self.limits = limits or EpisodeLimits()
        self.sampling = sampling or SamplingConfig(max_new_tokens=self.limits.max_new_tokens)
        self.parser = parser or HermesToolCallParser()
        if stop_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None)
            if eos is None:
                raise ValueError("the tokenizer has no eos token: pass stop_ids")
            stop_ids = [eos]
        self.stop_ids = [int(t) for t in stop_ids]
        self.template_kwargs = dict(template_kwargs or {})

    # ----------------------------------------------------------------------------------------- run
    def run_sync(self, jobs: Sequence[EpisodeJob], *, seed: int = 0) -> list[Episode]:
        """`run` in a fresh event loop."""
        return asyncio.run(self.run(jobs, seed=seed))

    async def run(self, jobs: Sequence[EpisodeJob], *, seed: int = 0) -> list[Episode]:
        """Play every job to its end; episodes in job order. Round r samples under seed (seed, r)."""
        states = [self._new_state(job) for job in jobs]
        await asyncio.gather(*(self._reset(s) for s in states))
        rounds = 0
        while True:
            live = [s for s in states if s.episode.live]
            for s in live:
                if len(s.episode.tokens.ids) >= self.limits.max_tokens:
                    s.episode.end("truncated", "max_tokens")
            live = [s for s in live if s.episode.live]
            if not live:
                await asyncio.gather(*(self._close(s) for s in states))
                return [s.episode for s in states]
            budgets = [min(self.limits.max_new_tokens, self.limits.max_tokens - len(s.episode.tokens.ids))
                       for s in live]
            sampling = dataclasses.replace(self.sampling, max_new_tokens=max(budgets))
            completions = self.sampler.generate([s.episode.tokens.ids for s in live], sampling,
                                                seed=random.Random(f"{seed}:{rounds}").getrandbits(63))
            rounds += 1
            await asyncio.gather(*(self._answer(s, c.completion_ids[:b], c.logprobs[:b],
                                                c.finish_reason if len(c.completion_ids) <= b else "length", b)
                                   for s, c, b in zip(live, completions, budgets, strict=True)))

    def _new_state(self, job: EpisodeJob) -> _State:
        rollout = Rollout(meta={**job.meta, "env_seed": job.seed,
                                "sampling_temperature": self.sampling.temperature,  # the RL objective scores at it
                                "engine": {"return_spec": {"return_chosen_logprobs": True}}})
        return _State(job, Episode(rollout, EpisodeTokens(), []))

    # ------------------------------------------------------------------------------------ env calls
    async def _reset(self, s: _State) -> None:
        env = s.job.env
        try:
            s.tools = as_tools(getattr(env, "tools", None))
            s.max_turns = int(self.limits.max_turns or getattr(env, "max_turns", None) or DEFAULT_MAX_TURNS)
            first = await call_with_timeout(env.reset, self.limits.env_timeout_s, s.job.seed)
            s.first = check_messages(first, "env.reset(seed)")
            if not s.first:
                raise ValueError("env.reset(seed) returned no messages")
            schemas = list(getattr(env, "tool_schemas", None) or [])
            if schemas and s.tools:
                raise ValueError("an environment gives either tools (run by the runner) or tool_schemas, not both")
            s.parse_calls = bool(schemas or s.tools)
            s.chat = ChatTokens(self.tokenizer, self.stop_ids,
                                tools=[t.schema for t in s.tools.values()] or schemas or None,
                                template_kwargs=self.template_kwargs)
            s.episode.messages.extend(s.first)
            s.episode.tokens.add_context(s.chat.prompt_ids(s.first))
            s.pending_obs = list(s.first)
        except Exception as exc:  # noqa: BLE001 - the episode fails, the run goes on
            self._fail(s, "env.reset", exc)
            return
        prompt = len(s.episode.tokens.ids)
        if prompt >= self.limits.max_tokens:  # no room for one sampled token: nothing to play or train
            s.episode.end("failed", PROMPT_TOO_LONG, f"the prompt is {prompt} tokens, at least the episode's budget "
                          f"max_tokens={self.limits.max_tokens} (--max-episode-tokens)")

    async def _close(self, s: _State) -> None:
        """The environment's optional `close()` once its episode has ended (an error is logged, not raised)."""
        close = getattr(s.job.env, "close", None)
        if not callable(close):
            return
        try:
            await call_with_timeout(close, self.limits.env_timeout_s)
        except Exception as exc:  # noqa: BLE001 - the episode is already played
            log.warning("episode %s (seed %s): env.close: %s: %s", s.episode.rollout.id, s.job.seed,
                        type(exc).__name__, exc)

    def _fail(self, s: _State, where: str, exc: BaseException) -> None:
        error = f"{where}: {type(exc).__name__}: {exc}"
        log.warning("episode %s (seed %s) failed: %s", s.episode.rollout.id, s.job.seed, error)
        s.episode.end("failed", error=error)

    async def _run_tools(self, s: _State, parsed: ParsedTurn) -> tuple[list[Message], int]:
        """Tool results (or error observations) of a turn's calls, and the number of malformed calls."""
        ep = s.episode
        out: list[Message] = [{"role": "tool", "name": "error", "content": f"error: {e}"} for e in parsed.errors]
        malformed = len(parsed.errors)
        ep.tool_calls += malformed  # every attempted call counts, malformed ones too
        for call in parsed.calls:
            ep.tool_calls += 1
            tool = s.tools.get(call.name)
            why = f"unknown tool {call.name!r}" if tool is None else tool.check_arguments(call.arguments)
            if why is not None:
                malformed += 1
                out.append({"role": "tool", "name": call.name, "content": f"error: {why}"})
                continue
            result = await call_with_timeout(tool.fn, self.limits.tool_timeout_s, **call.arguments)
            content = result if isinstance(result, str) else json.dumps(result)
            out.append({"role": "tool", "name": call.name, "content": content})
        ep.tool_errors += malformed
        return out, malformed

    async def _answer(self, s: _State, ids: list[int], logprobs: list[float], finish: str, budget: int) -> None:
        ep = s.episode
        prompt = list(ep.tokens.ids)
        ep.tokens.add_turn(ids, logprobs, finish)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        parsed = self.parser(text) if s.parse_calls else ParsedTurn(text.strip(), [], [])
        turn = AssistantTurn(text, list(ids), parsed.calls, parsed.errors, parsed.content)
        assistant = turn.to_message()
        if finish == "length":  # the episode ends here: the log keeps the cut text (a cut tool call included)
            assistant = {"role": "assistant", "content": text.strip(), "cut": True}
        ep.messages.append(assistant)
        info: dict[str, Any] = {}
        runs_tools = bool(s.tools) and bool(parsed.calls or parsed.errors)  # the runner answers this turn's calls
        try:
            if finish == "length":
                result = StepResult(reward=0.0, truncated=True)
                reason = "max_tokens" if budget < self.limits.max_new_tokens else "turn_length"
            elif runs_tools:
                obs, malformed = await self._run_tools(s, parsed)
                result = StepResult(obs, reward=self.limits.format_penalty * malformed)
                info = {"tool_calls": len(parsed.calls) + len(parsed.errors), "tool_errors": malformed}
                reason = None
            else:
                ep.tool_calls += len(parsed.calls) + len(parsed.errors)  # calls the environment answers itself
                result = await call_with_timeout(s.job.env.step, self.limits.env_timeout_s, turn)
                if not isinstance(result, StepResult):
                    raise TypeError(f"env.step must return a StepResult, got {type(result).__name__}")
                reason = "env" if result.truncated else None
        except Exception as exc:  # noqa: BLE001 - the episode fails, the run goes on
            self._fail(s, "tool" if runs_tools else "env.step", exc)
            return
        step = Step(
            index=len(ep.rollout.steps), prev_obs=s.pending_obs, action=text, next_obs=result.observations,
            reward=result.reward, truncated=result.truncated, terminated=result.done,
            info={**result.info, **info},
            trace=TokenTrace(prompt, list(ids), list(logprobs), finish),
        )
        ep.rollout.steps.append(step)
        ep.messages.extend(result.observations)
        s.pending_obs = result.observations
        if result.done:
            ep.end("done")
        elif result.truncated:
            ep.end("truncated", reason)
        elif len(ep.rollout.steps) >= s.max_turns:
            ep.end("truncated", "max_turns")
        else:
            try:
                obs_ids = s.chat.observation_ids(s.first, assistant, result.observations)
            except Exception as exc:  # noqa: BLE001 - a template that cannot render these observations
                self._fail(s, "chat template", exc)
                return
            if len(ep.tokens.ids) + len(obs_ids) >= self.limits.max_tokens:
                ep.end("truncated", "max_tokens")
            else:
                ep.tokens.add_context(obs_ids)
        if not ep.live:
            step.truncated = ep.status == "truncated"


__all__ = ["PROMPT_TOO_LONG", "CallTimeout", "call_with_timeout", "EpisodeLimits", "EpisodeJob", "Episode",
           "EpisodeRunner"]
