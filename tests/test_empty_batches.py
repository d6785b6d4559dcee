"""Runs that cannot get a usable batch (a textarena Battleship run: a first message longer than
--max-episode-tokens) end with one clear line instead of training nothing or refetching forever:

- an episode whose prompt alone fills the token budget is not played (failed, reason "prompt_length", its
  length in the error); a batch of only such episodes raises EmptyBatchError naming --max-episode-tokens;
  some of them in a batch are counted (episode_prompt_too_long) and the rest trains;
- the warm-up's demonstrations whose prompt fills the budget are left out, and all of them is an error;
- a step whose whole batch holds no action token (all cut by max_seq_len) raises before the optimizer step;
- SIGTERM ends a run stuck refetching empty batches (its environment broke after the first batch) within
  seconds, exit 143, with its records, checkpoint and episode log intact.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _chat_templates import REASONING_TEMPLATE
from _env_faults import LongPromptEnv
from _scripted_sampler import Replies
from _trainer_fixtures import ListSource, tiny_model

from ludic_fast.agents import EnvBatchSource, EpisodeJob, EpisodeLimits, EpisodeRunner
from ludic_fast.agents.episode import ChatTokens
from ludic_fast.algorithm import make_sft
from ludic_fast.cli import env_train
from ludic_fast.cli import train as train_cli
from ludic_fast.data.credit import EpisodicReturn
from ludic_fast.data.types import SAWItem
from ludic_fast.embedded.tokenizer import ASCII_CHARACTERS, build_char_tokenizer
from ludic_fast.engine.guard import EmptyBatchError
from ludic_fast.engine.stop import StopRequested
from ludic_fast.run.loggers import read_jsonl
from ludic_fast.trainer import Trainer, TrainerConfig

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def tok():
    t = build_char_tokenizer(ASCII_CHARACTERS)
    t.chat_template = REASONING_TEMPLATE
    return t


def prompt_tokens(tok, env) -> int:
    """The tokens of `env`'s first prompt as the runner builds them."""
    return len(ChatTokens(tok, [tok.eos_token_id]).prompt_ids(env.reset(0)))


class OddSeedsLong(LongPromptEnv):
    """Long prompt (pad 60) on odd seeds, the plain one on even seeds."""

    def reset(self, seed):
        self.pad = 60 if seed % 2 else 0
        return super().reset(seed)


def test_an_episode_whose_prompt_fills_the_budget_is_not_played(tok):
    long_env, short_env = LongPromptEnv(max_turns=1, pad=60), LongPromptEnv(max_turns=1)
    n = prompt_tokens(tok, LongPromptEnv(pad=60))
    sampler = Replies(tok, ["3"])
    runner = EpisodeRunner(sampler, tok, limits=EpisodeLimits(max_tokens=n, max_new_tokens=4))
    long_ep, short_ep = runner.run_sync([EpisodeJob(long_env, 1), EpisodeJob(short_env, 2)])
    assert (long_ep.status, long_ep.reason, long_ep.turns) == ("failed", "prompt_length", 0)
    assert long_ep.error == f"the prompt is {n} tokens, at least the episode's budget max_tokens={n} " \
                            "(--max-episode-tokens)"
    assert short_ep.turns == 1 and len(sampler.prompts) == 1  # only the short one was sampled
    assert long_ep.to_record()["tokens"] == n  # the log shows the prompt's length


def test_a_batch_of_only_too_long_prompts_raises_naming_the_flag(tok, tmp_path):
    n = prompt_tokens(tok, LongPromptEnv(pad=60))
    runner = EpisodeRunner(Replies(tok, []), tok, limits=EpisodeLimits(max_tokens=n - 1, max_new_tokens=4))
    src = EnvBatchSource(make_env=lambda: LongPromptEnv(max_turns=1, pad=60), runner=runner,
                         credit_assigner=EpisodicReturn(), seeds_per_batch=2, group_size=2,
                         episode_log=tmp_path / "episodes.jsonl", log_episodes=4)
    with pytest.raises(EmptyBatchError) as exc:
        asyncio.run(src.next_batch())
    assert str(exc.value) == (
        f"batch 0: every episode's prompt of {n} tokens fills the episode's budget max_tokens={n - 1} "
        f"(--max-episode-tokens {n - 1}): nothing to play or train; raise --max-episode-tokens above {n} or "
        "shorten the environment's prompt")
    records = read_jsonl(tmp_path / "episodes.jsonl")
    assert len(records) == 4 and {r["reason"] for r in records} == {"prompt_length"}


