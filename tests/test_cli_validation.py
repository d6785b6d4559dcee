"""`ludic-fast train|demo` input errors: one line on stderr naming the flag or file:line, exit status 2, before
anything is built or trained; the learning-signal warnings; one prompt format for SFT, rollouts and eval."""

from __future__ import annotations

import os
import subprocess
import sys

import _forked as forked
import pytest
import torch

from ludic_fast.cli import main as cli_main
from ludic_fast.cli import train as train_cli
from ludic_fast.cli.validation import UsageError, check_pretrained
from ludic_fast.run.warnings import LearningSignalMonitor


def run_cli(*argv: str, cwd, fresh: bool) -> subprocess.CompletedProcess:
    """`ludic-fast argv` run in `cwd` in its own process: a fresh interpreter (offline, so that huggingface_hub
    reads HF_HUB_OFFLINE as it loads; what the imports print counts too), or forked from this one (tests/_forked.py:
    no interpreter start-up)."""
    if fresh:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        code = "import sys; from ludic_fast.cli import main; sys.exit(main(sys.argv[1:]))"
        return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, cwd=cwd,
                              timeout=120)

    def main() -> int:
        os.chdir(cwd)
        return cli_main(list(argv))

    return forked.run(main, timeout=120)


def one_line_error(capsys, argv: list[str]) -> str:
    try:
        assert train_cli.main(argv) == 2
    except SystemExit as exc:  # argparse's own errors (bad choice, bad type) exit from parse_args
        assert exc.code == 2
    captured = capsys.readouterr()
    assert captured.out == "", "nothing may run before the inputs are checked"
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ludic-fast {argv[0]}: error: "), captured.err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "message", "fresh"),
    [
        (["--task", "nope.jsonl"], "--task nope.jsonl: no such file", False),
        (["--lr", "-1e-5"], "--lr must be > 0, got -1e-05", False),
        (["--model", "no-such-org/no-such-model-7"], "--model no-such-org/no-such-model-7: not in the local Hugging",
         True),
    ],
)
def test_subprocess_errors_exit_2_with_one_line(tmp_path, argv, message, fresh):
    proc = run_cli("train", *argv, "--output-dir", str(tmp_path / "run"), cwd=tmp_path, fresh=fresh)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and proc.stderr.count("\n") == 1 and message in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--sft-lr", "0"], "--sft-lr must be > 0, got 0.0"),
        (["--lr", "nan"], "--lr must be > 0, got nan"),
        (["--group-size", "0"], "--group-size must be >= 1, got 0"),
        (["--rl-steps", "-3"], "--rl-steps must be >= 0, got -3"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--eval-holdout", "1.5"], "--eval-holdout must be in (0, 1)"),
        (["--device", "gpu0"], "--device 'gpu0' is not a torch device"),
        (["--reward", "fuzzy"], "--reward: reward must be one of"),
        (["--resume"], "--resume needs --output-dir"),
        (["--preset", "sft"], "argument --preset: invalid choice: 'sft'"),
        (["--max-seq-len", "200", "--micro-token-budget", "100"],
         "--micro-token-budget (100) must be > 0 and >= --max-seq-len (200)"),
        (["--group-size", "two"], "argument --group-size: invalid int value: 'two'"),
        (["--preset", "distill", "--distill-temperature", "0"], "--distill-temperature must be > 0, got 0.0"),
        (["--preset", "distill", "--teacher-steps", "-1"], "--teacher-steps must be >= 0, got -1"),
        (["--preset", "dpo", "--offline-steps", "0"], "--offline-steps"),
        (["--preset", "dpo", "--beta", "-0.1"], "--beta must be > 0"),
        (["--preset", "distill", "--hard-weight", "1.5"], "--hard-weight"),
        (["--preset", "dpo", "--pref-data", "nope.jsonl"], "--pref-data nope.jsonl: no such file"),
        (["--preset", "distill", "--teacher", "./no-such-teacher"], "--teacher ./no-such-teacher: no such model"),
    ],
)
def test_bad_flags(capsys, flags, message):
    assert message in one_line_error(capsys, ["train", *flags])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_device_cuda_without_cuda(capsys):
    assert "--device cuda: CUDA is not available on this machine; use --device cpu" in one_line_error(
        capsys, ["train", "--device", "cuda"]
    )


