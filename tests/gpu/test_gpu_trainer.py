"""The Trainer's step on the test's device (fused head, backend auto: triton on CUDA) against the reference
CISPO loss on the same model's full logits on the same device; and, on CUDA, `ludic-fast demo` and a
checkpoint resume (tests/test_cli.py runs both on the CPU)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from _gpu import DEVICES, on
from _trainer_fixtures import ListSource, make_items, tiny_model

from ludic_fast import cli, reference
from ludic_fast.algorithm import make_cispo
from ludic_fast.cli import train as train_cli
from ludic_fast.data.batching import collate_saw_items
from ludic_fast.data.types import SAWBatch
from ludic_fast.run.loggers import read_jsonl
from ludic_fast.trainer import Trainer, TrainerConfig

# gradient tolerance: relative 1e-4 (as tests/test_trainer.py); absolute 1e-6 on the CPU, 1e-5 on CUDA
# (the chunked head's GEMMs and the full-logits GEMM sum in different orders there)
ATOL = {"cpu": 1e-6, "cuda": 1e-5}


def _trainer(items, device: str) -> Trainer:
    cfg = TrainerConfig(model_device=device, pad_token_id=0, sync_every_steps=0, max_seq_len=10,
                        micro_token_budget=20, lr=1e-2)
    return Trainer(model=tiny_model(), algo=make_cispo(group_size=1), batch_source=ListSource([items]), cfg=cfg)


@pytest.mark.parametrize("device", DEVICES)
def test_step_gradient_equals_reference_loss_on_logits(device):
    items = make_items(7, seed=1)
    trainer = _trainer(items, device)
    ref_model = copy.deepcopy(trainer.model)
    _, _, sizes, _ = trainer.accumulate_gradients(SAWBatch(items=list(items)))
    assert len(sizes) > 2  # several micro-batches
    batch = {k: v.to(device) for k, v in collate_saw_items(items, pad_token_id=0).items()}
    logits = ref_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    loss, _ = reference.CISPOLoss()(batch, logits=logits)
    loss.backward()
    got = dict(trainer.model.named_parameters())
    for name, p in ref_model.named_parameters():
        assert got[name].device.type == device
        torch.testing.assert_close(got[name].grad, p.grad, rtol=1e-4, atol=ATOL[device], msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_train_step_updates_the_model_on_its_device(device):
    trainer = _trainer(make_items(6, seed=2), device)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    stats = trainer.train_step_sync()
    assert torch.isfinite(torch.tensor(stats["train/loss"])) and stats["train/grad_norm"] > 0
    for name, p in trainer.model.named_parameters():
        assert p.device.type == device
        assert not torch.equal(p.detach(), before[name]), name


FAST = ["--sft-steps", "2", "--rl-steps", "3", "--prompts-per-batch", "4", "--group-size", "4", "--eval-every", "2",
        "--logger", "none", "--threads", "1"]


@pytest.mark.parametrize("device", [on("cuda", id="cuda")])
def test_demo_on_cuda(device, tmp_path):
    assert cli.main(["demo", *FAST, "--device", device, "--output-dir", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary["reward_curve"]) == 3 and summary["rl_steps"] == 3
    rl = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["phase"] == "rl" and "train/loss" in r]
    assert [r["step"] for r in rl] == [1, 2, 3]


@pytest.mark.parametrize("device", [on("cuda", id="cuda")])
def test_checkpoint_resume_on_cuda(device, tmp_path):
    args = ["train", *FAST, "--device", device, "--output-dir", str(tmp_path), "--checkpoint-every", "1",
            "--no-plot", "--eval-every", "0"]
    assert train_cli.main(args) == 0
    assert (tmp_path / "rl" / "latest.json").is_file()
    args[args.index("--rl-steps") + 1] = "5"
    assert train_cli.main([*args, "--resume"]) == 0
    rl = [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if r["phase"] == "rl" and "train/loss" in r]
    assert rl == [1, 2, 3, 4, 5]  # RL went on from step 3 on the GPU
