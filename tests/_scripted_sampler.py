"""A sampler that replays scripted replies, and one episode played with it: the environment-adapter tests
(verifiers 0.3.1 and 0.4) check what an environment does with given model turns."""

from __future__ import annotations

import asyncio

from _chat_templates import REASONING_TEMPLATE

from ludic_fast.agents import EpisodeJob, EpisodeLimits, EpisodeRunner
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
