"""A sampler that replays scripted replies, one episode played with it, and the token checks of a tool episode:
the environment-adapter tests (verifiers 0.3.1 and 0.4) check what an environment does with given model turns."""

from __future__ import annotations

import asyncio

from _chat_templates import REASONING_TEMPLATE

from ludic_fast.agents import EpisodeJob, EpisodeLimits, EpisodeRunner
from ludic_fast.agents.episode import ChatTokens, render_ids
from ludic_fast.embedded.tokenizer import ASCII_CHARACTERS, build_char_tokenizer
from ludic_fast.rollout.sampler import Completion


def reasoning_char_tokenizer():
    """The character tokenizer with REASONING_TEMPLATE as its chat template."""
    t = build_char_tokenizer(ASCII_CHARACTERS)
    t.chat_template = REASONING_TEMPLATE
    return t


class Replies:
    """Samples the scripted replies in order (+ <eos>), log-prob -0.01 (i + 1) for the i-th token."""

    version = 0

    def __init__(self, tok, replies):
        self.tok, self.replies, self.sampled, self.prompts = tok, list(replies), [], []

    def generate(self, prompts, sampling, *, seed=None):
        out = []
        for p in prompts:
            ids = self.tok(self.replies.pop(0), add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            self.sampled.append(ids)
            self.prompts.append(list(p))
            out.append(Completion(list(p), ids, [-0.01 * (i + 1) for i in range(len(ids))], "stop"))
        return out


def play(tok, env, replies, seed=3):
    """One episode of `env` from `seed` with the scripted replies: (the sampler, the episode)."""
    sampler = Replies(tok, replies)
    runner = EpisodeRunner(sampler, tok, limits=EpisodeLimits(max_tokens=4096, max_new_tokens=128))
    (ep,) = asyncio.run(runner.run([EpisodeJob(env, seed=seed)]))
    return sampler, ep


def check_tool_episode_tokens(tok, ep, sampler, schema, tool):
    """A two-turn episode whose first turn called `tool` with a=61, b=48 and whose observation was its result 109:
    the prompt is the template's render with the tool schemas, the action tokens are exactly the sampled ones,
    and the observation tokens are the template's render of the tool message."""
    toks = ep.tokens
    assert toks.ids[: toks.turns[0].start] == render_ids(tok, ep.messages[:2], tools=schema,
                                                         add_generation_prompt=True)
    assert f"|tools:{tool}" in tok.decode(toks.ids[: toks.turns[0].start])
    assert [t for t, m in zip(toks.ids, toks.action_mask) if m] == [t for s in sampler.sampled for t in s]
    assert tok.decode(toks.ids[toks.turns[0].end : toks.turns[1].start]) == "\n[T]109\n[A]"  # the tool's result
    call = ep.messages[2]
    assert call["tool_calls"] == [{"type": "function", "function": {"name": tool, "arguments": {"a": 61, "b": 48}}}]
    chat = ChatTokens(tok, [tok.eos_token_id], tools=schema)
    assert chat.observation_ids(ep.messages[:2], call, [ep.messages[3]]) == \
        toks.ids[toks.turns[0].end : toks.turns[1].start]
