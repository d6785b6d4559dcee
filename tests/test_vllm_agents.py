"""`ludic-fast train --env --sampler vllm | vllm-server`: multi-turn episodes sampled by vLLM, in-process or its
server (token ids in, token ids and log-probs out, the sequence built turn by turn) train on-policy: the
trainer's log-probs of the sampled tokens equal vLLM's, so the ratio is 1 and the actor-policy KL 0 at the
first step (and every later one, the weights being pushed after each)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _vllm import needs_vllm


@pytest.mark.parametrize("engine", ["vllm", "vllm-server"])
def test_multi_turn_episodes_with_vllm_train_on_policy(tmp_path, engine):
    needs_vllm()
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "ludic_fast.cli", "train", "--env", "embedded-guess", "--sampler", engine,
        "--vllm-arg", "enforce_eager=true", "--vllm-arg", f"kv_cache_memory_bytes={64 << 20}",
        "--output-dir", str(out), "--logger", "print", "--no-plot", "--sft-steps", "30", "--rl-steps", "3",
        "--prompts-per-batch", "8", "--group-size", "4", "--eval-every", "0", "--max-new-tokens", "3",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r.get("phase") == "rl" and "train/ratio_mean" in r]
    assert len(rl) == 3
    first = rl[0]
    assert first["train/episode_turns_mean"] > 1.5, first  # multi-turn episodes, not one answer each
    assert abs(first["train/ratio_mean"] - 1) < 1e-3, first
    assert abs(first["train/kl_actor_policy"]) < 1e-4, first
    assert all(abs(r["train/ratio_mean"] - 1) < 1e-3 for r in rl), "a step sampled with stale weights"
    episodes = [json.loads(x) for x in (out / "episodes.jsonl").read_text().splitlines()]
    assert any(e["turns"] > 1 for e in episodes)
