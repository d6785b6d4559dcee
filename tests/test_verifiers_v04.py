"""verifiers 0.4 environments (ludic_fast.agents.libraries.verifiers_v04, picked by verifiers.make_env): the
reward is verifiers' own score of the same episode, multi-turn and tool episodes are token-exact, what cannot
run here is refused in one line. Runs where verifiers 0.4.0 is installed: `make test` runs it in .venv-verifiers
(verifiers 0.4 pins mcp 2, 0.3.1 in .venv pins mcp < 2) with LUDIC_FAST_REQUIRE_VERIFIERS=1; elsewhere it skips.
The environments are examples/verifiers_v04_toy_env.py (single-turn, tool) and verifiers_v04_toy_multiturn.py."""

from __future__ import annotations

import asyncio
import copy
import json
import os
from pathlib import Path

import pytest

if os.environ.get("LUDIC_FAST_REQUIRE_VERIFIERS") == "1":
    import verifiers
    assert verifiers.__version__ == "0.4.0", f"LUDIC_FAST_REQUIRE_VERIFIERS=1 but verifiers {verifiers.__version__}"
verifiers = pytest.importorskip("verifiers", reason="verifiers is not installed")
if verifiers.__version__ != "0.4.0":
    pytest.skip(f"verifiers {verifiers.__version__} is installed, not 0.4.0", allow_module_level=True)

import verifiers.v1 as vf  # noqa: E402
from _scripted_sampler import Replies, check_tool_episode_tokens, play, reasoning_char_tokenizer  # noqa: E402

from ludic_fast.agents import EpisodeJob, EpisodeLimits, EpisodeRunner  # noqa: E402
from ludic_fast.agents.episode import render_ids  # noqa: E402
from ludic_fast.agents.libraries import verifiers_v04  # noqa: E402
from ludic_fast.agents.libraries.verifiers import make_env  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TOY = str(EXAMPLES / "verifiers_v04_toy_env.py")
MULTI = str(EXAMPLES / "verifiers_v04_toy_multiturn.py")
CALL = '<tool_call>{"name": "calc_add", "arguments": {"a": 61, "b": 48}}</tool_call>'
SUM_SEED = 3  # row 3 of kind "tool" (seed 0) is 61+48=?


@pytest.fixture(scope="module")
def tok():
    return reasoning_char_tokenizer()


class ScriptedClient(vf.Client):
    """A verifiers model client of the test's own: each response is the next scripted (content, calls) turn."""

    def __init__(self, config, turns):
        self.config, self.turns = config, list(turns)

    async def get_response(self, dialect, body, sampling, session_id=None, turn=None, headers=None):
        from verifiers.v1.clients.train import serialize_completion

        content, calls = self.turns.pop(0)
        calls = [vf.ToolCall(id=f"c{i}", name=n, arguments=json.dumps(a)) for i, (n, a) in enumerate(calls)]
        response = vf.Response(id="r", created=0, model="m", message=vf.AssistantMessage(content=content,
                               tool_calls=calls or None), finish_reason="tool_calls" if calls else "stop")
        response.raw = serialize_completion(response, "m")
        return response


def library_score(vf_env, task, turns):
    """The episode verifiers itself plays (its env, harness, tool servers, scoring) with the scripted turns."""
    async def go():
        env = copy.copy(vf_env)
        config = vf.TrainClientConfig(base_url="http://scripted.invalid", api_key_var="NO_KEY")
        async with env.serving():
            env._interception.clients[config.model_dump_json()] = ScriptedClient(config, turns)
            return await env.run_episode(task, vf.ModelContext(model="m", client=config))
    episode = asyncio.run(go())
    assert episode.ok, episode.errors
    (trace,) = episode.traces
    return trace.reward, {k: r.score for k, r in trace.rewards.items()}, trace.is_truncated


def check_against_library(ep, env, turns, want, seed=3):
    """The episode's reward, per-reward scores and end equal those of verifiers' own episode of the same turns."""
    reward, scores, truncated = library_score(env.vf_env, env.rows[seed], turns)
    last = ep.rollout.steps[-1]
    assert ep.rollout.total_reward == pytest.approx(reward, abs=0) == pytest.approx(want)
    assert {k: last.info["rewards"][k] for k in scores} == scores  # each reward's own score
    assert ep.status == ("truncated" if truncated else "done"), ep.error
    assert all(s.reward == 0.0 for s in ep.rollout.steps[:-1])
    assert [m["content"] for m in ep.messages if m["role"] == "assistant"] == [t[0] for t in turns]


@pytest.mark.parametrize("kind,replies,turns,want", [
    ("single", ["e"], [("e", [])], 1.2),                       # exact (1.0) + short (0.2)
    ("single", ["no way"], [("no way", [])], 0.0),
    ("single", ["x"], [("x", [])], 0.2),
    ("multi", ["e"], [("e", [])], 1.5),                        # exact + first_try (0.5)
    ("multi", ["x", "e"], [("x", []), ("e", [])], 1.0),        # solved after the env's answer
    ("multi", ["x", "y", "z"], [("x", []), ("y", []), ("z", [])], 0.0),  # verifiers' max_turns: truncated
])  # the tool episode: test_tool_episode_is_token_exact_and_verifiers_runs_the_tool
def test_reward_is_verifiers_own_score_of_the_same_episode(tok, kind, replies, turns, want):
    env = make_env(MULTI, num_examples=8) if kind == "multi" else make_env(TOY, kind=kind, num_examples=8)
    assert isinstance(env, verifiers_v04.VerifiersV04Env)
    _, ep = play(tok, env, replies)
    check_against_library(ep, env, turns, want)


