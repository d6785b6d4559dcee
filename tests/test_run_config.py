"""A run you can read back and run again: the run directory holds config.yaml (every setting its preset reads,
resolved) and run.json (command line, settings, preset record, engine configs, versions, commit, machine);
`ludic-fast train --config FILE` re-runs it with the same metrics, flags beside it override the file, and a
key that is no flag is a one-line error naming it."""

from __future__ import annotations

import json

import pytest
import yaml

from ludic_fast.cli.train import main

RL = ["--sft-steps", "3", "--rl-steps", "3", "--prompts-per-batch", "4", "--group-size", "2", "--eval-every", "0",
      "--logger", "none", "--no-plot", "--device", "cpu"]


def _records(out):
    """metrics.jsonl without the timings (perf/*), which differ between any two runs."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def test_a_saved_rl_run_reruns_with_the_same_metrics_and_flags_override_it(tmp_path):
    first = tmp_path / "first"
    assert main(["train", *RL, "--lr", "0.002", "--output-dir", str(first)]) == 0
    saved = yaml.safe_load((first / "config.yaml").read_text())
    assert saved["lr"] == 0.002 and saved["rl_steps"] == 3 and saved["sampler"] == "hf"
    assert saved["sft_lr"] == 0.003  # the tiny profile's default, resolved
    assert "output_dir" not in saved and "offline_steps" not in saved  # not a setting of an RL preset
    record = json.loads((first / "run.json").read_text())
    assert record["command_line"][:2] == ["ludic-fast", "train"] and "--lr" in record["command_line"]
    assert record["preset"]["name"] == "cispo" and record["preset"]["kind"] == "rl"
    assert record["trainer_configs"]["rl"]["lr"] == 0.002 and record["trainer_configs"]["sft"]["lr"] == 0.003
    assert record["objective"]["name"] == "cispo" and "torch" in record["versions"]
    assert record["machine"]["cpu_count"] >= 1 and "git" in record

    again = tmp_path / "again"
    assert main(["train", "--config", str(first / "config.yaml"), "--output-dir", str(again)]) == 0
    assert _records(again) == _records(first)
    assert len([r for r in _records(first) if r["phase"] == "rl"]) == 3

    override = tmp_path / "override"
    assert main(["train", "--config", str(first / "config.yaml"), "--rl-steps", "4", "--output-dir",
                 str(override)]) == 0
    assert len([r for r in _records(override) if r["phase"] == "rl"]) == 4
    assert yaml.safe_load((override / "config.yaml").read_text())["rl_steps"] == 4


def test_a_saved_dpo_run_reruns_from_toml_with_the_same_metrics(tmp_path):
    first = tmp_path / "first"
    args = ["--preset", "dpo", "--offline-steps", "2", "--pref-batch-size", "4", "--beta", "0.2", "--loss-type",
            "sigmoid,sft", "--loss-weights", "1,0.5", "--logger", "none", "--no-plot", "--device", "cpu"]
    assert main(["train", *args, "--output-dir", str(first)]) == 0
    saved = yaml.safe_load((first / "config.yaml").read_text())
    assert saved["loss_type"] == ["sigmoid", "sft"] and saved["loss_weights"] == [1.0, 0.5]
    assert "rl_steps" not in saved
    toml = tmp_path / "run.toml"
    toml.write_text("\n".join(f"{k} = {json.dumps(v)}" for k, v in saved.items() if v is not None) + "\n")
    again = tmp_path / "again"
    assert main(["train", "--config", str(toml), "--output-dir", str(again)]) == 0
    assert _records(again) == _records(first)


@pytest.mark.parametrize(("text", "message"), [
    ("lr: 0.1\nlearning_rate: 0.1\n", "--config {path}: unknown key 'learning_rate' (not a flag of ludic-fast train)"),
    ("- 1\n", "--config {path}: expected a mapping of flag names to values, got list"),
    ("no_plot: 3\n", "--config {path}: no_plot: expected true or false, got 3"),
    ("preset: dpo\nrl_steps: 3\n", "--rl-steps does not apply to --preset dpo (an offline preset): drop it"),
])
def test_bad_config_files_are_one_line_errors(tmp_path, capsys, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert main(["train", "--config", str(path), "--output-dir", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err == f"ludic-fast train: error: {message.format(path=path)}\n"
    assert not (tmp_path / "x").exists()


def test_config_file_of_an_unknown_format_is_refused(tmp_path, capsys):
    path = tmp_path / "c.json"
    path.write_text("{}")
    assert main(["train", "--config", str(path)]) == 2
    assert "expected a .yaml, .yml or .toml file" in capsys.readouterr().err
