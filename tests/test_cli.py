"""`ludic-fast train` / `demo`: a few-step run of the embedded default writes metrics, summary and the PNG;
`--resume` continues the RL phase from its checkpoint (LoRA adapters included); presets by name; bad flags."""

from __future__ import annotations

import json

import pytest

from ludic_fast import cli
from ludic_fast.cli import train as train_cli
from ludic_fast.run.loggers import read_jsonl

FAST = [
    "--sft-steps",
    "2",
    "--rl-steps",
    "3",
    "--prompts-per-batch",
    "4",
    "--group-size",
    "4",
    "--eval-every",
    "2",
    "--logger",
    "none",
    "--threads",
    "1",
    "--device",
    "cpu",
]


def test_demo_runs_and_writes_outputs(tmp_path, capsys):
    assert cli.main(["demo", *FAST, "--output-dir", str(tmp_path)]) == 0
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records if r["phase"] == "sft"] == [1, 2]
    rl = [r for r in records if r["phase"] == "rl" and "train/loss" in r]
    assert [r["step"] for r in rl] == [1, 2, 3]
    assert any("eval/reward" in r for r in records)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary["reward_curve"]) == 3 and summary["rl_steps"] == 3
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    assert "eval: the 80 training rows (--eval-on-train)" in out  # the run header names the eval set
    assert "RL reward: mean" in out and "not enough steps to measure a gain" in out
    assert summary["gain"] is None and summary["first10_mean"] is None
    assert not any("train/avg_total_reward" in r for r in records if r["phase"] == "sft")  # no RL-only metric


def test_eval_values_only_on_eval_steps(tmp_path, capsys):
    """Eval every 2 RL steps (and at start): eval keys sit exactly on the records of steps 0, 2, 4, each
    measured at that step; no train record repeats them, in metrics.jsonl or on the console."""
    args = ["train", *FAST, "--sft-steps", "0", "--rl-steps", "5", "--logger", "print", "--no-plot"]
    assert train_cli.main([*args, "--output-dir", str(tmp_path)]) == 0
    records = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["phase"] == "rl"]
    evals = [r for r in records if any(k.startswith("eval/") for k in r)]
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert all(r["eval/step"] == r["step"] and isinstance(r["eval/reward"], float) for r in evals)
    assert [r["step"] for r in records if "train/loss" in r and r not in evals] == [1, 2, 3, 4, 5]
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[trainer] [rl] step=")]
    assert [ln.split()[2] for ln in lines if "eval/reward=" in ln] == ["step=0/5", "step=2/5", "step=4/5"]


def test_train_resume_continues_rl_phase_with_lora(tmp_path):
    args = [
        "train",
        *FAST,
        "--output-dir",
        str(tmp_path),
        "--checkpoint-every",
        "1",
        "--no-plot",
        "--eval-every",
        "0",
        "--lora-r",
        "2",
    ]
    assert train_cli.main(args) == 0
    assert (tmp_path / "rl" / "latest.json").is_file() and (tmp_path / "sft" / "latest.json").is_file()
    args[args.index("--rl-steps") + 1] = "5"
    assert train_cli.main([*args, "--resume"]) == 0
    rl = [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if r["phase"] == "rl" and "train/loss" in r]
    assert rl == [1, 2, 3, 4, 5]  # the SFT phase was skipped, RL went on from step 3


def test_presets_and_flags(tmp_path):
    for name in train_cli.PRESETS:
        args = train_cli.build_parser("x").parse_args(["--preset", name, "--group-size", "4"])
        assert train_cli.make_algorithm(args).name == name
    with pytest.raises(SystemExit):
        train_cli.build_parser("x").parse_args(["--preset", "nope"])
    args = train_cli.build_parser("x").parse_args(["--memory-budget", "4GiB", "--device", "cpu"])
    train_cli.apply_recipe(args)
    assert train_cli.trainer_config(args, 0, lr=1e-3, steps=1, sync=0).memory_budget == 4 * 2**30
    assert train_cli.build_parser("x").parse_args([]).memory_budget is None
    with pytest.raises(SystemExit):
        train_cli.build_parser("x").parse_args(["--memory-budget", "0"])
    assert train_cli.main(["demo", "--model", "gpt2", "--output-dir", str(tmp_path)]) == 2
    with pytest.raises(ValueError, match="train"):
        train_cli.main(["bench"])


def test_summary_numbers():
    recs = [{"phase": "sft", "train/avg_total_reward": 0.0}] + [
        {"phase": "rl", "train/avg_total_reward": float(i)} for i in range(25)
    ]
    s = train_cli.summarize(recs)
    assert s["first10_mean"] == 4.5 and s["last10_mean"] == 19.5 and s["gain"] == 15.0
    assert "first-10 mean 4.500, last-10 mean 19.500 (gain +15.000)" in train_cli.summary_line({**s, "wall_time_s": 1})
    # 10 steps: the two windows would be the same steps, so no gain is claimed; no steps: no nan either
    short = train_cli.summarize(recs[:11])
    assert short["gain"] is None and short["reward_curve"] == [float(i) for i in range(10)]
    line = train_cli.summary_line({**short, "wall_time_s": 1})
    assert "mean 4.500 over 10 steps; not enough steps to measure a gain (needs 20" in line
    empty = train_cli.summarize(recs[:1])
    assert empty["gain"] is None and "no RL steps ran" in train_cli.summary_line({**empty, "wall_time_s": 0})
    assert "nan" not in json.dumps(empty).lower()


def test_train_with_zero_rl_steps_writes_a_valid_summary(tmp_path, capsys):
    args = ["train", *FAST, "--output-dir", str(tmp_path), "--rl-steps", "0", "--no-plot"]
    assert train_cli.main(args) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())  # strict JSON: NaN would not parse back as null
    assert summary["rl_steps"] == 0 and summary["gain"] is None
    assert "RL reward: no RL steps ran" in capsys.readouterr().out


def test_train_default_output_dir_is_named_after_task_and_preset(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert train_cli.main(["train", *FAST, "--rl-steps", "1", "--sft-steps", "0", "--no-plot", "--preset", "grpo"]) == 0
    (run,) = (tmp_path / "runs").iterdir()
    assert run.name.startswith("addition-grpo-") and (run / "summary.json").is_file()


def test_rollout_source_follows_the_sampling_flags():
    """`ludic-fast train` and the pipeline actor build their rollouts with `build_rollout_source`: the
    sampling flags and the preset's dynamic-sampling default reach the source."""
    args = train_cli.build_parser("x").parse_args(
        ["--preset", "dapo", "--tie-jitter", "0.1", "--max-rounds", "3", "--device", "cpu"]
    )
    tok, task = train_cli.prepare(args, "train")
    no_sampling = object()  # a stand-in sampler: the source is built and inspected, never asked to sample
    source = train_cli.build_rollout_source(args, no_sampling, tok, task, train_cli.make_algorithm(args))
    assert (source.dynamic_sampling, source.max_rounds, source.tie_jitter) == (True, 3, 0.1)
    args = train_cli.build_parser("x").parse_args(["--preset", "scalerl", "--device", "cpu"])
    tok, task = train_cli.prepare(args, "train")
    algo = train_cli.make_algorithm(args)
    source = train_cli.build_rollout_source(args, no_sampling, tok, task, algo)
    assert not source.dynamic_sampling and source.curriculum is algo.curriculum is not None
