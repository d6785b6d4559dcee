"""`ludic-fast train --parallel {ddp,fsdp2}` as torchrun runs it (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in
the environment, `env://`), on 2 gloo ranks forked from this process (the CLI's own imports are inherited, so a
launch costs no interpreter start-up): for RL, SFT, dpo, reward and distill (off- and on-policy), the
parameters after a few steps (the run's Hugging Face export) equal a one-process run on the same global batches;
a run checkpointed on two ranks resumes on one (and the reverse) to the uninterrupted run's parameters; SIGINT to
one rank stops both after the same step with a checkpoint, exit 130."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from _ranks import assert_same_params, fork_ranks
from safetensors.torch import load_file

from ludic_fast.cli import main as cli_main
from ludic_fast.run.loggers import read_jsonl

pytestmark = pytest.mark.timeout(300)  # 2-3 launches of 1-2 ranks each; a busy 2-core machine
LR = 3e-3
TINY = ["--model", "embedded", "--seed", "3", "--logger", "none", "--no-plot", "--lr", str(LR), "--threads", "1"]
RL = [*TINY, "--preset", "grpo", "--sft-steps", "0", "--rl-steps", "2", "--prompts-per-batch", "4",
      "--group-size", "2", "--max-new-tokens", "3", "--eval-every", "0", "--temperature", "1.0"]
SFT = [*TINY, "--sft-steps", "2", "--sft-batch-size", "8", "--rl-steps", "0", "--eval-every", "0"]
OFFLINE = [*TINY, "--offline-steps", "2", "--pref-batch-size", "4"]
DISTILL = [*OFFLINE, "--preset", "distill", "--teacher-steps", "2", "--max-new-tokens", "3"]


def launch(argv: list[str], world: int, *, parallel: str | None = "ddp", on_start=None) -> list[int]:
    """Run `ludic-fast train argv` on `world` forked ranks with torchrun's variables (`parallel=None`: one plain
    process, no torchrun variables); returns the exit codes in rank order."""
    args = [*argv, "--parallel", parallel] if parallel else argv
    return fork_ranks(lambda: cli_main(["train", *args]), world, torchrun=parallel is not None, on_start=on_start)


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model" / "model.safetensors"))


def assert_same_weights(a: Path, b: Path, steps: int = 2) -> None:
    """The two runs' exported parameters agree to fp32 summation order (`_ranks.assert_same_params`). Scale errors,
    which AdamW does not see, are caught by the logged grad norms (`assert_same_grad_norms`)."""
    assert_same_params(weights(a), weights(b), lr=LR, steps=steps)


def grad_norms(out: Path) -> list[float]:
    return [r["train/grad_norm"] for r in read_jsonl(out / "metrics.jsonl") if "train/grad_norm" in r]


def assert_same_grad_norms(a: Path, b: Path) -> None:
    ga, gb = grad_norms(a), grad_norms(b)
    assert len(ga) == len(gb) >= 2
    assert gb == pytest.approx(ga, rel=1e-4)


@pytest.mark.parametrize("name, argv, mode", [
    ("dpo", [*OFFLINE, "--preset", "dpo"], "ddp"),
    ("reward", [*OFFLINE, "--preset", "reward"], "ddp"),
    ("distill", DISTILL, "fsdp2"),
    ("distill_on_policy", [*DISTILL, "--on-policy-fraction", "0.5"], "ddp"),
])
def test_offline_presets_on_two_ranks_equal_one_process(tmp_path, name, argv, mode):
    assert launch([*argv, "--output-dir", str(tmp_path / "one")], 1, parallel=None) == [0]
    assert launch([*argv, "--output-dir", str(tmp_path / "two")], 2, parallel=mode) == [0, 0]
    assert_same_weights(tmp_path / "one", tmp_path / "two")
    assert_same_grad_norms(tmp_path / "one", tmp_path / "two")
    assert not (tmp_path / "one" / "model").joinpath("value_head.safetensors").exists() or name == "reward"
    if name == "reward":
        one, two = (load_file(str(tmp_path / d / "model" / "value_head.safetensors")) for d in ("one", "two"))
        torch.testing.assert_close(two["weight"], one["weight"], rtol=0, atol=0.1 * LR * 2)


@pytest.mark.parametrize("name, argv, mode", [("rl", RL, "fsdp2"), ("sft", SFT, "ddp")])
def test_rl_and_sft_on_two_ranks_equal_one_rank(tmp_path, name, argv, mode):
    """RL: each rank samples its groups (each under its own seed; under FSDP2 from the gathered parameters) and
    trains them; SFT: each rank its share."""
    assert launch([*argv, "--output-dir", str(tmp_path / "one")], 1) == [0]
    assert launch([*argv, "--output-dir", str(tmp_path / "two")], 2, parallel=mode) == [0, 0]
    assert_same_weights(tmp_path / "one", tmp_path / "two")
    assert_same_grad_norms(tmp_path / "one", tmp_path / "two")


@pytest.mark.parametrize("name, argv, first, then", [
    ("dpo", [*OFFLINE, "--preset", "dpo", "--checkpoint-every", "2"], (2, "fsdp2"), (1, "ddp")),
    ("rl", [*RL, "--checkpoint-every", "2"], (1, "ddp"), (2, "ddp")),
])
def test_checkpoint_resumes_on_another_world_size(tmp_path, name, argv, first, then):
    """Steps 1-2 on `first` ranks, checkpoint, step 3 on `then` ranks == 3 uninterrupted steps."""
    steps = "--offline-steps" if name == "dpo" else "--rl-steps"
    three = [*argv, steps, "3"]
    assert launch([*three, "--output-dir", str(tmp_path / "full")], 1) == [0]
    cut = str(tmp_path / "cut")
    assert launch([*argv, steps, "2", "--output-dir", cut], first[0], parallel=first[1]) == [0] * first[0]
    assert launch([*three, "--output-dir", cut, "--resume"], then[0], parallel=then[1]) == [0] * then[0]
    assert_same_weights(tmp_path / "full", tmp_path / "cut", steps=3)
    assert grad_norms(tmp_path / "cut") == pytest.approx(grad_norms(tmp_path / "full"), rel=1e-4)


def test_sigint_to_one_rank_stops_both_at_the_same_step(tmp_path):
    out = tmp_path / "run"
    argv = [*OFFLINE, "--preset", "dpo", "--offline-steps", "500", "--checkpoint-every", "1000",
            "--output-dir", str(out)]

    def interrupt_rank_1(procs):
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not (out / "metrics.jsonl").is_file():
            time.sleep(0.2)
        os.kill(procs[1].pid, signal.SIGINT)

    assert launch(argv, 2, on_start=interrupt_rank_1) == [130, 130]
    last = read_jsonl(out / "metrics.jsonl")[-1]["step"]
    assert 1 <= last < 500
    assert sorted(p.name for p in (out / "dpo").glob("step_*")) == [f"step_{last:06d}"]
    assert (out / "model" / "model.safetensors").is_file()


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason=f"NCCL: two CUDA devices needed, this machine has {torch.cuda.device_count()}")
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_nccl_two_gpus_equal_one_gpu(tmp_path, mode):
    """The same command on CUDA: NCCL between the ranks (backend_for), each rank on cuda:LOCAL_RANK."""
    argv = [*OFFLINE, "--preset", "dpo", "--device", "cuda"]
    assert launch([*argv, "--output-dir", str(tmp_path / "one")], 1, parallel=mode) == [0]
    assert launch([*argv, "--output-dir", str(tmp_path / "two")], 2, parallel=mode) == [0, 0]
    assert_same_weights(tmp_path / "one", tmp_path / "two")
    assert_same_grad_norms(tmp_path / "one", tmp_path / "two")
