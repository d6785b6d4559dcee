"""`ludic-fast train --env`: the embedded environments, their demonstrations (SFT in the rollouts' exact
token format), the flags' scope and a short end-to-end run with a weighted reward function."""

from __future__ import annotations

import asyncio
import json

import pytest

from ludic_fast.agents import EpisodeJob, EpisodeLimits, EpisodeRunner
from ludic_fast.agents.embedded_envs import CalculatorEnv, GuessNumberEnv, calc
from ludic_fast.agents.episode import ChatTokens, demonstration_tokens
from ludic_fast.agents.tools import as_tools
from ludic_fast.cli import train as train_cli
from ludic_fast.embedded.tokenizer import ASCII_CHARACTERS, build_char_tokenizer
from ludic_fast.rollout.sampler import Completion
from ludic_fast.run.loggers import read_jsonl


def short_answer(messages, info):
    """A reward for the CLI test: 1 for an answer of at most 3 characters."""
    return float(len(messages[-1]["content"]) <= 3)


class ReplaySampler:
    """Replays the assistant turns of one demonstration as sampled tokens."""

    def __init__(self, turns):
        self.turns = list(turns)

    def generate(self, prompts, sampling, *, seed=None):
        ids = self.turns.pop(0)
        return [Completion(list(prompts[0]), ids, [0.0] * len(ids), "stop")]


@pytest.mark.parametrize("env_cls", [GuessNumberEnv, CalculatorEnv])
def test_demonstrations_tokenise_exactly_as_the_runner_builds_episodes(env_cls):
    tok = build_char_tokenizer(ASCII_CHARACTERS)
    env = env_cls()
    tools = [t.schema for t in as_tools(getattr(env, "tools", None)).values()] or None
    chat = ChatTokens(tok, [tok.eos_token_id], tools=tools)
    assert len(env.demonstrations(6, seed=3)) == 6
    multi = 0
    for env_seed, good in [(1, True), (2, False), (3, True), (4, False), (5, True)]:
        messages = env.demonstration(env_seed, good)
        demo = demonstration_tokens(chat, messages)
        turns = [demo.ids[s.start : s.end] for s in demo.turns]
        assert all(t[-1] == tok.eos_token_id for t in turns)
        multi += len(turns) > 1
        # the same conversation played through the runner (environment answers, tools run) gives the same ids
        runner = EpisodeRunner(ReplaySampler(turns), tok, limits=EpisodeLimits(max_new_tokens=128))
        (ep,) = asyncio.run(runner.run([EpisodeJob(env_cls(), env_seed)]))
        assert ep.tokens.ids == demo.ids and ep.tokens.action_mask == demo.action_mask
        assert ep.messages == messages
    assert multi > 0  # multi-turn conversations among them


def test_embedded_environments_reward_the_right_answers():
    env = GuessNumberEnv()
    env.reset(5)
    secret = env.secret
    from ludic_fast.agents.protocol import AssistantTurn

    low = env.step(AssistantTurn("0", [], content=str(max(0, secret - 1))))
    assert (low.reward, low.done) == ((1.0, True) if secret == 0 else (0.0, False))
    assert env.step(AssistantTurn("", [], content=str(secret))).reward == 1.0
    assert env.step(AssistantTurn("", [], content="x")).observations[0]["content"] == "a number:"
    calc_env = CalculatorEnv()
    (q,) = calc_env.reset(1)
    a, b = (int(x) for x in q["content"].rstrip("=").split("*"))
    assert calc(f"{a}*{b}") == str(a * b) and calc("1/2").startswith("error")
    assert calc_env.step(AssistantTurn("", [], content=str(a * b))).reward == 1.0


def one_line_error(capsys, argv):
    assert train_cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    return err


def test_env_flags_are_scoped(capsys, tmp_path):
    assert "--max-turns needs --env" in one_line_error(capsys, ["train", "--max-turns", "2"])
    assert "--reward applies to a prompt/answer --task" in one_line_error(
        capsys, ["train", "--env", "embedded-guess", "--reward", "numeric"])
    assert "--env: env 'nosuchmodule:fn': cannot import" in one_line_error(
        capsys, ["train", "--env", "nosuchmodule:fn"])
    assert "--env: env must be one of embedded-guess, embedded-calc" in one_line_error(capsys, ["train", "--env", "x"])
    assert "the weight 'x' is not a number" in one_line_error(
        capsys, ["train", "--env", "embedded-guess", "--env-reward", f"{__name__}:short_answer=x"])
    assert "--env embedded-guess with --env-arg" in one_line_error(
        capsys, ["train", "--env", "embedded-guess", "--env-arg", "max_number=0"])
    assert "does not apply to --preset dpo" in one_line_error(capsys, ["train", "--preset", "dpo", "--env",
                                                                        "embedded-guess"])


def test_env_run_end_to_end(tmp_path):
    argv = ["train", "--env", "embedded-guess", "--sft-steps", "2", "--demonstrations", "16", "--rl-steps", "2",
            "--prompts-per-batch", "2", "--group-size", "2", "--max-new-tokens", "3", "--eval-every", "2",
            "--env-reward", f"{__name__}:short_answer=0.5", "--episode-log", "3", "--logger", "none",
            "--threads", "1", "--no-plot", "--output-dir", str(tmp_path)]
    assert train_cli.main(argv) == 0
    rl = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r.get("phase") == "rl" and "train/loss" in r]
    assert len(rl) == 2
    for key in ("episode_turns_mean", "episode_tool_calls_mean", "episode_failed", "episode_truncated",
                "episode_reward_short_answer"):
        assert f"train/{key}" in rl[0]
    assert any("eval/success" in r for r in read_jsonl(tmp_path / "metrics.jsonl"))
    episodes = [json.loads(x) for x in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    assert len(episodes) == 2 * 3 and episodes[0]["messages"][0]["content"] == "guess 0-9:"