def test_missing_optional_packages_name_the_extra(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("vllm", "peft") else real(name))
    line = one_line_error(capsys, ["train", "--engine", "vllm", "--model", "embedded"])
    assert "--sampler vllm needs the optional package vllm: pip install 'ludic-fast[vllm]'" in line
    assert "--vllm-arg needs --sampler vllm" in one_line_error(capsys, ["train", "--vllm-arg", "max_num_seqs=8"])
    line = one_line_error(capsys, ["train", "--engine", "vllm", "--vllm-url", "http://127.0.0.1:8000"])
    assert "--vllm-url needs --sampler vllm-server" in line
    line = one_line_error(capsys, ["train", "--engine", "vllm-server"])
    assert "--sampler vllm-server needs the optional package vllm" in line
    assert "expected KEY=VALUE" in one_line_error(capsys, ["train", "--engine", "vllm", "--vllm-arg", "8"])
    assert "pip install 'ludic-fast[lora]'" in one_line_error(capsys, ["train", "--lora-r", "4"])
    monkeypatch.setattr("ludic_fast.cli.validation.check_pretrained", lambda *a, **k: None)  # no Hub lookup
    line = one_line_error(capsys, ["train", "--engine", "vllm", "--model", "some/model"])
    assert "--sampler vllm needs the optional package vllm: pip install 'ludic-fast[vllm]'" in line


def test_demo_rejects_model_and_task(capsys):
    assert "demo runs the embedded default" in one_line_error(capsys, ["demo", "--task", "t.jsonl"])


def test_task_file_errors_name_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "2+2=", "answer": 4\n')
    assert f"{bad}:3: not a JSON object" in one_line_error(capsys, ["train", "--task", str(bad)])
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"prompt": "1+1="}\n')
    assert f"{missing}:1: missing 'prompt' or 'answer'" in one_line_error(capsys, ["train", "--task", str(missing)])
    alpha = tmp_path / "alpha.jsonl"
    # printable ASCII passes (capitals, punctuation: row 1); anything else is named (row 2)
    alpha.write_text('{"prompt": "What is 2+2?", "answer": "4"}\n{"prompt": "café=", "answer": "4"}\n')
    line = one_line_error(capsys, ["train", "--task", str(alpha)])
    assert f"{alpha}:2: prompt 'café=': character 'é' is not in the embedded tokenizer's alphabet" in line
    one = tmp_path / "one.jsonl"
    one.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    assert "too few to hold out an eval set; pass --eval-task FILE or --eval-on-train" in one_line_error(
        capsys, ["train", "--task", str(one)]
    )
    ok = tmp_path / "ok.jsonl"
    ok.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    assert "exclude each other" in one_line_error(
        capsys, ["train", "--task", str(one), "--eval-task", str(ok), "--eval-on-train"]
    )


def test_model_directory_without_a_tokenizer(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    line = one_line_error(capsys, ["train", "--model", str(tmp_path)])
    assert f"--tokenizer/--model: cannot load a tokenizer from {tmp_path}: " in line


def test_check_pretrained_local_directory(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    check_pretrained(str(tmp_path), "--model")  # a saved model: accepted without the Hub
    with pytest.raises(UsageError, match="directory without config.json"):
        check_pretrained(str(tmp_path.parent), "--model")
    with pytest.raises(UsageError, match="no such model directory"):
        check_pretrained(str(tmp_path / "absent"), "--model")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UsageError, match="offline mode is on"):
        check_pretrained("no-such-org/no-such-model-7", "--model")


def test_jsonl_task_holds_out_eval_rows(tmp_path):
    task = tmp_path / "t.jsonl"
    task.write_text("".join(f'{{"prompt": "{i}+0=", "answer": "{i}"}}\n' for i in range(10)))
    args = train_cli.build_parser("x").parse_args(["--task", str(task)])
    built = train_cli.build_task(args)
    assert len(built.samples) == 9 and len(built.eval_samples) == 1
    assert not {s["prompt"] for s in built.samples} & {s["prompt"] for s in built.eval_samples}
    assert "1 rows held out of the task (--eval-holdout)" in train_cli.describe_eval(args, built)
    on_train = train_cli.build_task(train_cli.build_parser("x").parse_args(["--task", str(task), "--eval-on-train"]))
    assert len(on_train.samples) == 10 and on_train.eval_samples == on_train.samples


# ------------------------------------------------------------------------------------------- warnings
def test_monitor_warns_once_per_kind():
    said = []
    mon = LearningSignalMonitor(said.append)
    tied = {"train/zero_variance_group_frac": 1.0, "train/avg_total_reward": 0.0, "train/grad_norm": 0.0}
    mon.log(1, tied)
    mon.log(2, tied)
    assert len(said) == 2 and "every group's rewards tie (mean reward 0)" in said[0] and "exactly 0" in said[1]
    mon.log(3, {"train/num_samples": 0})
    assert "every rollout was filtered out" in said[2]
    mon.log(4, {"train/zero_variance_group_frac": 0.5, "train/grad_norm": 1.0, "train/num_samples": 8})
    assert len(said) == 3  # a step with signal warns about nothing
    LearningSignalMonitor(said.append).log(1, {"train/zero_weight_frac": 1.0, "train/zero_variance_group_frac": 0.0})
    assert "advantage 0" in said[3]


def test_group_size_one_warns_before_training_and_on_the_first_step(tmp_path, capsys):
    argv = ["train", "--sft-steps", "0", "--rl-steps", "2", "--prompts-per-batch", "2", "--group-size", "1",
            "--eval-every", "0", "--logger", "print", "--threads", "1", "--no-plot", "--output-dir", str(tmp_path),
            "--device", "cpu"]
    assert train_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("WARNING: --group-size 1 with cispo: a group of one has advantage 0") == 1
    assert out.count("WARNING: step 1: every group's rewards tie") == 1  # said once, not on step 2 again
    assert out.count("WARNING: step 1: the gradient is exactly 0") == 1


# ------------------------------------------------------------------------------------------- prompt format
def _templated_tokenizer(tmp_path):
    from ludic_fast.embedded import build_char_tokenizer

    tok = build_char_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}u: {{ m['content'] }}{% else %}a: {{ m['content'] }}"
        "<eos>{% endif %}{% endfor %}{% if add_generation_prompt %}a: {% endif %}"
    )
    tok.save_pretrained(tmp_path / "tok")
    return tok, str(tmp_path / "tok")


