"""textarena games as environments (ludic_fast.agents.libraries.textarena): observations, rewards and the end of
a scripted game equal the library's own stepping of the same moves; the episode is token-exact."""

from __future__ import annotations

import asyncio
import re

import pytest

ta = pytest.importorskip("textarena", reason="textarena is not installed (pip install 'ludic-fast[textarena]')")

from ludic_fast.agents import EpisodeJob, EpisodeLimits, EpisodeRunner, episode_items  # noqa: E402
from ludic_fast.agents.episode import render_ids  # noqa: E402
from ludic_fast.agents.libraries.textarena import TextArenaEnv, make_env  # noqa: E402
from ludic_fast.agents.protocol import AssistantTurn  # noqa: E402
from ludic_fast.data.credit import EpisodicReturn  # noqa: E402
from ludic_fast.embedded.tokenizer import ASCII_CHARACTERS, build_char_tokenizer  # noqa: E402
from ludic_fast.rollout.sampler import Completion  # noqa: E402

TOK = build_char_tokenizer(ASCII_CHARACTERS)


def library_text(messages, me: int) -> str:
    """The observation as the adapter documents it, from textarena's raw messages (hand-written here)."""
    out = []
    for frm, text, kind in messages:
        if kind == ta.ObservationType.PLAYER_ACTION:
            if frm == me:
                continue
            text = f"[Player {frm}] {text}"
        if text.strip():
            out.append(text.strip())
    return "\n\n".join(out)


def turn(move: str) -> AssistantTurn:
    return AssistantTurn(move, [], content=move)


def test_single_player_game_matches_the_librarys_stepping():
    moves = ["[10]", "ten", "[3]", "[5]", "[4]", "[7]", "[6]"]
    env = TextArenaEnv("GuessTheNumber-v0")
    assert env.num_players == 1
    first = env.reset(seed=1)
    ours = [(first[0]["content"], 0.0, False)]
    for m in moves:
        r = env.step(turn(m))
        ours.append((r.observations[0]["content"] if r.observations else None, r.reward, r.done))
        if r.done:
            break
    game = ta.make("GuessTheNumber-v0-raw")
    game.reset(num_players=1, seed=1)
    theirs = [(library_text(game.get_observation()[1], 0), 0.0, False)]
    for m in moves:
        done, _ = game.step(m)
        if done:
            theirs.append((None, game.close()[0][0], True))
            break
        theirs.append((library_text(game.get_observation()[1], 0), 0.0, False))
    assert ours == theirs
    assert ours[-1][2] and "invalid move" in ours[2][0]  # the game's own answer to "ten": it asks again


def test_two_player_game_against_the_random_opponent_matches_the_librarys_stepping():
    moves = ["[4]", "[4]", "[0]", "[8]", "[2]", "[6]", "[1]", "[3]", "[5]", "[7]"]  # [4] again: occupied
    env = make_env("TicTacToe-v0")
    assert env.num_players == 2
    obs = [env.reset(seed=7)[0]["content"]]
    rewards, done = [], False
    for m in moves:
        r = env.step(turn(m))
        rewards.append(r.reward)
        obs.append(r.observations[0]["content"] if r.observations else None)
        if r.done:
            done = True
            break
    assert done
    # the opponent's moves, read from what the model was shown, each one of the moves the game listed
    opp = [re.findall(r"\[Player 1\] (\[\d\])", o or "") for o in obs]
    game = ta.make("TicTacToe-v0-raw")
    game.reset(num_players=2, seed=7)
    lib_obs, lib_rewards, k = [], [], 0
    player, msgs = game.get_observation()
    assert player == 0
    lib_obs.append(library_text(msgs, 0))
    for i, m in enumerate(moves[: len(rewards)]):
        over, _ = game.step(m)
        for o in ([] if over else opp[i + 1]):
            p, seen = game.get_observation()
            assert p == 1 and f"'{o}'" in seen[-1][1]  # a move the game listed as available
            over, _ = game.step(o)
            k += 1
        if over:
            lib_rewards.append(float(game.close()[0][0]))
            lib_obs.append(None)
            break
        lib_rewards.append(0.0)
        lib_obs.append(library_text(game.get_observation()[1], 0))
    assert obs == lib_obs and rewards == lib_rewards and k >= 1
    assert "already occupied" in obs[2]  # the invalid move answered by the game
    # a seed fixes the opponent's moves
    again = TextArenaEnv("TicTacToe-v0")
    assert again.reset(seed=7)[0]["content"] == obs[0]
    assert again.step(turn("[4]")).observations[0]["content"] == obs[1]


