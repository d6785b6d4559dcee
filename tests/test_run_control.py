"""Run control of the trainer and `ludic-fast train` (in process): the logged rate is the one the step used,
a diverged run stops with one line naming the step, resume continues the files exactly, and inputs are
checked before any model is built. The signal tests (subprocesses) are tests/test_stop_signal.py."""

from __future__ import annotations

import copy
import json
import signal

import pytest
from _trainer_fixtures import ListSource, make_items, tiny_model

from ludic_fast.algorithm import RLAlgorithm, make_cispo, make_sft
from ludic_fast.cli import run_setup
from ludic_fast.cli import train as train_cli
from ludic_fast.data.credit import ConstantCredit
from ludic_fast.data.types import SAWBatch
from ludic_fast.engine.guard import NonFiniteError
from ludic_fast.engine.stop import StopOnSignal
from ludic_fast.losses import CISPOLoss
from ludic_fast.run.loggers import JSONLLogger, read_jsonl
from ludic_fast.trainer import Trainer, TrainerConfig

COMMON = ["--logger", "none", "--threads", "1", "--device", "cpu", "--no-plot"]
FAST = ["--sft-steps", "2", "--prompts-per-batch", "4", "--group-size", "4", *COMMON]


def _cfg(**kw) -> TrainerConfig:
    base = dict(model_device="cpu", pad_token_id=0, sync_every_steps=0, max_seq_len=16, micro_token_budget=64)
    return TrainerConfig(**{**base, **kw})


def test_logged_lr_is_the_rate_the_step_used():
    """Warm-up 2 then cosine over 4 steps: factors 1/2, 1, 1, 1/2 (step s uses lr_lambda(s)); the record of
    each step holds the rate the optimizer had during its step (before: the next step's, 1, 1, 1/2, 0)."""
    trainer = Trainer(model=tiny_model(), algo=make_sft(), batch_source=ListSource([make_items(4, seed=1)]),
                      cfg=_cfg(lr=0.004, lr_scheduler="cosine", warmup_steps=2, total_steps=4))
    used = []
    trainer.optimizer.register_step_pre_hook(lambda opt, args, kwargs: used.append(opt.param_groups[0]["lr"]))
    logged = [trainer.train_step_sync()["train/lr"] for _ in range(4)]
    assert logged == used == pytest.approx([0.002, 0.004, 0.004, 0.002])


def _poisoned(batch: SAWBatch) -> SAWBatch:
    bad = copy.copy(batch.items[0])
    bad.weight = float("nan")  # after construction: bypasses SAWItem's finiteness check
    batch.items[0] = bad
    return batch


def test_loss_non_finite_steps_in_a_row_stop_the_run():
    """One non-finite step is skipped; `max_nonfinite_steps` in a row stop with one line naming the step and
    the learning rate, after the step's record was logged."""
    logged = []

    class Log:
        def log(self, step, stats):
            logged.append(step)

    algo = RLAlgorithm("poisoned", ConstantCredit(1.0), CISPOLoss(), _poisoned)
    trainer = Trainer(model=tiny_model(), algo=algo, batch_source=ListSource([make_items(3, seed=2)]),
                      cfg=_cfg(lr=0.01, max_nonfinite_steps=2), train_logger=Log())
    assert trainer.train_step_sync()["train/step_skipped"] == 1.0
    with pytest.raises(NonFiniteError, match=r"^step 2: the loss was not finite for 2 steps in a row.*lr 0\.01\)$"):
        trainer.train_step_sync()
    assert logged == [1, 2]
    with pytest.raises(ValueError, match="max_nonfinite_steps"):
        _cfg(max_nonfinite_steps=0)


def test_sampling_from_non_finite_probabilities_names_the_step():
    class Diverged:
        async def next_batch(self):
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")

    trainer = Trainer(model=tiny_model(), algo=make_cispo(group_size=1), batch_source=Diverged(), cfg=_cfg(lr=0.5))
    with pytest.raises(NonFiniteError, match=r"^step 1: sampling met inf/nan probabilities.*lr 0\.5\)$"):
        trainer.train_step_sync()


def test_a_foreign_runtime_error_from_the_batch_source_passes_through_unchanged():
    """Only torch's refusal to sample from inf/nan probabilities is a divergence; any other RuntimeError of a
    batch source (a server gone, a bug) reaches the caller as it was raised."""
    error = RuntimeError("connection to the rollout server was reset")

    class Broken:
        async def next_batch(self):
            raise error

    trainer = Trainer(model=tiny_model(), algo=make_cispo(group_size=1), batch_source=Broken(), cfg=_cfg(lr=0.5))
    with pytest.raises(RuntimeError) as info:
        trainer.train_step_sync()
    assert info.value is error

def test_cli_diverged_run_stops_with_one_line_and_keeps_its_files(tmp_path, capsys):
    """--lr 1e10 --sft-lr 1e10 (a traceback from torch.multinomial before): exit 1, one line naming the step
    and the learning rate; the metrics logged so far and summary.json are written."""
    args = ["train", *FAST, "--sft-steps", "6", "--rl-steps", "3", "--lr", "1e10", "--sft-lr", "1e10",
            "--eval-every", "0", "--output-dir", str(tmp_path)]
    assert train_cli.main(args) == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("ludic-fast train: error: step ") and "learning rate" in err[0]
    assert read_jsonl(tmp_path / "metrics.jsonl") and (tmp_path / "summary.json").is_file()


