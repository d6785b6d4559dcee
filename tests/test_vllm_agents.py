"""`ludic-fast train --env --sampler vllm | vllm-server`: multi-turn episodes sampled by vLLM, in-process or its
server (token ids in, token ids and log-probs out, the sequence built turn by turn) train on-policy: the
trainer's log-probs of the sampled tokens equal vLLM's, so the ratio is 1 and the actor-policy KL 0 at the
first step (and every later one, the weights being pushed after each)."""

from __future__ import annotations

import json

import pytest
from _vllm import ENGINE_CORE_RUNS_MODEL, cli, needs_vllm, run_side_by_side

ENGINES = ("vllm", "vllm-server")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both runs at once (each keeps about one core busy): {engine: (its output dir, its process)}."""
    needs_vllm()
    base = tmp_path_factory.mktemp("agents")
    # 10 SFT steps change the weights far beyond the ratio's 1e-3 (a push left out shows) and give multi-turn
    # episodes (turns 3.2 per episode at the first RL step, 2.5 after 5 SFT steps)
    cmds = {engine: cli(
        "train", "--env", "embedded-guess", "--sampler", engine,
        "--vllm-arg", "enforce_eager=true", "--vllm-arg", f"kv_cache_memory_bytes={64 << 20}",
        "--output-dir", str(base / engine), "--logger", "print", "--no-plot", "--sft-steps", "10", "--rl-steps", "3",
        "--prompts-per-batch", "8", "--group-size", "4", "--eval-every", "0", "--max-new-tokens", "3",
    ) for engine in ENGINES}
    procs = run_side_by_side(cmds, base, env=ENGINE_CORE_RUNS_MODEL)
    return {engine: (base / engine, procs[engine]) for engine in ENGINES}


@pytest.mark.parametrize("engine", ENGINES)
def test_multi_turn_episodes_with_vllm_train_on_policy(runs, engine):
    out, proc = runs[engine]
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