def test_some_too_long_prompts_are_counted_and_the_rest_trains(tok, caplog):
    short = prompt_tokens(tok, LongPromptEnv())
    runner = EpisodeRunner(Replies(tok, ["3"] * 8), tok, limits=EpisodeLimits(max_tokens=short + 20, max_turns=1))
    src = EnvBatchSource(make_env=lambda: OddSeedsLong(max_turns=1), runner=runner, credit_assigner=EpisodicReturn(),
                         seeds_per_batch=4, group_size=2, seed=1)
    odd = sum(job.seed % 2 for job in src.jobs()[::2])
    assert 0 < odd < 4  # this seed draws both kinds
    with caplog.at_level("WARNING", logger="ludic_fast.agents"):
        batch = asyncio.run(src.next_batch())
    assert batch.meta["episode_prompt_too_long"] == 2 * odd and batch.meta["episode_failed"] == 2 * odd
    assert len(batch.items) == 2 * (4 - odd) and all(i.meta["env_seed"] % 2 == 0 for i in batch.items)
    assert f"batch 0: {2 * odd} of 8 episodes not played" in caplog.text


def _demo_args(max_episode_tokens: int) -> argparse.Namespace:
    return argparse.Namespace(env="long", demonstrations=8, seed=0, max_episode_tokens=max_episode_tokens)


def test_demonstrations_whose_prompt_fills_the_budget_are_left_out(tok, capsys):
    n = prompt_tokens(tok, LongPromptEnv(pad=60))
    with pytest.raises(EmptyBatchError, match=f"8 of 8 demonstrations have a prompt of {n} tokens, at least "
                                              f"--max-episode-tokens {n}: the SFT warm-up would train nothing"):
        env_train.demonstration_items(_demo_args(n), tok, lambda: LongPromptEnv(pad=60))
    mixed = iter([LongPromptEnv(pad=60)] * 4)

    class Mixed(LongPromptEnv):
        def demonstrations(self, n_demos, seed=0):  # 4 long, 4 short
            return next(mixed).demonstrations(4, seed) + LongPromptEnv().demonstrations(4, seed)

    items = env_train.demonstration_items(_demo_args(n), tok, Mixed)
    assert len(items) == 4 and all(sum(i.action_mask) > 0 and len(i.input_ids) < n + 10 for i in items)
    assert "4 of 8 demonstrations have a prompt" in capsys.readouterr().err


def test_a_step_without_action_tokens_raises_before_the_optimizer_step():
    """Items of 12 tokens whose actions are their last 4, with max_seq_len 8: truncation leaves none."""
    items = [SAWItem(input_ids=list(range(5, 17)), attention_mask=[1] * 12, action_mask=[0] * 8 + [1] * 4,
                     weight=1.0, meta={"rollout_id": f"r{i}"}) for i in range(3)]
    trainer = Trainer(model=tiny_model(), algo=make_sft(length_normalize=True), batch_source=ListSource([items]),
                      cfg=TrainerConfig(model_device="cpu", pad_token_id=0, sync_every_steps=0, max_seq_len=8,
                                        micro_token_budget=64, lr=1e-2))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(EmptyBatchError, match=r"^step 1: none of the batch's 3 examples has an action token left to "
                                              r"train \(cut by max_seq_len=8"):
        trainer.train_sync(1)
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    assert trainer.step_idx == 0
    trainer.objective.batch_source = ListSource([[*items[:2], SAWItem(  # one action token kept: the step trains
        input_ids=list(range(5, 17)), attention_mask=[1] * 12, action_mask=[0] * 7 + [1] * 5, weight=1.0)]])
    trainer.train_sync(1)
    assert trainer.step_idx == 1
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def test_a_stop_requested_while_fetching_ends_train_without_a_step(tmp_path):
    """A source raising StopRequested: train() returns (no step), checkpointing the current step."""
    from ludic_fast.engine.stop import StopOnSignal
    from ludic_fast.run.checkpoint import CheckpointConfig

    class Stopping:
        async def next_batch(self):
            raise StopRequested("stop requested before batch 0")

    def make(source):
        return Trainer(model=tiny_model(), algo=make_sft(), batch_source=source,
                       cfg=TrainerConfig(model_device="cpu", pad_token_id=0, sync_every_steps=0, max_seq_len=8,
                                         micro_token_budget=64), checkpoint_config=CheckpointConfig(str(tmp_path)))

    stop = StopOnSignal()
    stop.signum = signal.SIGTERM
    trainer = make(Stopping())
    assert trainer.train_sync(3, stop=stop) == []
    assert trainer.stopped_by == "SIGTERM" and trainer.checkpointer.latest_step() == 0
    with pytest.raises(StopRequested):  # without a stop to honour, the source's exception is the caller's
        make(Stopping()).train_sync(1)


