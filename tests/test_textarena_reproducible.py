"""A seed gives the same textarena game whatever else runs: concurrent Blackjack episodes (cards drawn from Python's
global `random` inside `step`) equal textarena run alone with the same seed and moves; OwnRandomState keeps
the global generators' states apart and gives code outside its blocks its own sequence back."""

from __future__ import annotations

import asyncio
import random
import threading

import numpy as np
import pytest

ta = pytest.importorskip("textarena", reason="textarena is not installed (pip install 'ludic-fast[textarena]')")

from ludic_fast.agents import EpisodeJob, EpisodeLimits, EpisodeRunner  # noqa: E402
from ludic_fast.agents.libraries.textarena import TextArenaEnv, render  # noqa: E402
from ludic_fast.agents.own_random import OwnRandomState  # noqa: E402
from ludic_fast.agents.protocol import AssistantTurn  # noqa: E402
from ludic_fast.embedded.tokenizer import ASCII_CHARACTERS, build_char_tokenizer  # noqa: E402
from ludic_fast.rollout.sampler import Completion  # noqa: E402

SEEDS = [11, 12, 13, 14, 15, 16]
MOVES = ["[Hit]", "[Stand]", "[Hit]", "[Hit]", "[Stand]", "[Stand]", "[Hit]", "[Stand]"]


def alone(seed: int, moves: list[str] = MOVES) -> list[tuple[str | None, float]]:
    """textarena's own Blackjack, one game at a time: (observation or None at the end, reward) per move."""
    game = ta.make("Blackjack-v0-raw")
    game.reset(num_players=1, seed=seed)
    out: list[tuple[str | None, float]] = [(render(game.get_observation()[1], 0), 0.0)]
    for m in moves:
        done, _ = game.step(m)
        if done:
            out.append((None, float(game.close()[0][0])))
            break
        out.append((render(game.get_observation()[1], 0), 0.0))
    return out


def test_concurrent_blackjack_episodes_equal_the_library_alone():
    expected = {s: alone(s) for s in SEEDS}
    got: dict[int, list] = {}
    barrier = threading.Barrier(len(SEEDS))

    def play(seed: int) -> None:
        env = TextArenaEnv("Blackjack-v0")
        trace = [(env.reset(seed)[0]["content"], 0.0)]
        done = False
        for m in MOVES:
            barrier.wait()  # every episode has reset (and reseeded the global generator) before any steps
            if not done:
                r = env.step(AssistantTurn(m, [], content=m))
                done = r.done
                trace.append((None if done else r.observations[0]["content"], r.reward))
        got[seed] = trace

    threads = [threading.Thread(target=play, args=(s,)) for s in SEEDS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == expected
    assert len({str(v) for v in expected.values()}) == len(SEEDS)  # different seeds, different games


class ScoreSampler:
    """Hits below a score of 15 (read from the prompt's last "Score: n"), else stands; one call for the whole batch,
    as the runner samples every live episode at once."""

    def __init__(self, tok):
        self.tok = tok

    def generate(self, prompts, sampling, *, seed=None):
        out = []
        for p in prompts:
            score = int(self.tok.decode(p).rsplit("Score: ", 1)[-1].split(")")[0])
            ids = self.tok("[Hit]" if score < 15 else "[Stand]", add_special_tokens=False)["input_ids"]
            ids.append(self.tok.eos_token_id)
            out.append(Completion(list(p), ids, [-0.1] * len(ids), "stop"))
        return out


def test_runner_episodes_replay_in_textarena_alone():
    """Eight Blackjack episodes played together by the runner (environment calls in its threads) equal
    textarena alone given each episode's seed and the moves the episode made."""
    tok = build_char_tokenizer(ASCII_CHARACTERS)
    runner = EpisodeRunner(ScoreSampler(tok), tok,
                           limits=EpisodeLimits(max_turns=12, max_tokens=100_000, max_new_tokens=10))
    seeds = list(range(100, 108))
    episodes = asyncio.run(runner.run([EpisodeJob(TextArenaEnv("Blackjack-v0"), seed=s) for s in seeds]))
    for seed, ep in zip(seeds, episodes, strict=True):
        assert ep.status in ("done", "truncated"), ep.error
        moves = [step.action for step in ep.rollout.steps]
        ours = [(ep.messages[0]["content"], 0.0)] + [
            (step.next_obs[0]["content"] if step.next_obs else None, step.reward) for step in ep.rollout.steps]
        assert ours == alone(seed, moves), seed


def test_own_random_state_interleaved_equals_alone_and_leaves_the_outer_sequence():
    def draws(state: OwnRandomState) -> list[tuple[float, float]]:
        with state:
            return [(random.random(), float(np.random.random())) for _ in range(2)]

    ref_a, ref_b = OwnRandomState(1), OwnRandomState(2)
    expected_a, expected_b = draws(ref_a) + draws(ref_a), draws(ref_b) + draws(ref_b)
    random.seed(99)
    np.random.seed(99)
    outer = [(random.random(), float(np.random.random())) for _ in range(2)]
    random.seed(99)
    np.random.seed(99)
    first = (random.random(), float(np.random.random()))
    sa, sb = OwnRandomState(1), OwnRandomState(2)
    got_a, got_b = draws(sa), draws(sb)
    got_a, got_b = got_a + draws(sa), got_b + draws(sb)
    assert (got_a, got_b) == (expected_a, expected_b) and got_a != got_b
    assert [first, (random.random(), float(np.random.random()))] == outer


def test_a_nested_block_of_the_same_state_keeps_its_draws():
    flat, nested = OwnRandomState(3), OwnRandomState(3)
    with flat:
        expected = [random.random() for _ in range(3)]
    with nested:
        got = [random.random()]
        with nested:
            got.append(random.random())
        got.append(random.random())
    assert got == expected
