"""The one resume-record rule (ludic_fast.run.loggers.keep_records_for_resume) and the pipeline learner through a
SIGKILL and `--resume` after its SFT warm-up: the warm-up's records are kept whole, every RL step once."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import _forked as forked
import pytest
from _pipeline_examples import actor_and_learner_mains
from _redis import needs_server

from ludic_fast.run.loggers import keep_records_for_resume


def _write(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _steps(records: list[dict], phase: str) -> list[int]:
    return [r["step"] for r in records if r.get("phase") == phase]


def test_a_complete_phase_is_kept_whole_and_the_resumed_one_up_to_its_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sft = [{"phase": "sft", "step": s} for s in range(1, 41)]  # a 40-step warm-up, then RL killed after step 7
    rl = [{"phase": "rl", "step": s} for s in range(1, 8)]
    _write(path, sft + rl)
    keep_records_for_resume(path, phases=("sft", "rl"), resumed="rl", step=6)
    kept = _read(path)
    assert _steps(kept, "sft") == list(range(1, 41)) and _steps(kept, "rl") == list(range(1, 7))

    _write(path, sft[:9] + rl[:1])  # the warm-up resumed at its step 8: its later records and any RL go
    keep_records_for_resume(path, phases=("sft", "rl"), resumed="sft", step=8)
    assert [(r["phase"], r["step"]) for r in _read(path)] == [("sft", s) for s in range(1, 9)]

    keep_records_for_resume(path, phases=("sft", "rl"), resumed=None)  # a fresh run starts a new file
    assert not path.exists()
    keep_records_for_resume(path, phases=("sft", "rl"), resumed="rl", step=3)  # nothing to trim: no file made
    assert not path.exists()


def test_records_it_cannot_place_are_refused(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write(path, [{"phase": "sft", "step": 1}, {"step": 1}])
    with pytest.raises(ValueError, match="phase None"):
        keep_records_for_resume(path, phases=("sft", "rl"), resumed="rl", step=1)
    assert len(_read(path)) == 2  # untouched
    with pytest.raises(ValueError, match="resumed='dpo'"):
        keep_records_for_resume(path, phases=("sft", "rl"), resumed="dpo", step=1)
    with pytest.raises(ValueError, match="step"):
        keep_records_for_resume(path, phases=("sft", "rl"), resumed="rl")


def _wait(cond, what: str, timeout: float = 150.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@needs_server
@pytest.mark.timeout(300)
def test_learner_resumed_after_a_kill_keeps_the_warm_up_and_logs_each_rl_step_once(redis_server, tmp_path):
    """examples/pipeline_rl/learner.py with a 5-step SFT warm-up, RL with a checkpoint every 2 steps, SIGKILLed
    after an RL step its checkpoint does not cover, then `--resume`: metrics.jsonl holds SFT steps 1..5 once and
    RL steps 1..6 once; trained_ids.jsonl RL steps 1..6 once (the phase-blind trim kept SFT 1..2 only)."""
    out = tmp_path / "run"
    sft_steps, rl_steps, every = 5, 6, 2
    common = ["--redis-url", redis_server.url, "--prefix", "rr", "--prompts-per-batch", "2", "--group-size", "2",
              "--threads", "1", "--device", "cpu", "--logger", "none"]
    learner_argv = [*common, "--sft-steps", str(sft_steps), "--rl-steps", str(rl_steps), "--eval-every", "0",
                    "--output-dir", str(out), "--checkpoint-every", str(every)]
    actor_main, learner_main = actor_and_learner_mains()
    logs: dict[str, Path] = {}
    procs = []

    def start(name, main, argv):  # forked from this process: the scripts' imports are done once, here
        logs[name] = tmp_path / f"{name}.log"
        procs.append(forked.start(lambda: main(argv), stdout=logs[name], stderr=forked.STDOUT))
        return procs[-1]

    def rl_steps_logged():
        return _steps(_read(out / "metrics.jsonl"), "rl")

    try:
        start("actor", actor_main, [*common, "--actor-id", "a0", "--max-queued", "8"])
        learner = start("learner", learner_main, learner_argv)
        _wait(lambda: max(rl_steps_logged(), default=0) >= every + 1, "an RL step past the first checkpoint")
        learner.send_signal(signal.SIGKILL)
        learner.wait()
        assert _steps(_read(out / "metrics.jsonl"), "sft") == list(range(1, sft_steps + 1))
        resumed = start("learner2", learner_main, [*learner_argv, "--resume"])
        assert resumed.wait(timeout=150) == 0, logs["learner2"].read_text()[-3000:]
        assert procs[0].wait(timeout=60) == 0, logs["actor"].read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    assert "resumed at step" in logs["learner2"].read_text()
    metrics = _read(out / "metrics.jsonl")
    assert _steps(metrics, "sft") == list(range(1, sft_steps + 1))
    assert _steps(metrics, "rl") == list(range(1, rl_steps + 1))
    assert _steps(_read(out / "trained_ids.jsonl"), "rl") == list(range(1, rl_steps + 1))


def test_a_resumed_episode_source_drops_its_log_past_the_checkpoint(tmp_path):
    """EnvBatchSource logs episodes tagged with their 0-based batch; resumed after 3 batches, the records of
    batches 3 and 4 go (played and logged again), 0..2 stay."""
    from ludic_fast.agents import EnvBatchSource

    log = tmp_path / "episodes.jsonl"
    _write(log, [{"batch": b, "messages": []} for b in range(5) for _ in range(2)])
    src = EnvBatchSource(make_env=lambda: None, runner=None, credit_assigner=None, seeds_per_batch=1, group_size=1,
                         episode_log=log)
    src.load_state_dict({"batches": 3})
    assert src.batches == 3 and [r["batch"] for r in _read(log)] == [0, 0, 1, 1, 2, 2]
