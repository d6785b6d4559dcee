"""`ludic-fast train --engine vllm` on the embedded task, end to end on a real vLLM (`make test`: .venv-vllm):
SFT, then RL whose first batch is sampled with the SFT weights (ratio 1 at the first step), weights pushed
after every step, and a reward gain. A shortened run (24 RL steps of 16 x 8 instead of the demo's 80 of
32 x 8) to fit CI; docs/trainer.md gives the full demo's numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from _vllm import needs_vllm

RL_STEPS = 24


def test_train_with_vllm_engine_starts_on_policy_and_gains_reward(tmp_path):
    needs_vllm()
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "ludic_fast.cli", "train", "--engine", "vllm", "--vllm-arg", "enforce_eager=true",
        "--vllm-arg", f"kv_cache_memory_bytes={64 << 20}", "--output-dir", str(out), "--logger", "print",
        "--no-plot", "--rl-steps", str(RL_STEPS), "--prompts-per-batch", "16", "--eval-every", "0",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r.get("phase") == "rl" and "train/ratio_mean" in r]
    assert len(rl) == RL_STEPS
    # the first batch was sampled by the engine holding the SFT weights: the trainer's recomputed log-probs
    # equal the behaviour ones (fp32 on both sides), so ratio = exp(logp - behaviour logp) = 1 and the KL is 0
    first = rl[0]
    assert abs(first["train/ratio_mean"] - 1) < 1e-3, first
    assert abs(first["train/kl_actor_policy"]) < 1e-4, first
    assert all(abs(r["train/ratio_mean"] - 1) < 1e-3 for r in rl), "a step sampled with stale weights"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["gain"] is not None and summary["gain"] >= 0.05, summary


def _saved_model_and_jsonl_task(tmp_path):
    """A model directory (the embedded tiny Llama and its tokenizer, saved) and a JSONL task of sums."""
    from ludic_fast.embedded import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    model_dir = tmp_path / "model"
    build_tiny_model(len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    task = tmp_path / "sums.jsonl"
    task.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a in range(8) for b in range(5)))
    return model_dir, task


def test_train_with_a_vllm_server_started_by_the_run_stays_on_policy(tmp_path):
    """--engine vllm-server on a saved model directory and a JSONL task: the run starts vLLM's OpenAI server on
    the directory's checkpoint, pushes the SFT'd weights through its update path before the first batch and
    after every step (ratio 1 at each step), then stops the server."""
    needs_vllm()
    out = tmp_path / "run"
    model_dir, task = _saved_model_and_jsonl_task(tmp_path)
    cmd = [
        sys.executable, "-m", "ludic_fast.cli", "train", "--engine", "vllm-server", "--vllm-arg", "enforce_eager=true",
        "--vllm-arg", f"kv_cache_memory_bytes={64 << 20}", "--output-dir", str(out), "--logger", "print",
        "--no-plot", "--sft-steps", "20", "--rl-steps", "3", "--prompts-per-batch", "8", "--eval-every", "0",
        "--model", str(model_dir), "--task", str(task), "--reward", "exact", "--max-new-tokens", "8",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r.get("phase") == "rl" and "train/ratio_mean" in r]
    assert len(rl) == 3 and all(abs(r["train/ratio_mean"] - 1) < 1e-3 for r in rl), rl