@pytest.mark.parametrize("chat", [True, False])
def test_sft_rollouts_and_eval_share_the_prompt_format(tmp_path, monkeypatch, chat):
    """A tokenizer with a chat template ('u: ... a: '): the SFT items' prompts are the rollout and eval prompts."""
    from ludic_fast.rollout import HFGenerateEngine, OfflineBatchSource

    tok, path = _templated_tokenizer(tmp_path)
    sft_prompts, gen_prompts = [], []
    real_init, real_generate = OfflineBatchSource.__init__, HFGenerateEngine.generate

    def record_items(self, items, **kw):
        sft_prompts.extend(tuple(it.input_ids[: it.meta["prompt_length"]]) for it in items)
        real_init(self, items, **kw)

    def record_generate(self, prompts, sampling, **kw):
        gen_prompts.extend(tuple(p) for p in prompts)
        return real_generate(self, prompts, sampling, **kw)

    monkeypatch.setattr(OfflineBatchSource, "__init__", record_items)
    monkeypatch.setattr(HFGenerateEngine, "generate", record_generate)
    argv = ["train", "--tokenizer", path, "--sft-steps", "1", "--rl-steps", "1", "--prompts-per-batch", "2",
            "--group-size", "2", "--eval-every", "1", "--logger", "none", "--threads", "1", "--no-plot",
            "--device", "cpu", "--output-dir", str(tmp_path / "run"),
            "--chat-template" if chat else "--no-chat-template"]
    assert train_cli.main(argv) == 0
    assert gen_prompts and sft_prompts and set(gen_prompts) <= set(sft_prompts)
    decoded = tok.decode(list(gen_prompts[0]))
    assert decoded.startswith("u: ") == chat and decoded.endswith("a: ") == chat


def test_trainer_counts_and_reports_batches_emptied_by_filters(caplog):
    """A batch whose samples are all filtered out is skipped, reported on stderr and counted in the step's stats."""
    import logging

    sys.path.insert(0, os.path.dirname(__file__))
    from _trainer_fixtures import TOKENIZER, ListSource, make_items, tiny_model

    from ludic_fast.algorithm import make_cispo
    from ludic_fast.run.loggers import TeeLogger
    from ludic_fast.trainer import Trainer, TrainerConfig

    seen, said = [], []

    class Rec:
        def log(self, step, stats):
            seen.append(dict(stats))

    cfg = TrainerConfig(model_device="cpu", pad_token_id=TOKENIZER, max_seq_len=16, micro_token_budget=64,
                        sync_every_steps=0)
    trainer = Trainer(model=tiny_model(), algo=make_cispo(group_size=1), batch_source=ListSource([[], make_items(3)]),
                      cfg=cfg, train_logger=TeeLogger(Rec(), LearningSignalMonitor(said.append)))
    with caplog.at_level(logging.WARNING, logger="ludic_fast.trainer"):
        trainer.train_sync(1)
    assert "1 batch(es) in a row had every sample filtered out" in caplog.text
    assert seen[0]["train/empty_batches"] == 1.0
    assert said == ["step 1: 1 batch(es) skipped because every sample was filtered out (--max-lag or the preset's "
                    "filters)"]