def test_a_stop_ends_train_while_the_objective_refetches_empty_batches():
    """Any batch source (not only the env source) whose batches all come back empty: the objective refetches,
    and a stop requested meanwhile (here by the source, at its 3rd fetch) ends train() with no step, instead of
    refetching forever; outside train() nothing is watched."""
    from ludic_fast.engine.stop import StopOnSignal

    stop = StopOnSignal()

    class EmptyBatches(ListSource):
        async def next_batch(self):
            if self.i == 2:
                stop.signum = signal.SIGTERM
            return await super().next_batch()

    source = EmptyBatches([[]])
    trainer = Trainer(model=tiny_model(), algo=make_sft(), batch_source=source,
                      cfg=TrainerConfig(model_device="cpu", pad_token_id=0, sync_every_steps=0, max_seq_len=8,
                                        micro_token_budget=64))
    assert trainer.train_sync(5, stop=stop) == []
    assert trainer.stopped_by == "SIGTERM" and trainer.step_idx == 0 and source.i == 3
    assert trainer.stop_signal is None


def test_cli_refuses_a_prompt_longer_than_the_budget_in_one_line(tmp_path, capsys):
    """The Battleship run in small: --sft-steps 0, the first RL batch's prompts are too long."""
    argv = ["train", "--env", "_env_faults:long_prompt", "--env-arg", "pad=60", "--max-episode-tokens", "40",
            "--sft-steps", "0", "--rl-steps", "3", "--prompts-per-batch", "2", "--group-size", "2",
            "--eval-every", "0", "--logger", "none", "--threads", "1", "--no-plot", "--output-dir", str(tmp_path)]
    assert train_cli.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("ludic-fast train: error: batch 0: every episode's prompt of ")
    assert "fills the episode's budget max_tokens=40 (--max-episode-tokens 40)" in err[-1]
    assert "Traceback" not in "\n".join(err)


def test_sigterm_ends_a_run_stuck_on_empty_batches_with_its_records(tmp_path):
    """The environment breaks after the first batch (4 episodes): every later batch is empty and the RL
    objective refetches; SIGTERM must still stop the run within seconds, with step 1's records, a checkpoint
    of step 1 and a whole episode log."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "ludic_fast.cli", "train", "--env", "_env_faults:breaking_env",
           "--env-arg", "works_for=4", "--sft-steps", "0", "--rl-steps", "500", "--prompts-per-batch", "2",
           "--group-size", "2", "--max-new-tokens", "3", "--eval-every", "0", "--logger", "print", "--threads", "1",
           "--device", "cpu", "--checkpoint-every", "1000", "--no-plot", "--output-dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 240
        for line in proc.stdout:  # step 1 trained on the first batch
            if "[rl] step=" in line:
                break
            assert time.monotonic() < deadline, "no RL step within the deadline"
        metrics = tmp_path / "metrics.jsonl"
        while not (metrics.exists() and "the environment's server" in (tmp_path / "episodes.jsonl").read_text()):
            assert time.monotonic() < deadline, "the run never reached the broken batches"
            time.sleep(0.2)
        time.sleep(1.0)  # refetching empty batches by now
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=30)
        seconds = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, err[-2000:]
    assert "Traceback" not in err and seconds < 15
    assert err.strip().splitlines()[-1].startswith("stopped by SIGTERM after rl step 1: saved metrics.jsonl")
    rl = [r["step"] for r in read_jsonl(metrics) if r.get("phase") == "rl" and "train/loss" in r]
    assert rl == [1]
    assert json.loads((tmp_path / "rl" / "latest.json").read_text())["step"] == 1
    records = [json.loads(x) for x in (tmp_path / "episodes.jsonl").read_text().splitlines()]  # every line whole
    assert records[0]["batch"] == 0 and records[-1]["status"] == "failed" and records[-1]["batch"] >= 1
    assert json.loads((tmp_path / "summary.json").read_text()) is not None