@pytest.mark.parametrize("preset", ["cispo", "dpo"])
def test_resume_without_a_checkpoint_is_a_one_line_error(tmp_path, capsys, preset):
    flags = FAST if preset == "cispo" else COMMON
    args = ["train", *flags, "--preset", preset, "--output-dir", str(tmp_path), "--resume"]
    assert train_cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("ludic-fast train: error: --resume: no checkpoint under")


@pytest.mark.parametrize("preset", ["cispo", "dpo"])
def test_output_dir_that_cannot_be_written_is_refused_before_building(tmp_path, capsys, monkeypatch, preset):
    def no_model(*a, **k):
        raise AssertionError("a model was built")

    monkeypatch.setattr(train_cli, "build_model_and_tokenizer", no_model)
    monkeypatch.setattr(run_setup, "build_model_and_tokenizer", no_model)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    flags = FAST if preset == "cispo" else COMMON
    args = ["train", *flags, "--preset", preset, "--output-dir", str(blocker / "run")]
    assert train_cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"ludic-fast train: error: --output-dir {blocker / 'run'}")


def _without_timings(records):
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in records]


def test_resumed_run_files_equal_the_uninterrupted_run(tmp_path):
    """A run that went one step past its checkpoint (RL steps 1-3, checkpoint at 2), resumed to step 4, leaves
    the metrics.jsonl and summary.json of an uninterrupted 4-step run (timings aside): step 3 is not logged
    twice (it was before) and the reward curve has 4 points."""
    common = ["train", *FAST, "--checkpoint-every", "2", "--eval-every", "2"]
    assert train_cli.main([*common, "--rl-steps", "4", "--output-dir", str(tmp_path / "full")]) == 0
    cut = str(tmp_path / "cut")
    assert train_cli.main([*common, "--rl-steps", "3", "--output-dir", cut]) == 0
    assert train_cli.main([*common, "--rl-steps", "4", "--output-dir", cut, "--resume"]) == 0
    full, resumed = (read_jsonl(tmp_path / d / "metrics.jsonl") for d in ("full", "cut"))
    assert [(r["phase"], r["step"]) for r in resumed] == [(r["phase"], r["step"]) for r in full]
    assert _without_timings(resumed) == _without_timings(full)
    summaries = [json.loads((tmp_path / d / "summary.json").read_text()) for d in ("full", "cut")]
    for s in summaries:
        del s["wall_time_s"], s["metrics"]
    assert summaries[0] == summaries[1] and len(summaries[0]["reward_curve"]) == 4


def test_run_cut_in_the_sft_phase_resumes_to_the_files_of_the_uninterrupted_run(tmp_path, monkeypatch):
    """A stop requested during SFT step 3 of 4 (the stop checkpoints step 3), then --resume: metrics.jsonl and
    summary.json equal those of an uninterrupted run (timings aside), so step 3's record is kept once."""
    common = ["train", *FAST, "--sft-steps", "4", "--rl-steps", "1", "--checkpoint-every", "2", "--eval-every", "0"]
    assert train_cli.main([*common, "--output-dir", str(tmp_path / "full")]) == 0
    stops = []

    class Recorded(StopOnSignal):
        def __enter__(self):
            stops.append(self)
            return super().__enter__()

    class SigtermInSftStep3(JSONLLogger):
        def log(self, step, stats):
            super().log(step, stats)
            if self.extra.get("phase") == "sft" and step == 3:
                stops[-1]._handle(signal.SIGTERM, None)  # what the handler does when SIGTERM arrives

    cut = str(tmp_path / "cut")
    with monkeypatch.context() as m:
        m.setattr(train_cli, "StopOnSignal", Recorded)
        m.setattr(train_cli, "JSONLLogger", SigtermInSftStep3)
        assert train_cli.main([*common, "--output-dir", cut]) == 143
    logged = read_jsonl(tmp_path / "cut" / "metrics.jsonl")
    assert [(r["phase"], r["step"]) for r in logged] == [("sft", 1), ("sft", 2), ("sft", 3)]
    assert train_cli.main([*common, "--output-dir", cut, "--resume"]) == 0
    full, resumed = (read_jsonl(tmp_path / d / "metrics.jsonl") for d in ("full", "cut"))
    assert [(r["phase"], r["step"]) for r in resumed] == [(r["phase"], r["step"]) for r in full]
    assert _without_timings(resumed) == _without_timings(full)
    summaries = [json.loads((tmp_path / d / "summary.json").read_text()) for d in ("full", "cut")]
    for s in summaries:
        del s["wall_time_s"], s["metrics"]
    assert summaries[0] == summaries[1]


def test_torchrun_without_parallel_is_refused_before_anything_runs(tmp_path, capsys, monkeypatch):
    """Under torchrun without --parallel every rank would train the whole run alone (before: it did, silently);
    --parallel outside torchrun has no ranks to join."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert train_cli.main(["train", *FAST, "--output-dir", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("ludic-fast train: error: under torchrun (WORLD_SIZE=2) pass --parallel")
    monkeypatch.delenv("WORLD_SIZE")
    assert train_cli.main(["train", *FAST, "--parallel", "ddp", "--output-dir", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--parallel needs a torchrun launch" in err
    assert not (tmp_path / "x").exists()
