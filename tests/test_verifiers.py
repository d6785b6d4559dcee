"""verifiers environments (ludic_fast.agents.libraries.verifiers): the reward is the rubric's own score of the
same rollout, multi-turn and tool episodes are token-exact, what cannot run here is refused in one line.
The environments are examples/verifiers_toy_env.py (single-turn, multi-turn with env_response, ToolEnv)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

vf = pytest.importorskip("verifiers", reason="verifiers is not installed (pip install 'ludic-fast[verifiers]')")
if vf.__version__ != "0.3.1":  # 0.4.0: tests/test_verifiers_v04.py
    pytest.skip(f"verifiers {vf.__version__} is installed, not 0.3.1", allow_module_level=True)

from _scripted_sampler import Replies, check_tool_episode_tokens, play, reasoning_char_tokenizer  # noqa: E402

from ludic_fast.agents import EpisodeJob, EpisodeLimits, EpisodeRunner, episode_items  # noqa: E402
from ludic_fast.agents.episode import render_ids  # noqa: E402
from ludic_fast.agents.libraries.verifiers import (  # noqa: E402
    VerifiersEnv,
    check_runnable,
    load,
    make_env,
    to_message,
)
from ludic_fast.data.batching import collate_saw_items  # noqa: E402
from ludic_fast.data.credit import EpisodicReturn  # noqa: E402
from ludic_fast.losses import CISPOLoss  # noqa: E402

TOY = str(Path(__file__).resolve().parents[1] / "examples" / "verifiers_toy_env.py")
CALL = '<tool_call>{"name": "add", "arguments": {"a": 61, "b": 48}}</tool_call>'



@pytest.fixture(scope="module")
def tok():
    return reasoning_char_tokenizer()


class ScriptedClient:
    """verifiers' own loop with a plain client of the test's: each response is the next scripted turn."""

    @staticmethod
    def make(turns):
        class Client(vf.Client):
            def setup_client(self, config):
                raise TypeError

            async def to_native_tool(self, tool):
                return tool

            async def to_native_prompt(self, messages):
                return messages, {}

            async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs):
                content, calls = turns.pop(0)
                calls = [vf.ToolCall(id=f"c{i}", name=n, arguments=json.dumps(a)) for i, (n, a) in enumerate(calls)]
                msg = vf.ResponseMessage(content=content, tool_calls=calls or None, finish_reason="stop",
                                         is_truncated=False)
                return vf.Response(id="r", created=0, model="m", message=msg)

            async def raise_from_native_response(self, response):
                return None

            async def from_native_response(self, response):
                return response

            async def close(self):
                return None

        return Client(None)


def library_score(vf_env, row, turns):
    """The rollout verifiers itself plays with the scripted turns, scored by the environment's rubric."""
    async def go():
        state = await vf_env.rollout(dict(row), ScriptedClient.make(list(turns)), "m", {})
        await vf_env.rubric.score_rollout(state)
        return state
    state = asyncio.run(go())
    return state["reward"], {k: float(v) for k, v in state["metrics"].items()}


@pytest.mark.parametrize("kind,replies,turns,want", [
    ("single", ["e"], [("e", [])], 1.2),                       # exact (1.0) + short (0.2)
    ("single", ["no way"], [("no way", [])], 0.0),
    ("single", ["x"], [("x", [])], 0.2),
    ("multi", ["e"], [("e", [])], 1.5),                        # exact + first_try (0.5)
    ("multi", ["x", "e"], [("x", []), ("e", [])], 1.0),        # solved after the feedback
    ("multi", ["x", "y", "z"], [("x", []), ("y", []), ("z", [])], 0.0),
    ("tool", [CALL, "109"], [("", [("add", {"a": 61, "b": 48})]), ("109", [])], 1.0),
    ("tool", ["108"], [("108", [])], 0.0),
])
def test_reward_is_the_rubrics_own_score_of_the_same_rollout(tok, kind, replies, turns, want):
    env = make_env(TOY, kind=kind, num_examples=8)
    _, ep = play(tok, env, replies)
    assert ep.status == "done", ep.error
    row = env.rows[3]
    reward, metrics = library_score(env.vf_env, row, turns)
    last = ep.rollout.steps[-1]
    assert ep.rollout.total_reward == pytest.approx(reward, abs=0) == pytest.approx(want)
    assert last.info["rewards"] == metrics  # each reward function's score (and verifiers' metrics)
    assert all(s.reward == 0.0 for s in ep.rollout.steps[:-1])
    assert [m["content"] for m in ep.messages if m["role"] == "assistant"] == [t[0] for t in turns]


