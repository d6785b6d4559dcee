"""Self-play (ludic_fast.agents.selfplay) on the embedded Nim game: both seats sampled from one policy, each seat's
turns its own token-exact episode with that seat's reward; the fixed-opponent choice (VersusEnv); rules and
outcomes by hand."""

from __future__ import annotations

import asyncio

import pytest

from ludic_fast.agents import EnvBatchSource, EpisodeJob, EpisodeLimits, EpisodeRunner, episode_items
from ludic_fast.agents.embedded_nim import NimGame
from ludic_fast.agents.episode import render_ids
from ludic_fast.agents.selfplay import SelfPlayRunner, VersusEnv
from ludic_fast.data.credit import EpisodicReturn, GroupNormalizedReturn
from ludic_fast.data.types import group_id_of
from ludic_fast.embedded.tokenizer import build_char_tokenizer
from ludic_fast.rollout.sampler import Completion

TOK = build_char_tokenizer()


class Replies:
    """Samples the scripted replies in order, or `replies(prompt ids)` when it is a function (+ <eos> unless it ends
    with '|cut'), log-prob -0.1 per token."""

    version = 0

    def __init__(self, replies):
        self.replies = replies if callable(replies) else list(replies)
        self.sampled, self.prompts = [], []

    def generate(self, prompts, sampling, *, seed=None):
        out = []
        for p in prompts:
            reply = self.replies(p) if callable(self.replies) else self.replies.pop(0)
            ids = TOK(reply.removesuffix("|cut"), add_special_tokens=False)["input_ids"]
            if not reply.endswith("|cut"):
                ids = ids + [TOK.eos_token_id]
            self.sampled.append(ids)
            self.prompts.append(list(p))
            out.append(Completion(list(p), ids, [-0.1] * len(ids), "stop" if not reply.endswith("|cut") else "length"))
        return out


def seven() -> NimGame:
    return NimGame(min_stones=7, max_stones=7)


def test_nim_rules_by_hand():
    g = seven()
    g.reset(0)
    assert (g.stones, g.to_move(), g.observation(0), g.legal_moves()) == (7, 0, "nim pile 7", ["6", "5"])
    for seat, move in [(0, "6"), (1, "4"), (0, "3"), (1, "2")]:  # a move is the pile it leaves
        g.play(seat, move)
    assert (g.stones, g.done(), g.observation(0), g.legal_moves()) == (2, False, "they left 2", ["1", "0"])
    g.play(0, "0")
    assert g.done() and g.rewards() == (1.0, -1.0)
    for illegal in ("4", "7", "1"):  # takes 3, none, 6: the mover loses
        g.reset(0)
        g.play(0, illegal)
        assert g.rewards() == (-1.0, 1.0)
    with pytest.raises(ValueError, match="cannot move now"):
        g.play(1, "1")


def test_each_seat_is_its_own_token_exact_episode_with_its_own_reward():
    sampler = Replies(["6", "4", "3", "2", "0"])  # seat 0, 1, 0, 1, 0: seat 0 takes the last stone
    runner = SelfPlayRunner(sampler, TOK, max_tokens=512, max_new_tokens=4)
    ep0, ep1 = asyncio.run(runner.run([EpisodeJob(seven(), seed=3, meta={"group_id": "g"})]))
    assert (ep0.status, ep1.status) == ("done", "done")
    assert [s.reward for s in ep0.rollout.steps] == [0.0, 0.0, 1.0]
    assert [s.reward for s in ep1.rollout.steps] == [0.0, -1.0]
    assert (group_id_of(ep0.rollout.meta), group_id_of(ep1.rollout.meta)) == ("g:seat0", "g:seat1")
    for k, ep in enumerate((ep0, ep1)):
        mine = sampler.sampled[k::2]
        toks = ep.tokens
        assert [t for t, m in zip(toks.ids, toks.action_mask) if m] == [t for s in mine for t in s]
        for prompt, span in zip(sampler.prompts[k::2], toks.turns, strict=True):  # the sampler saw the prefix
            assert prompt == toks.ids[: span.start]
        first = [m for m in ep.messages if m["role"] == "user"][:1]
        assert toks.ids[: toks.turns[0].start] == render_ids(TOK, first, tools=None, add_generation_prompt=True)
        # the token right before each answer is the pile's digit (the move is a function of the last token)
        assert TOK.decode([toks.ids[span.start - 1] for span in toks.turns]) == ["742", "63"][k]
    # seat 1 was sent the pile after seat 0's move, then seat 0's next move and the pile
    assert [m["content"] for m in ep1.messages if m["role"] == "user"] == ["they left 6", "they left 3"]
    items = episode_items([ep0, ep1], EpisodicReturn())
    assert [it.weight for it in items] == [1.0, -1.0]


def test_a_cut_turn_resigns_its_seat():
    sampler = Replies(["6", "44|cut"])
    ep0, ep1 = asyncio.run(SelfPlayRunner(sampler, TOK, max_new_tokens=2).run([EpisodeJob(seven(), seed=0)]))
    assert (ep1.status, ep1.reason) == ("truncated", "turn_length") and ep1.rollout.steps[-1].info["cut"]
    assert (ep0.rollout.total_reward, ep1.rollout.total_reward) == (1.0, -1.0)


def test_self_play_batches_group_per_seed_and_seat():
    sampler = Replies(["5"] * 4 + ["4"] * 4)  # one round per seat: every game 7 -> 5 -> 4, then max_turns: a draw
    runner = SelfPlayRunner(sampler, TOK, max_turns=1)
    src = EnvBatchSource(make_env=seven, runner=runner, credit_assigner=GroupNormalizedReturn(2),
                         seeds_per_batch=2, group_size=2)
    batch = asyncio.run(src.next_batch())
    groups = [group_id_of(it.meta) for it in batch.items]
    assert len(batch.items) == 8 and len(set(groups)) == 4
    assert all(g.endswith((":seat0", ":seat1")) for g in groups)


def test_versus_env_is_the_fixed_opponent_choice():
    sampler = Replies(lambda prompt: str(int(TOK.decode(prompt[-1:])) - 1))  # takes 1 from the pile it is sent
    runner = EpisodeRunner(sampler, TOK, limits=EpisodeLimits(max_tokens=512, max_new_tokens=4, max_turns=4))
    env = VersusEnv(seven(), seat=0)
    (ep,) = asyncio.run(runner.run([EpisodeJob(env, seed=0)]))
    g = seven()  # the same game by hand: the opponent's moves read from what the model was shown
    g.reset(0)
    for m in ep.messages[1:]:
        if m["role"] == "assistant":
            g.play(0, m["content"])
        elif not g.done():
            g.play(1, m["content"].removeprefix("they left "))
    assert ep.status == "done" and ep.rollout.total_reward == g.rewards()[0]
    assert VersusEnv(seven()).reset(5)[0]["content"].startswith("they left")  # odd seed: seat 1, the opponent opened
    with pytest.raises(ValueError, match="seat must be 0, 1 or None"):
        VersusEnv(seven(), seat=2)
