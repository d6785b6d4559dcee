"""kill -9 in the middle of a checkpoint write, then resume: the previous checkpoint loads and the continued
run's losses and curriculum history equal an uninterrupted run's (CPU, deterministic, separate processes).

The run: the embedded tiny task with rollouts from transformers `generate` (tie jitter on, so the untrained
model's all-zero groups survive the zero-variance filter), the ScaleRL preset (its No-Positive-Resampling
curriculum history is part of the checkpoint), a checkpoint after every step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

CHILD = textwrap.dedent(
    """
    import json, sys, time
    import torch
    torch.set_num_threads(1)
    from ludic_fast import checkpoint
    from ludic_fast.algorithm import make_scalerl
    from ludic_fast.checkpoint import CheckpointConfig
    from ludic_fast.embedded import build_char_tokenizer, build_tiny_model
    from ludic_fast.rollout import HFGenerateEngine, RolloutBatchSource, SamplingConfig, embedded_default_task
    from ludic_fast.trainer import Trainer, TrainerConfig

    out, mode, steps, crash_step = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    tok = build_char_tokenizer()
    model = build_tiny_model(len(tok), seed=0, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=2)
    algo = make_scalerl(group_size=4)
    engine = HFGenerateEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    source = RolloutBatchSource(engine=engine, task=embedded_default_task(), tokenizer=tok,
                                credit_assigner=algo.credit_assigner, prompts_per_batch=4, group_size=4,
                                sampling=SamplingConfig(temperature=1.0, max_new_tokens=3), seed=0,
                                curriculum=algo.curriculum, tie_jitter=0.1)
    cfg = TrainerConfig(model_device="cpu", pad_token_id=tok, lr=3e-3, max_seq_len=16, micro_token_budget=64)
    if mode == "crash":
        real_save_file = checkpoint.save_file

        def slow_save_file(tensors, path, *a, **k):
            if f"{crash_step:06d}" in str(path):  # the optimizer file of the doomed checkpoint
                with open(path, "wb") as f:
                    f.write(b"partial")
                    f.flush()
                print("WRITING", flush=True)
                time.sleep(120)
            return real_save_file(tensors, path, *a, **k)

        checkpoint.save_file = slow_save_file
    trainer = Trainer(model=model, algo=algo, batch_source=source, cfg=cfg, publisher=engine,
                      checkpoint_config=CheckpointConfig(out, every_n_steps=1, max_to_keep=2),
                      resume_from="latest" if mode == "resume" else None)
    start = trainer.step_idx
    for _ in range(steps - start):
        stats = trainer.train_step_sync()
        print("STEP " + json.dumps({"step": trainer.step_idx, "loss": stats["train/loss"],
                                    "reward": stats["train/avg_total_reward"]}), flush=True)
    print("FINAL " + json.dumps({"start": start, "curriculum": algo.curriculum.state_dict()}), flush=True)
    """
)


def _env() -> dict:
    root = Path(__file__).resolve().parents[1]
    return {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}


def _run(script: Path, *args: str) -> list[str]:
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


def _parse(lines: list[str]) -> tuple[dict[int, dict], dict]:
    steps = {}
    final = {}
    for line in lines:
        if line.startswith("STEP "):
            rec = json.loads(line[5:])
            steps[rec["step"]] = rec
        elif line.startswith("FINAL "):
            final = json.loads(line[6:])
    return steps, final


def test_kill_during_checkpoint_write_then_resume(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    total, crash = 4, 3
    full_steps, full_final = _parse(_run(script, str(tmp_path / "full"), "full", str(total), "0"))
    assert sorted(full_steps) == [1, 2, 3, 4]

    run_dir = tmp_path / "crashed"
    proc = subprocess.Popen([sys.executable, str(script), str(run_dir), "crash", str(total), str(crash)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    crashed_lines = []
    deadline = time.monotonic() + 300
    try:
        for line in proc.stdout:
            crashed_lines.append(line.rstrip("\n"))
            if line.startswith("WRITING"):
                os.kill(proc.pid, signal.SIGKILL)  # kill -9 mid-write
                break
            assert time.monotonic() < deadline, "child never reached the checkpoint write"
    finally:
        proc.kill()
        proc.wait()
    assert any(line.startswith("WRITING") for line in crashed_lines), proc.stderr.read()[-3000:]
    crashed_steps, _ = _parse(crashed_lines)
    assert sorted(crashed_steps) == [1, 2]  # step 3 trained, then died while checkpointing
    assert [crashed_steps[s] for s in (1, 2)] == [full_steps[s] for s in (1, 2)]
    assert list(run_dir.glob(".tmp-step_*"))  # the interrupted write left only a hidden temp dir
    assert json.loads((run_dir / "latest.json").read_text())["step"] == crash - 1

    resumed_steps, resumed_final = _parse(_run(script, str(run_dir), "resume", str(total), "0"))
    assert resumed_final["start"] == crash - 1  # the previous checkpoint loaded
    assert sorted(resumed_steps) == [3, 4]
    for s in (3, 4):
        assert resumed_steps[s] == full_steps[s]
    assert resumed_final["curriculum"] == full_final["curriculum"]
    assert resumed_final["curriculum"]["history"]  # the history is not trivially empty