def test_multi_turn_episode_is_token_exact(tok):
    env = make_env(TOY, kind="multi", num_examples=8, system_prompt="be brief")
    replies = ["<think>hm</think>x", "e"]
    sampler, ep = play(tok, env, replies)
    assert ep.status == "done" and ep.turns == 2
    toks = ep.tokens
    for prompt, span in zip(sampler.prompts, toks.turns, strict=True):  # the sampler saw the episode's prefix
        assert prompt == toks.ids[: span.start]
    sampled = [t for s in sampler.sampled for t in s]
    assert [t for t, m in zip(toks.ids, toks.action_mask) if m] == sampled
    first = ep.messages[:2]
    assert first == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "copy: e"}]
    assert toks.ids[: toks.turns[0].start] == render_ids(tok, first, tools=None, add_generation_prompt=True)
    between = tok.decode(toks.ids[toks.turns[0].end : toks.turns[1].start])
    assert between == "\n[U]no, it is e. copy: e\n[A]"  # the env_response, rendered once, after the turn
    assert ep.messages[-1] == {"role": "user", "content": "correct"}  # its final response, not trained
    # re-rendering the conversation would have changed turn 1's tokens (its reasoning stripped)
    assert "<think>hm</think>" not in tok.decode(render_ids(tok, ep.messages, tools=None,
                                                            add_generation_prompt=False))
    for per in ("step", "episode"):
        items = episode_items([ep], EpisodicReturn(), per=per)
        assert [t for it in items for t, m in zip(it.input_ids, it.action_mask) if m] == sampled
        batch = collate_saw_items(items, pad_token_id=0)
        B, T = batch["input_ids"].shape
        gen = torch.Generator().manual_seed(0)
        h = torch.randn(B, T, 16, generator=gen, dtype=torch.float64, requires_grad=True)
        W = torch.randn(len(tok), 16, generator=gen, dtype=torch.float64)
        CISPOLoss()(batch, hidden=h, weight=W)[0].backward()
        scores_action = torch.zeros(B, T, dtype=torch.bool)
        scores_action[:, :-1] = batch["action_mask"][:, 1:] > 0  # position t scores token t+1
        grad = h.grad.norm(dim=-1)
        assert torch.all(grad[~scores_action] == 0) and torch.all(grad[scores_action] > 0)


def test_tool_episode_is_token_exact_and_verifiers_runs_the_tool(tok):
    env = make_env(TOY, kind="tool", num_examples=8, system_prompt="use add")
    sampler, ep = play(tok, env, [CALL, "109"])
    assert ep.status == "done" and ep.turns == 2 and ep.tool_calls == 1
    assert ep.rollout.total_reward == 1.0
    schema = env.tool_schemas
    assert [s["function"]["name"] for s in schema] == ["add"]
    assert schema[0]["function"]["parameters"]["required"] == ["a", "b"]
    check_tool_episode_tokens(tok, ep, sampler, schema, "add")


def test_per_component_rewards_are_logged_by_the_batch_source(tok):
    from ludic_fast.agents import EnvBatchSource
    from ludic_fast.data.credit import GroupNormalizedReturn

    answer = make_env(TOY, kind="single", num_examples=1).rows[0]["answer"]  # the only row
    sampler = Replies(tok, [answer, "no way", answer, "no way"])
    runner = EpisodeRunner(sampler, tok, limits=EpisodeLimits(max_tokens=4096, max_new_tokens=16, max_turns=1))
    source = EnvBatchSource(make_env=lambda: make_env(TOY, kind="single", num_examples=1), runner=runner,
                            credit_assigner=GroupNormalizedReturn(group_size=4), seeds_per_batch=1, group_size=4)
    meta = asyncio.run(source.next_batch()).meta
    assert meta["episode_reward_exact"] == pytest.approx(0.5)
    assert meta["episode_reward_short"] == pytest.approx(0.5)
    assert meta["avg_total_reward"] == pytest.approx((1.2 + 0.0 + 1.2 + 0.0) / 4)


