"""Multi-turn episodes through the Redis pipeline, on a real redis-server: an actor plays embedded-guess episodes
with the transformers sampler and pushes their items with `run_pipeline_actor`; the learner's
`PipelineBatchSource` reads back the same items (token ids, action masks, sampled log-probs, credit weights,
episode stats), and the learner's own model scores each action token at its sampled log-prob (ratio 1)."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("redis", reason="needs the redis Python client")
pytest.importorskip("msgpack", reason="needs msgpack")

from _redis import needs_server  # noqa: E402

from ludic_fast.agents import EnvBatchSource, EpisodeLimits, EpisodeRunner  # noqa: E402
from ludic_fast.agents.embedded_envs import GuessNumberEnv  # noqa: E402
from ludic_fast.data.credit import GroupNormalizedReturn  # noqa: E402
from ludic_fast.distributed.pipeline import PipelineBatchSource, PipelineKeys, PipelineProducer, run_pipeline_actor  # noqa: E402
from ludic_fast.embedded import build_char_tokenizer, build_tiny_model  # noqa: E402
from ludic_fast.embedded.tokenizer import ASCII_CHARACTERS  # noqa: E402
from ludic_fast.rollout import HFSampler, SamplingConfig  # noqa: E402

pytestmark = [needs_server, pytest.mark.timeout(120)]


def test_episode_items_cross_redis_unchanged_and_on_policy(redis_server):
    torch.manual_seed(0)
    tok = build_char_tokenizer(ASCII_CHARACTERS)
    model = build_tiny_model(len(tok), seed=0, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=2).eval()
    sampler = HFSampler(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    runner = EpisodeRunner(sampler, tok, limits=EpisodeLimits(max_turns=3, max_new_tokens=3),
                           sampling=SamplingConfig(temperature=1.0, max_new_tokens=3))
    source = EnvBatchSource(make_env=GuessNumberEnv, runner=runner, credit_assigner=GroupNormalizedReturn(2),
                            seeds_per_batch=2, group_size=2, per="step")
    keys = PipelineKeys("agents")
    sent = asyncio.run(source.next_batch()).items
    assert len(sent) >= 4 and any(sum(i.action_mask) < len(i.input_ids) - 1 for i in sent)

    producer = PipelineProducer(redis_server.url, keys=keys, actor_id="a0")
    assert run_pipeline_actor(lambda version: sent, producer, num_rounds=1) == len(sent)
    learner = PipelineBatchSource(redis_server.url, keys=keys, batch_size=len(sent))
    got = learner.next_batch_sync().items
    learner.close()

    assert len(got) == len(sent)
    for a, b in zip(sent, got, strict=True):
        assert b.input_ids == a.input_ids and b.action_mask == a.action_mask
        assert b.weight == pytest.approx(a.weight)
        assert b.actor_logps.token_logps == a.actor_logps.token_logps  # float32 both sides: bit-equal
        assert b.meta["env_seed"] == a.meta["env_seed"] and b.meta["episode_turns"] == a.meta["episode_turns"]
        # ratio 1: the learner's model gives every action token the log-prob it was sampled with
        ids = torch.tensor([b.input_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        picked = logp.gather(-1, ids[0, 1:, None])[:, 0]
        actions = torch.tensor(b.action_mask[1:], dtype=torch.bool)
        torch.testing.assert_close(picked[actions], torch.tensor(b.actor_logps.token_logps), atol=1e-5, rtol=0)
