"""OfflineTrainer checkpoints: kill -9 in the middle of a checkpoint write, then resume, equals an uninterrupted
run (separate processes, CPU, deterministic); in-process resume of the reward and on-policy distillation
objectives (their own state: value head, sampler RNG) equals an uninterrupted run; a non-finite loss skips the
step with weights and optimizer state untouched."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from _kill_resume import kill_mid_write_then_resume

from ludic_fast.data.preference_data import embedded_rows, encode_rows
from ludic_fast.embedded import build_char_tokenizer, build_tiny_model
from ludic_fast.losses import SimPOLoss
from ludic_fast.offline_trainer import (
    DistillObjective,
    OfflineConfig,
    OfflineTrainer,
    PreferenceObjective,
    RewardObjective,
)
from ludic_fast.run.checkpoint import CheckpointConfig

CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    torch.set_num_threads(1)
    from _kill_resume import stall_checkpoint_write
    from ludic_fast.run.checkpoint import CheckpointConfig
    from ludic_fast.embedded import build_char_tokenizer, build_tiny_model
    from ludic_fast.offline_trainer import OfflineConfig, OfflineTrainer, PreferenceObjective
    from ludic_fast.losses import DPOLoss
    from ludic_fast.data.preference_data import embedded_rows, encode_rows

    out, mode, steps, crash_step = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    tok = build_char_tokenizer()
    kw = dict(seed=0, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=2)
    model, ref = build_tiny_model(len(tok), **kw), build_tiny_model(len(tok), **kw).requires_grad_(False)
    examples = encode_rows(embedded_rows("pairs", 10), "pairs", tok, chat_template=False)
    cfg = OfflineConfig(steps=steps, batch_size=4, micro_batch_size=2, lr=3e-3)  # the order spans steps
    if mode == "crash":
        stall_checkpoint_write(crash_step)

    class Log:
        def log(self, step, rec):
            print("STEP " + json.dumps({"step": step, "loss": rec["train/loss"],
                                        "margin": rec["train/rewards_margin"]}), flush=True)

    trainer = OfflineTrainer(model, PreferenceObjective(DPOLoss(), ref), examples, cfg, Log(),
                             checkpoint_config=CheckpointConfig(out, every_n_steps=1, max_to_keep=2),
                             resume_from="latest" if mode == "resume" else None)
    start = trainer.step_idx
    trainer.train()
    weights = sum(float(p.double().sum()) for p in model.parameters())
    print("FINAL " + json.dumps({"start": start, "weights": weights}), flush=True)
    """
)


def test_kill_during_checkpoint_write_then_resume(tmp_path):
    full_steps, full_final, resumed_steps, resumed_final = kill_mid_write_then_resume(tmp_path, CHILD, 5, 3)
    for s in (3, 4, 5):
        assert resumed_steps[s] == full_steps[s]
    assert resumed_final["weights"] == full_final["weights"]


def _tiny(tok, seed=0, hidden=32):
    return build_tiny_model(len(tok), seed=seed, hidden_size=hidden, intermediate_size=2 * hidden,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)


def _objective(kind: str, tok):
    if kind == "reward":
        torch.manual_seed(3)
        return RewardObjective(torch.nn.Linear(32, 1)), encode_rows(embedded_rows("pairs", 6), "pairs", tok,
                                                                      chat_template=False)
    teacher = _tiny(tok, seed=1, hidden=48).requires_grad_(False)
    examples = encode_rows(embedded_rows("completions", 6), "completions", tok, chat_template=False)
    return DistillObjective(teacher, kind="jsd", on_policy_fraction=0.5, max_new_tokens=2,
                            eos_token_id=tok.eos_token_id), examples


@pytest.mark.parametrize("kind", ["reward", "distill"])
def test_resume_restores_objective_state(tmp_path, kind):
    tok = build_char_tokenizer()
    cfg = OfflineConfig(steps=4, batch_size=4, micro_batch_size=4, lr=3e-3)

    def run(resume: bool, ckpt_dir):
        torch.manual_seed(0)
        model = _tiny(tok)
        objective, examples = _objective(kind, tok)
        trainer = OfflineTrainer(model, objective, examples, cfg,
                                 checkpoint_config=CheckpointConfig(str(ckpt_dir), every_n_steps=2),
                                 resume_from=2 if resume else None)
        return trainer.train(), model, objective

    full, full_model, full_obj = run(False, tmp_path / "a")
    resumed, model, obj = run(True, tmp_path / "a")  # from step 2 of the run above
    assert len(resumed) == 2
    assert [r["train/loss"] for r in resumed] == [r["train/loss"] for r in full[2:]]
    for p, q in zip(list(full_model.parameters()) + full_obj.parameters(),
                    list(model.parameters()) + obj.parameters(), strict=True):
        assert torch.equal(p, q)


def test_resume_needs_a_checkpoint_config():
    tok = build_char_tokenizer()
    examples = encode_rows(embedded_rows("pairs", 2), "pairs", tok, chat_template=False)
    with pytest.raises(ValueError, match="resume_from"):
        OfflineTrainer(_tiny(tok), PreferenceObjective(SimPOLoss()), examples, OfflineConfig(), resume_from="latest")


class _NaNAt(PreferenceObjective):
    """A SimPO objective whose loss is NaN at the given (1-based) steps."""

    def __init__(self, bad_steps: tuple[int, ...]):
        super().__init__(SimPOLoss())
        self.bad_steps, self.calls = bad_steps, 0

    def loss(self, engine, batch):
        self.calls += 1
        loss, stats = super().loss(engine, batch)
        return (loss * float("nan") if self.calls in self.bad_steps else loss), stats


def test_non_finite_loss_skips_the_step():
    tok = build_char_tokenizer()
    model = _tiny(tok)
    examples = encode_rows(embedded_rows("pairs", 4), "pairs", tok, chat_template=False)
    trainer = OfflineTrainer(model, _NaNAt((2,)), examples,
                             OfflineConfig(steps=3, batch_size=4, micro_batch_size=4, lr=1e-2))
    first = trainer.step()
    weights = [p.detach().clone() for p in model.parameters()]
    moments = {k: {n: v.clone() for n, v in s.items()} for k, s in trainer.optimizer.state.items()}
    skipped = trainer.step()
    assert first["train/step_skipped"] == 0.0 and skipped["train/step_skipped"] == 1.0
    assert trainer.skipped_steps == 1 and trainer.step_idx == 2
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
    for k, s in trainer.optimizer.state.items():
        assert all(torch.equal(v, moments[k][n]) for n, v in s.items())
    assert all(p.grad is None for p in model.parameters())  # the NaN gradient is not carried over
    third = trainer.step()
    assert third["train/step_skipped"] == 0.0
    assert any(not torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))


def test_cli_resume_continues_the_run(tmp_path, capsys):
    from ludic_fast.cli.train import main

    out = tmp_path / "run"
    base = ["train", "--preset", "simpo", "--pref-batch-size", "4", "--logger", "none", "--no-plot", "--device", "cpu",
            "--output-dir", str(out), "--checkpoint-every", "2"]
    assert main([*base, "--offline-steps", "3"]) == 0
    assert (out / "simpo" / "step_000002" / "model.safetensors").is_file()
    assert main([*base, "--offline-steps", "5", "--resume"]) == 0
    assert "resumed at step 2" in capsys.readouterr().out
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]  # step 3 of the first run is dropped and trained again
    assert json.loads((out / "summary.json").read_text())["skipped_steps"] == 0