def test_demonstrations_and_refusals(tok, tmp_path):
    env = make_env(TOY, kind="single", num_examples=8, system_prompt="be brief")
    demos = env.demonstrations(3, seed=0)
    for d in demos:
        assert [m["role"] for m in d] == ["system", "user", "assistant"]
        assert d[1]["content"] == f"copy: {d[2]['content']}"
    assert load(TOY, kind="single", num_examples=8, system_prompt="be brief") is env.vf_env  # loaded once
    assert load(TOY, kind="single", num_examples=8) is not env.vf_env
    with pytest.raises(ValueError, match="kind must be"):
        make_env(TOY, kind="nope")
    with pytest.raises(ValueError, match="does not exist"):
        make_env(str(tmp_path / "missing.py"))
    with pytest.raises(ValueError, match="split must be one of"):
        VerifiersEnv(env.vf_env, split="test")
    judged = tmp_path / "judged.py"
    judged.write_text(
        "import verifiers as vf\nfrom datasets import Dataset\n"
        "def load_environment():\n"
        "    return vf.SingleTurnEnv(dataset=Dataset.from_list([{'question': 'q', 'answer': 'a'}]),\n"
        "                            rubric=vf.JudgeRubric(judge_client=object()))\n")
    with pytest.raises(ValueError, match="judge model behind an OpenAI-compatible API"):
        make_env(str(judged))
    keyed = tmp_path / "keyed.py"
    keyed.write_text("import verifiers as vf\n"
                     "def load_environment():\n    vf.ensure_keys(['LUDIC_FAST_NO_SUCH_KEY'])\n")
    with pytest.raises(ValueError, match="needs an external API: .*LUDIC_FAST_NO_SUCH_KEY"):
        make_env(str(keyed))
    grouped = tmp_path / "grouped.py"
    grouped.write_text(
        "import verifiers as vf\nfrom datasets import Dataset\n"
        "def rank(completions) -> list[float]:\n    return [0.0] * len(completions)\n"
        "def load_environment():\n"
        "    return vf.SingleTurnEnv(dataset=Dataset.from_list([{'question': 'q', 'answer': 'a'}]),\n"
        "                            rubric=vf.Rubric(funcs=[rank]))\n")
    with pytest.raises(ValueError, match="group reward functions"):
        make_env(str(grouped))
    assert to_message(vf.UserMessage(content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])) == \
        {"role": "user", "content": "ab"}
    # a sandbox environment (never built here: 0.3.1's SandboxEnv does not construct with the prime-sandboxes
    # release pip resolves, nor without Prime's service) is refused by what it is
    with pytest.raises(ValueError, match="Prime sandboxes"):
        check_runnable(object.__new__(vf.PythonEnv), "python-env")


def test_a_rollout_the_runner_cuts_short_is_cancelled(tok):
    env = make_env(TOY, kind="multi", num_examples=8)
    sampler = Replies(tok, ["x"])
    runner = EpisodeRunner(sampler, tok, limits=EpisodeLimits(max_tokens=4096, max_new_tokens=16, max_turns=1))

    async def play_and_look():  # looked at inside the loop: asyncio.run cancels what is left when it ends
        (ep,) = await runner.run([EpisodeJob(env, seed=3)])
        return ep, env._rollout.cancelled()

    ep, cancelled = asyncio.run(play_and_look())
    assert ep.status == "truncated" and ep.reason == "max_turns" and ep.turns == 1
    assert cancelled  # close() ended verifiers' rollout, which was waiting for turn 2


def test_rewriting_history_fails_only_that_episode(tok, tmp_path):
    rewrites = tmp_path / "rewrites.py"
    rewrites.write_text(
        "import verifiers as vf\nfrom datasets import Dataset\n"
        "class Rewrites(vf.MultiTurnEnv):\n"
        "    async def env_response(self, messages, state, **kw):\n"
        "        return [vf.UserMessage(content='again')]\n"
        "    async def get_prompt_messages(self, state):\n"
        "        if not state['trajectory']:\n            return state['prompt']\n"
        "        return [vf.UserMessage(content='a fresh start')]\n"
        "def load_environment():\n"
        "    return Rewrites(dataset=Dataset.from_list([{'question': 'q', 'answer': 'a'}]), max_turns=3,\n"
        "                    rubric=vf.Rubric(funcs=[lambda completion: 1.0]))\n")
    _, ep = play(tok, make_env(str(rewrites)), ["x"])
    assert ep.status == "failed" and "rewrote earlier messages" in ep.error


@pytest.mark.parametrize("version", ["0.3.0", "0.4.1", "0.5.2"])
def test_an_unsupported_verifiers_version_is_refused_in_one_line(monkeypatch, version):
    monkeypatch.setattr(vf, "__version__", version)
    with pytest.raises(ValueError, match=rf"verifiers {version} is installed; .* supports verifiers 0\.3\.1 and "
                                         r"0\.4\.0 \(pip install") as exc:
        make_env(TOY, split="train")
    assert "\n" not in str(exc.value)


def test_the_cli_refuses_an_unsupported_version_in_one_line(monkeypatch, capsys, tmp_path):
    from ludic_fast.cli import main

    monkeypatch.setattr(vf, "__version__", "0.4.1")
    try:
        code = main(["train", "--env", "ludic_fast.agents.libraries.verifiers:make_env", "--env-arg", f"env={TOY}",
                     "--rl-steps", "1", "--output-dir", str(tmp_path)])
    except SystemExit as exc:  # argparse's error exit
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code not in (0, None) and "verifiers 0.4.1 is installed" in err
    assert [line for line in err.splitlines() if "verifiers 0.4.1" in line] == [err.splitlines()[-1]]
    assert "Traceback" not in err
