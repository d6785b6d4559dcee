"""One temperature: the RL losses and the reference score at the temperature the rollouts sampled with (each
item's meta["sampling_temperature"], which the rollout source records), greedy 0 scoring at 1 by the one rule
`_common.logprob_temperature`, unless the RL config sets one; validation of temperature and lr."""

from __future__ import annotations

import asyncio
import copy
import math

import pytest
import torch
from _trainer_fixtures import TOKENIZER, ListSource, make_items, tiny_model

from ludic_fast import reference
from ludic_fast._common import head_temperature, logprob_temperature
from ludic_fast.algorithm import make_cispo
from ludic_fast.data.batching import collate_saw_items
from ludic_fast.data.types import SAWBatch
from ludic_fast.objectives.rl import RLConfig
from ludic_fast.rollout import Completion, RolloutBatchSource, SamplingConfig
from ludic_fast.rollout.tasks import embedded_default_task
from ludic_fast.trainer import Trainer, TrainerConfig


def _stamped(items, temperature):
    out = copy.deepcopy(items)
    for it in out:
        it.meta["sampling_temperature"] = temperature
    return out


def _loss(items, **cfg) -> torch.Tensor:
    """The step's loss (one micro-batch) of CISPO on `items`."""
    trainer = Trainer(model=tiny_model(), algo=make_cispo(group_size=1), batch_source=ListSource([items]),
                      cfg=TrainerConfig(model_device="cpu", pad_token_id=0, sync_every_steps=0, max_seq_len=16,
                                        micro_token_budget=256, **cfg))
    batch = SAWBatch(items=list(items))
    return trainer.accumulate_gradients(batch)[0]


def _reference_loss(items, temperature: float) -> torch.Tensor:
    """Reference CISPO (make_cispo's defaults) on the tiny model's logits / T, items in the trainer's order."""
    items = sorted(items, key=lambda it: len(it.input_ids))  # the token-budget split sorts by length
    batch = collate_saw_items(items, pad_token_id=0)
    logits = tiny_model()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    loss = reference.CISPOLoss(clip_eps_low=1e6, clip_eps_high=0.2, length_normalize=True)
    return loss(batch, logits=logits.double() / temperature)[0].double()


def test_the_loss_scores_at_the_sampling_temperature():
    items = make_items(4, seed=1)
    got = _loss(_stamped(items, 0.5))
    torch.testing.assert_close(got.double(), _reference_loss(items, 0.5), rtol=1e-4, atol=1e-6)
    assert not torch.allclose(got.double(), _reference_loss(items, 1.0), rtol=1e-3)  # T matters here
    # greedy rollouts (0) score at 1, as items that record no temperature
    torch.testing.assert_close(_loss(_stamped(items, 0.0)), _loss(items))
    torch.testing.assert_close(_loss(items).double(), _reference_loss(items, 1.0), rtol=1e-4, atol=1e-6)


def test_an_explicit_temperature_overrides_the_rollouts(caplog):
    items = make_items(4, seed=1)
    with caplog.at_level("WARNING", logger="ludic_fast.trainer"):
        got = _loss(_stamped(items, 0.5), temperature=0.8)
    torch.testing.assert_close(got.double(), _reference_loss(items, 0.8), rtol=1e-4, atol=1e-6)
    assert "off-policy" in caplog.text  # said once: the ratio is not on-policy


def test_items_sampled_at_several_temperatures_are_refused():
    items = _stamped(make_items(4, seed=1), 0.5)
    items[0].meta["sampling_temperature"] = 0.9
    with pytest.raises(ValueError, match="several temperatures"):
        _loss(items)
    _loss(items, temperature=0.7)  # an explicit temperature scores them all at it
    bad = _stamped(make_items(2, seed=1), -1.0)
    with pytest.raises(ValueError, match="sampling_temperature"):
        _loss(bad)


class _Engine:
    """Two tokens for every prompt, whatever the sampling."""

    version = 0

    def generate(self, prompts, sampling, *, seed=None):
        return [Completion(list(p), [5, 6], [-1.0, -1.0], "length") for p in prompts]


def test_the_rollout_source_records_its_sampling_temperature():
    for temperature in (0.0, 0.7):
        source = RolloutBatchSource(engine=_Engine(), task=embedded_default_task(), tokenizer=TOKENIZER,
                                    credit_assigner=make_cispo(group_size=2).credit_assigner, prompts_per_batch=2,
                                    group_size=2, sampling=SamplingConfig(temperature=temperature, max_new_tokens=2))
        batch = asyncio.run(source.next_batch())
        assert {it.meta["sampling_temperature"] for it in batch.items} == {temperature}


def test_one_rule_for_temperatures_and_lr():
    assert logprob_temperature(0) == 1.0 and logprob_temperature(0.0) == 1.0 and logprob_temperature(0.7) == 0.7
    assert SamplingConfig(temperature=0.0).logprob_temperature == 1.0
    for bad in (-0.5, math.inf, math.nan):
        with pytest.raises(ValueError, match=">= 0"):
            logprob_temperature(bad)
        with pytest.raises(ValueError, match="temperature"):
            SamplingConfig(temperature=bad)
    with pytest.raises(TypeError, match="temperature"):
        logprob_temperature(True)
    assert head_temperature(2) == 2.0
    for bad in (0, 0.0, -1.0, math.nan, math.inf):  # the head has no greedy: T = 0 is refused where T > 0 is due
        with pytest.raises(ValueError, match="temperature must be finite and > 0"):
            RLConfig(temperature=bad)
        with pytest.raises(ValueError, match="temperature"):
            TrainerConfig(pad_token_id=0, temperature=bad)
    assert RLConfig().temperature is None and TrainerConfig(pad_token_id=0).temperature is None
    for lr in (0.0, -1e-3, math.nan):
        with pytest.raises(ValueError, match="lr must be > 0"):
            TrainerConfig(pad_token_id=0, lr=lr)


def test_the_episode_runner_records_its_sampling_temperature():
    """`ludic-fast train --env`: the episodes' items carry the runner's sampling temperature too."""
    from ludic_fast.agents import EpisodeJob, EpisodeLimits, EpisodeRunner
    from ludic_fast.agents.embedded_envs import GuessNumberEnv
    from ludic_fast.embedded.tokenizer import ASCII_CHARACTERS, build_char_tokenizer

    tok = build_char_tokenizer(ASCII_CHARACTERS)

    class Sampler:
        def generate(self, prompts, sampling, *, seed=None):
            return [Completion(list(p), [tok.eos_token_id], [0.0], "stop") for p in prompts]

    runner = EpisodeRunner(Sampler(), tok, sampling=SamplingConfig(temperature=0.6, max_new_tokens=4),
                           limits=EpisodeLimits(max_turns=1))
    (ep,) = asyncio.run(runner.run([EpisodeJob(GuessNumberEnv(), 0)]))
    assert ep.rollout.meta["sampling_temperature"] == 0.6