def test_multi_turn_episode_is_token_exact(tok):
    env = make_env(MULTI, num_examples=8, system="be brief")
    assert env.max_turns == 3  # the env's seat's own limit
    sampler, ep = play(tok, env, ["<think>hm</think>x", "e"])
    assert ep.status == "done" and ep.turns == 2 and ep.rollout.total_reward == 1.0
    toks = ep.tokens
    for prompt, span in zip(sampler.prompts, toks.turns, strict=True):  # the sampler saw the episode's prefix
        assert prompt == toks.ids[: span.start]
    assert [t for t, m in zip(toks.ids, toks.action_mask) if m] == [t for s in sampler.sampled for t in s]
    first = ep.messages[:2]
    assert first == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "copy: e"}]
    assert toks.ids[: toks.turns[0].start] == render_ids(tok, first, tools=None, add_generation_prompt=True)
    between = tok.decode(toks.ids[toks.turns[0].end : toks.turns[1].start])
    assert between == "\n[U]no, it is e. copy: e\n[A]"  # the env's turn, rendered once, after the model's
    assert "<think>hm</think>" not in tok.decode(render_ids(tok, ep.messages, tools=None,
                                                            add_generation_prompt=False))


def test_tool_episode_is_token_exact_and_verifiers_runs_the_tool(tok):
    env = make_env(TOY, kind="tool", num_examples=8, system="use add")
    sampler, ep = play(tok, env, [CALL, "109"], seed=SUM_SEED)
    assert ep.status == "done" and ep.turns == 2 and ep.tool_calls == 1
    check_against_library(ep, env, [("", [("calc_add", {"a": 61, "b": 48})]), ("109", [])], 1.0, seed=SUM_SEED)
    schema = env.tool_schemas
    assert [s["function"]["name"] for s in schema] == ["calc_add"]
    assert schema[0]["function"]["parameters"]["required"] == ["a", "b"]
    check_tool_episode_tokens(tok, ep, sampler, schema, "calc_add")


def test_a_rollout_the_runner_cuts_short_is_cancelled(tok):
    env = make_env(MULTI, num_examples=8)
    runner = EpisodeRunner(Replies(tok, ["x"]), tok,
                           limits=EpisodeLimits(max_tokens=4096, max_new_tokens=16, max_turns=1))

    async def play_and_look():  # looked at inside the loop: asyncio.run cancels what is left when it ends
        (ep,) = await runner.run([EpisodeJob(env, seed=3)])
        return ep, env._rollout.cancelled()

    ep, cancelled = asyncio.run(play_and_look())
    assert ep.status == "truncated" and ep.reason == "max_turns" and ep.turns == 1
    assert cancelled  # close() ended verifiers' episode, which was waiting for turn 2


def test_demonstrations_are_the_harness_prompt_and_the_answer(tok):
    env = make_env(MULTI, num_examples=8, system="be brief")
    _, ep = play(tok, env, ["e"])
    assert ep.rollout.total_reward == 1.5
    assert ep.messages[:2] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "copy: e"}]
    demos = env.demonstrations(20, seed=0)
    assert len({d[2]["content"] for d in demos}) > 1  # rows drawn from the seed
    for d in demos:  # what the harness sends, then the answer
        answer = d[2]["content"]
        assert d == [ep.messages[0], {"role": "user", "content": f"copy: {answer}"},
                     {"role": "assistant", "content": answer}]
    assert env.demonstrations(20, seed=0) == demos


def test_refusals(tmp_path):
    make_env(TOY)
    with pytest.raises(ValueError, match="harness must be one of"):
        make_env(TOY, harness="bash")
    with pytest.raises(ValueError, match="taskset 'no_such_taskset' not found"):
        make_env("no_such_taskset")
    with pytest.raises(ValueError, match="does not exist"):
        make_env(str(tmp_path / "missing.py"))
    with pytest.raises(ValueError, match="split must be 'train'"):
        make_env(TOY, split="eval")
    with pytest.raises(ValueError, match="verifiers environment .*kind"):
        make_env(TOY, kind="nope")
    two = tmp_path / "two_seats.py"
    two.write_text(
        "import verifiers.v1 as vf\nfrom verifiers_v04_toy_env import ToyTaskset\n"
        "class TwoConfig(vf.EnvConfig):\n"
        "    solver: vf.AgentConfig = vf.AgentConfig()\n    critic: vf.AgentConfig = vf.AgentConfig()\n"
        "class Two(vf.Env[TwoConfig]):\n    async def run(self, task, agents):\n        pass\n"
        "__all__ = ['ToyTaskset', 'Two']\n")
    with pytest.raises(ValueError, match="2 agent seats \\(solver, critic\\); ludic-fast trains environments of one"):
        make_env(str(two))  # (examples/ is on sys.path: make_env(TOY) put it there)


@pytest.mark.parametrize("version", ["0.3.0", "0.4.1", "0.5.2"])
def test_an_unsupported_verifiers_version_is_refused_in_one_line(monkeypatch, version):
    monkeypatch.setattr(verifiers, "__version__", version)
    with pytest.raises(ValueError, match=rf"verifiers {version} is installed; .* supports verifiers 0\.3\.1 and "
                                         r"0\.4\.0 \(pip install") as exc:
        make_env(TOY)
    assert "\n" not in str(exc.value)
