"""`ludic-fast train` / `demo`: a few-step run of the embedded default writes metrics, summary and the PNG;
`--resume` continues the RL phase from its checkpoint (LoRA adapters included); presets by name; bad flags."""

from __future__ import annotations

import json

import pytest

from ludic_fast import cli, train_cli
from ludic_fast.loggers import read_jsonl

FAST = ["--sft-steps", "2", "--rl-steps", "3", "--prompts-per-batch", "4", "--group-size", "4", "--eval-every", "2",
        "--logger", "none", "--threads", "1", "--device", "cpu"]


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
    assert "RL reward: first-10 mean" in capsys.readouterr().out


def test_train_resume_continues_rl_phase_with_lora(tmp_path):
    args = ["train", *FAST, "--output-dir", str(tmp_path), "--checkpoint-every", "1", "--no-plot", "--eval-every", "0",
            "--lora-r", "2"]
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
    with pytest.raises(ValueError, match="demo"):
        train_cli.main(["demo", "--model", "gpt2", "--output-dir", str(tmp_path)])
    with pytest.raises(ValueError, match="train"):
        train_cli.main(["bench"])


def test_summary_numbers():
    recs = [{"phase": "sft", "train/avg_total_reward": 0.0}] + [
        {"phase": "rl", "train/avg_total_reward": float(i)} for i in range(25)
    ]
    s = train_cli.summarize(recs)
    assert s["first10_mean"] == 4.5 and s["last10_mean"] == 19.5 and s["gain"] == 15.0
