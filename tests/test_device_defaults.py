"""Device defaults never leak into CPU work. With CUDA reported present (torch.cuda.is_available() -> True and
device_count() -> 1, as under LUDIC_FAST_PRETEND_CUDA=1; on a CPU-only torch any real CUDA call then raises),
code given CPU inputs or device="cpu" stays on the CPU: the Trainer's step, checkpoint and resume (no CUDA RNG
state, no CUDA memory statistic), the OfflineTrainer's checkpoint, the train recipe's auto choices and a
benchmark run. The defaults themselves (cuda when it is available) are checked both ways, whatever this
machine has. `make test-pretend-cuda` runs the whole suite that way."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import _pretend_cuda
import pytest
import torch
from _trainer_fixtures import ListSource, make_items, tiny_model

from ludic_fast.algorithm import make_cispo
from ludic_fast.benchmark import cli as bench_cli
from ludic_fast.cli import train as train_cli
from ludic_fast.cli.recipe import apply_recipe
from ludic_fast.data.preference_data import embedded_rows, encode_rows
from ludic_fast.embedded import build_char_tokenizer, build_tiny_model
from ludic_fast.losses import DPOLoss
from ludic_fast.offline_trainer import OfflineConfig, OfflineTrainer, PreferenceObjective
from ludic_fast.run.checkpoint import CheckpointConfig, CheckpointManager, restore_rng, rng_tensors
from ludic_fast.trainer import Trainer, TrainerConfig

PRETEND_DIR = Path(__file__).resolve().parent / "pretend_cuda"


def _cuda_reported(monkeypatch, available: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: int(available))


@pytest.fixture
def pretend_cuda(monkeypatch):
    """What LUDIC_FAST_PRETEND_CUDA=1 does (torch's own bookkeeping is told the truth), undone after the test."""
    for name in ("is_available", "device_count"):
        monkeypatch.setattr(torch.cuda, name, getattr(torch.cuda, name))  # the originals, restored afterwards
    _pretend_cuda.patch(torch)


@pytest.mark.parametrize("available", [False, True])
def test_defaults_pick_cuda_exactly_when_it_is_available(monkeypatch, available):
    _cuda_reported(monkeypatch, available)
    want = "cuda" if available else "cpu"
    assert TrainerConfig(pad_token_id=0).model_device == want
    assert train_cli.build_parser("x").parse_args([]).device == want


def test_recipe_auto_choices_follow_the_explicit_device(pretend_cuda):
    args = train_cli.build_parser("x").parse_args(["--device", "cpu"])
    apply_recipe(args)
    assert (args.device, args.dtype, args.attn) == ("cpu", "fp32", "sdpa")


def test_cpu_trainer_step_checkpoint_and_resume_stay_on_cpu(pretend_cuda, tmp_path):
    def trainer(resume=None):
        cfg = TrainerConfig(
            model_device="cpu",
            pad_token_id=0,
            sync_every_steps=0,
            max_seq_len=16,
            micro_token_budget=32,
            profile_memory=True,
        )
        return Trainer(
            model=tiny_model(),
            algo=make_cispo(group_size=1),
            batch_source=ListSource([make_items(4, seed=1), make_items(4, seed=2)]),
            cfg=cfg,
            checkpoint_config=CheckpointConfig(str(tmp_path), every_n_steps=1),
            resume_from=resume,
        )

    first = trainer()
    (stats,) = first.train_sync(1)
    assert "perf/gpu_max_mem_allocated_gb" not in stats and "train/loss" in stats
    assert {p.device.type for p in first.model.parameters()} == {"cpu"}
    state = CheckpointManager(CheckpointConfig(str(tmp_path))).load(tiny_model())
    assert set(state["tensors"]) == {"rng.torch_cpu"}
    assert trainer(resume="latest").step_idx == 1


def test_cpu_offline_trainer_checkpoint_stays_on_cpu(pretend_cuda, tmp_path):
    tok = build_char_tokenizer()
    kw = dict(
        seed=0, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2
    )
    model, ref = build_tiny_model(len(tok), **kw), build_tiny_model(len(tok), **kw).requires_grad_(False)
    examples = encode_rows(embedded_rows("pairs", 4), "pairs", tok, chat_template=False)
    trainer = OfflineTrainer(
        model,
        PreferenceObjective(DPOLoss(), ref),
        examples,
        OfflineConfig(steps=1, batch_size=2, micro_batch_size=2, device="cpu"),
        checkpoint_config=CheckpointConfig(str(tmp_path), every_n_steps=1),
    )
    trainer.train()
    state = CheckpointManager(CheckpointConfig(str(tmp_path))).load(model)
    assert {k for k in state["tensors"] if k.startswith("rng.")} == {"rng.torch_cpu"}


def test_rng_state_of_a_cpu_device_is_the_cpu_generator_only(pretend_cuda):
    assert set(rng_tensors("cpu")) == {"rng.torch_cpu"}
    saved = torch.get_rng_state()
    torch.rand(3)
    restore_rng({"rng.torch_cpu": saved, "rng.torch_cuda": torch.zeros(16, dtype=torch.uint8)}, "cpu")
    assert torch.equal(torch.get_rng_state(), saved)


def test_cpu_benchmark_run_stays_on_cpu(pretend_cuda, tmp_path):
    rc = bench_cli.main(
        [
            "--device",
            "cpu",
            "--workloads",
            "sft",
            "--impls",
            "ours-generic",
            "--shapes",
            "48x16x257",
            "--one-process",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--threads",
            "1",
            "--check-tokens",
            "16",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    (result,), _ = bench_cli.load_results(tmp_path / "results.json")
    assert result.status == "ok", result.reason


@pytest.mark.skipif(torch.version.cuda is not None, reason="pretend-CUDA mode is for a CPU-only torch build")
def test_pretend_mode_reaches_child_processes_and_respects_hidden_devices():
    """The switch reaches a child Python through tests/pretend_cuda/sitecustomize.py, also when a library
    probes for torch (importlib.util.find_spec) before importing it, and dynamo's bookkeeping is told the truth
    (no CUDA); CUDA_VISIBLE_DEVICES="" hides the device (the mode is then off: nothing patched, dynamo not asked).
    The two children run at once."""
    probe = "import importlib.util; importlib.util.find_spec('torch'); import torch"
    count = "print(torch.cuda.is_available(), torch.cuda.device_count())"
    dynamo = "import torch._dynamo.device_interface as di; print(di.CudaInterface.is_available())"
    env = {**os.environ, "LUDIC_FAST_PRETEND_CUDA": "1", "PYTHONPATH": str(PRETEND_DIR)}

    def child(script: str, **extra: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", script], env={**env, **extra}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def output(proc: subprocess.Popen) -> list[str]:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        return out.split()

    pretending = child(f"{probe}; {count}; {dynamo}")
    hidden = child(f"{probe}; {count}", CUDA_VISIBLE_DEVICES="")
    try:
        assert output(pretending) == ["True", "1", "False"]
        assert output(hidden) == ["False", "0"]
    finally:
        for proc in (pretending, hidden):
            proc.kill()
            proc.wait()


def test_kernel_launches_enter_the_inputs_device():
    """Triton launches on the current CUDA device, so every launcher enters its tensors' device: cuda:1 inputs
    get the cuda:1 context (built without touching CUDA), CPU inputs (the interpreter) none."""
    import contextlib
    from types import SimpleNamespace

    from ludic_fast.kernels._device import on_device_of

    guard = on_device_of(SimpleNamespace(device=torch.device("cuda", 1)))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    assert isinstance(on_device_of(torch.zeros(1)), contextlib.nullcontext)
