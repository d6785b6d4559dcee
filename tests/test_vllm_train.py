"""`ludic-fast train --engine vllm` on the embedded task, end to end on a real vLLM (`make test`: .venv-vllm):
SFT, then RL whose first batch is sampled with the SFT weights (ratio 1 at the first step), weights pushed
after every step, and a reward gain. A shortened run (24 RL steps of 16 x 8 instead of the demo's 80 of
32 x 8) to fit CI; docs/trainer.md gives the full demo's numbers. Beside it, `--engine vllm-server` on a
saved model directory and a JSONL task; the two runs go at once (each keeps about one core busy)."""

from __future__ import annotations

import json

import pytest
from _vllm import cli, needs_vllm, run_side_by_side

RL_STEPS = 24


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


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"engine" | "server": (output dir, process)}: the in-process engine's run on the embedded task and the
    run that starts vLLM's server (vLLM's default engine arguments but eager, small KV cache) on a saved model."""
    needs_vllm()
    base = tmp_path_factory.mktemp("train")
    model_dir, task = _saved_model_and_jsonl_task(base)
    small = ["--vllm-arg", "enforce_eager=true", "--vllm-arg", f"kv_cache_memory_bytes={64 << 20}"]
    cmds = {
        "engine": cli("train", "--engine", "vllm", *small, "--output-dir", str(base / "engine"), "--logger", "print",
                      "--no-plot", "--rl-steps", str(RL_STEPS), "--prompts-per-batch", "16", "--eval-every", "0"),
        "server": cli("train", "--engine", "vllm-server", *small, "--output-dir", str(base / "server"),
                      "--logger", "print", "--no-plot", "--sft-steps", "20", "--rl-steps", "3",
                      "--prompts-per-batch", "8", "--eval-every", "0", "--model", str(model_dir), "--task", str(task),
                      "--reward", "exact", "--max-new-tokens", "8"),
    }
    procs = run_side_by_side(cmds, base)
    return {key: (base / key, procs[key]) for key in cmds}


def _rl_records(out):
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("phase") == "rl" and "train/ratio_mean" in r]


def test_train_with_vllm_engine_starts_on_policy_and_gains_reward(runs):
    out, proc = runs["engine"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    rl = _rl_records(out)
    assert len(rl) == RL_STEPS
    # the first batch was sampled by the engine holding the SFT weights: the trainer's recomputed log-probs
    # equal the behaviour ones (fp32 on both sides), so ratio = exp(logp - behaviour logp) = 1 and the KL is 0
    first = rl[0]
    assert abs(first["train/ratio_mean"] - 1) < 1e-3, first
    assert abs(first["train/kl_actor_policy"]) < 1e-4, first
    assert all(abs(r["train/ratio_mean"] - 1) < 1e-3 for r in rl), "a step sampled with stale weights"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["gain"] is not None and summary["gain"] >= 0.05, summary


def test_train_with_a_vllm_server_started_by_the_run_stays_on_policy(runs):
    """--engine vllm-server on a saved model directory and a JSONL task: the run starts vLLM's OpenAI server on
    the directory's checkpoint, pushes the SFT'd weights through its update path before the first batch and
    after every step (ratio 1 at each step), then stops the server."""
    out, proc = runs["server"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    rl = _rl_records(out)
    assert len(rl) == 3 and all(abs(r["train/ratio_mean"] - 1) < 1e-3 for r in rl), rl