class MovesSampler:
    """Samples the scripted moves in order (+ <eos>), log-prob -0.1 per token."""

    version = 0

    def __init__(self, moves):
        self.moves, self.sampled, self.prompts = list(moves), [], []

    def generate(self, prompts, sampling, *, seed=None):
        (p,) = prompts
        ids = TOK(self.moves.pop(0), add_special_tokens=False)["input_ids"] + [TOK.eos_token_id]
        self.sampled.append(ids)
        self.prompts.append(list(p))
        return [Completion(list(p), ids, [-0.1] * len(ids), "stop")]


def test_episode_is_token_exact_and_carries_the_games_reward():
    moves = ["[4]", "[0]", "[8]", "[2]", "[6]", "[1]", "[3]", "[5]", "[7]"]
    sampler = MovesSampler(moves)
    runner = EpisodeRunner(sampler, TOK, limits=EpisodeLimits(max_turns=9, max_tokens=8192, max_new_tokens=8))
    env = TextArenaEnv("TicTacToe-v0")
    (ep,) = asyncio.run(runner.run([EpisodeJob(env, seed=7)]))
    assert ep.status == "done"
    # the game's reward, replayed on a fresh env with the same seed and moves
    replay = TextArenaEnv("TicTacToe-v0")
    replay.reset(seed=7)
    results = [replay.step(turn(m)) for m in moves[: ep.turns]]
    assert [s.reward for s in ep.rollout.steps] == [r.reward for r in results] and results[-1].done
    toks = ep.tokens
    for prompt, span in zip(sampler.prompts, toks.turns, strict=True):  # the sampler saw the episode's prefix
        assert prompt == toks.ids[: span.start]
    assert [t for t, m in zip(toks.ids, toks.action_mask) if m] == [t for s in sampler.sampled for t in s]
    first = [{"role": "user", "content": env.reset(seed=7)[0]["content"]}]
    assert toks.ids[: toks.turns[0].start] == render_ids(TOK, first, tools=None, add_generation_prompt=True)
    for k, r in enumerate(results[:-1]):  # context between turns: exactly the game's next observation
        between = toks.ids[toks.turns[k].end : toks.turns[k + 1].start]
        assert TOK.decode(between) == r.observations[0]["content"]
    items = episode_items([ep], EpisodicReturn(), per="step")
    assert [t for it in items for t, m in zip(it.input_ids, it.action_mask) if m] == \
        [t for s in sampler.sampled for t in s]
    assert all(it.weight == ep.rollout.total_reward for it in items)


def test_demonstrations_bad_games_and_opponents():
    env = TextArenaEnv("TicTacToe-v0")
    (demo,) = env.demonstrations(1, seed=0)
    assert demo[0]["role"] == "user" and [m["role"] for m in demo[1:3]] == ["assistant", "user"]
    for k, m in enumerate(demo):  # each demonstrated move is one the game listed just before it
        if m["role"] == "assistant":
            assert f"'{m['content']}'" in demo[k - 1]["content"].splitlines()[-1]
    with pytest.raises(ValueError, match="no game 'TicTacToe'; did you mean TicTacToe-v0"):
        TextArenaEnv("TicTacToe")
    with pytest.raises(ValueError, match=r"player_id must lie in \[0, 2\)"):
        TextArenaEnv("TicTacToe-v0", player_id=2)
    with pytest.raises(ValueError, match="opponent 'nope'"):
        TextArenaEnv("TicTacToe-v0", opponent="nope")
    short = TextArenaEnv("TicTacToe-v0", max_turns=2).demonstrations(3, seed=1)
    assert [sum(m["role"] == "assistant" for m in d) for d in short] == [2, 2, 2]
    with pytest.raises(ValueError, match="max_turns must be a positive int"):
        TextArenaEnv("TicTacToe-v0", max_turns=0)
    second = TextArenaEnv("TicTacToe-v0", player_id=1)  # the opponent opens
    assert "[Player 0]" in second.reset(seed=3)[0]["content"]
