"""The one engine under every offline preset: each preset runs through `ludic-fast train` under the trainer
flags (LoRA, warm-up + cosine, gradient checkpointing, fp16 / bf16, packed layout, token budget, memory
budget, checkpoints); LoRA trains only the adapters; the token-budget split leaves the step's loss and
gradient unchanged; a flag a preset cannot use is refused."""

from __future__ import annotations

import json

import pytest
import torch

from ludic_fast.cli.offline import OFFLINE_PRESETS
from ludic_fast.cli.train import main
from ludic_fast.data.preference_data import embedded_rows, encode_rows
from ludic_fast.embedded import build_char_tokenizer, build_tiny_model
from ludic_fast.losses import DPOLoss
from ludic_fast.objectives.distill import DistillObjective
from ludic_fast.objectives.preference import PreferenceObjective
from ludic_fast.objectives.reward import RewardObjective
from ludic_fast.trainer import Trainer, TrainerConfig

TOK = build_char_tokenizer()
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("preset", OFFLINE_PRESETS)
def test_every_offline_preset_under_the_trainer_flags(tmp_path, preset, dtype):
    """4 steps at lr 0.004 with 2 warm-up steps then cosine: the rates 0.002, 0.004, 0.004, 0.002 (the k-th
    step taken uses lr_lambda(k)); LoRA saves the adapter alone; checkpoints at steps 2 and 4; finite losses."""
    extra = ["--teacher-steps", "2"] if preset == "distill" else []
    args = ["train", "--preset", preset, "--offline-steps", "4", "--pref-batch-size", "4", "--logger", "none",
            "--no-plot", "--device", "cpu", "--output-dir", str(tmp_path), "--lr", "0.004", "--lr-scheduler",
            "cosine", "--warmup-steps", "2", "--lora-r", "2", "--gradient-checkpointing", "--dtype", dtype,
            "--layout", "packed" if dtype == "fp16" else "padded", "--micro-token-budget", "128",
            "--memory-budget", "64MiB", "--checkpoint-every", "2", *extra]
    assert main(args) == 0
    records = _records(tmp_path)
    # the schedule moves on after each step taken (an fp16 step the loss scale skipped keeps its rate)
    taken = [sum(r["train/step_skipped"] == 0.0 for r in records[:i]) for i in range(len(records))]
    assert [r["train/lr"] for r in records] == pytest.approx([0.004 * [0.5, 1, 1, 0.5][k] for k in taken])
    assert dtype == "fp16" or taken == [0, 1, 2, 3]
    assert all(torch.isfinite(torch.tensor(r["train/loss"])) for r in records)
    saved = tmp_path / "model"
    assert (saved / "adapter_model.safetensors").is_file() and not (saved / "model.safetensors").exists()
    assert json.loads((tmp_path / preset / "latest.json").read_text())["step"] == 4


def _objective(preset: str):
    examples = encode_rows(embedded_rows("completions" if preset == "distill" else "pairs", 8),
                           "completions" if preset == "distill" else "pairs", TOK, chat_template=False)
    other = build_tiny_model(len(TOK), seed=1, **SMALL).requires_grad_(False)
    torch.manual_seed(0)
    objective = {"dpo": lambda: PreferenceObjective(DPOLoss(), other),
                 "reward": lambda: RewardObjective(torch.nn.Linear(32, 1)),
                 "distill": lambda: DistillObjective(other)}[preset]()
    return objective.use_examples(examples, batch_size=8)


def _cfg(**kw) -> TrainerConfig:
    return TrainerConfig(**{**dict(model_device="cpu", pad_token_id=TOK.pad_token_id, lr=1e-2, max_seq_len=32,
                                   micro_token_budget=1024, sync_every_steps=0), **kw})


@pytest.mark.parametrize("preset", ["dpo", "reward"])
def test_lora_trains_only_the_adapters(preset):
    from peft import LoraConfig

    model = build_tiny_model(len(TOK), seed=0, **SMALL)
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    lora = LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", lora_dropout=0.0)
    trainer = Trainer(model=model, objective=_objective(preset), cfg=_cfg(), lora_config=lora)
    adapters = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if "lora_" in k}
    for _ in range(2):
        trainer.train_step_sync()
    assert all(torch.equal(v, base[k]) for k, v in model.state_dict().items() if "lora_" not in k and k in base)
    moved = [k for k, v in trainer.model.named_parameters() if "lora_" in k and not torch.equal(v, adapters[k])]
    assert moved and {p.requires_grad for n, p in trainer.model.named_parameters() if "lora_" not in n} == {False}


@pytest.mark.parametrize("preset", ["dpo", "reward", "distill"])
def test_token_budget_split_keeps_the_step_mean(preset):
    """The step's loss and gradients with micro-batches of at most 40 tokens equal those of one micro-batch."""
    results = []
    for budget in (1024, 40):
        model = build_tiny_model(len(TOK), seed=0, **SMALL)
        trainer = Trainer(model=model, objective=_objective(preset), cfg=_cfg(micro_token_budget=budget))
        batch = trainer.objective.stream.next()
        loss, _, sizes, _ = trainer.accumulate_gradients(batch)
        results.append((loss, [p.grad.clone() for p in trainer.params if p.grad is not None], sizes))
    (loss1, g1, sizes1), (loss2, g2, sizes2) = results
    assert len(sizes1) == 1 and len(sizes2) > 1 and sum(sizes2) == sizes1[0]  # examples (distill: tokens)
    torch.testing.assert_close(loss1, loss2, rtol=1e-5, atol=1e-7)
    assert len(g1) == len(g2) > 1
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize(("preset", "flag"), [("dpo", ["--group-size", "4"]), ("dpo", ["--rl-steps", "3"]),
                                               ("reward", ["--beta", "0.2"]), ("dpo", ["--teacher-steps", "3"]),
                                               ("reward", ["--backend", "torch"]),
                                               ("kto", ["--vllm-url", "http://localhost:8000"]),
                                               ("cispo", ["--offline-steps", "3"])])
def test_a_flag_the_preset_cannot_use_is_refused(tmp_path, capsys, preset, flag):
    assert main(["train", "--preset", preset, *flag, "--output-dir", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"ludic-fast train: error: {flag[0]} does not apply to --preset {preset} " \
                  f"({'an RL' if preset == 'cispo' else 'an offline'} preset): drop it"
    assert not (tmp_path / "x").exists()



@pytest.mark.parametrize(("flags", "first_loss"), [([], 0.6931472), (["--loss-type", "hinge"], 1.0),
                                                    (["--loss-type", "sigmoid,hinge", "--loss-weights", "1,0.5"],
                                                     0.6931472 + 0.5)])
def test_dpo_loss_type_flags_reach_the_loss(tmp_path, flags, first_loss):
    """At step 1 the policy equals its reference (margin 0): sigmoid's loss is log 2, hinge's relu(1 - 0) = 1,
    and a weighted combination their weighted sum."""
    args = ["train", "--preset", "dpo", "--offline-steps", "1", "--pref-batch-size", "4", "--logger", "none",
            "--no-plot", "--device", "cpu", "--output-dir", str(tmp_path), *flags]
    assert main(args) == 0
    assert _records(tmp_path)[0]["train/loss"] == pytest.approx(first_loss, rel=1e-5)


@pytest.mark.parametrize("preset", ["dpo", "ipo", "simpo", "orpo"])
def test_entropy_stats_flag_logs_the_policy_entropy_per_side(tmp_path, preset):
    """--entropy-stats reaches the loss: the logs carry the policy's mean token entropy of each side, a number in
    (0, log V] (its value is checked against the float64 twins in tests/test_preference_variants.py)."""
    args = ["train", "--preset", preset, "--offline-steps", "1", "--pref-batch-size", "4", "--logger", "none",
            "--no-plot", "--device", "cpu", "--output-dir", str(tmp_path), "--entropy-stats"]
    assert main(args) == 0
    first = _records(tmp_path)[0]
    vocab = len(TOK)
    for side in ("chosen", "rejected"):
        assert 0.0 < first[f"train/entropy_{side}"] <= torch.log(torch.tensor(float(vocab))).item() + 1e-6


def test_entropy_stats_flag_is_refused_where_no_pair_loss_reads_it(tmp_path, capsys):
    assert main(["train", "--preset", "kto", "--entropy-stats", "--output-dir", str(tmp_path / "x")]) == 2
    assert "--entropy-stats does not apply to --preset kto" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "message"), [
    (["--loss-type", "simpo"], "--loss-type simpo: not a DPO loss type"),
    (["--loss-weights", "1,2"], "--loss-weights needs --loss-type"),
    (["--loss-type", "sigmoid,sft", "--loss-weights", "1"], "--loss-type/--loss-weights: weights needs one weight"),
])
def test_bad_dpo_loss_type_flags_are_one_line_errors(tmp_path, capsys, flags, message):
    assert main(["train", "--preset", "dpo", *flags, "--output-dir", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"ludic-fast train: error: {message}")


def _gemma2(seed: int, softcap: float):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(seed)
    cfg = Gemma2Config(vocab_size=len(TOK), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, head_dim=16, final_logit_softcapping=softcap,
                       pad_token_id=TOK.pad_token_id)
    return Gemma2ForCausalLM(cfg)


def test_softcapped_heads_distil_exactly():
    """A softcapped student and teacher (Gemma 2's final_logit_softcapping): the step's loss is the forward KL of
    the models' own (softcapped) logits over the completion tokens, computed here in float64 from full logits."""
    student, teacher = _gemma2(0, 3.0), _gemma2(1, 3.0).requires_grad_(False)
    examples = encode_rows(embedded_rows("completions", 8), "completions", TOK, chat_template=False)
    trainer = Trainer(model=student, objective=DistillObjective(teacher).use_examples(examples, batch_size=8),
                      cfg=_cfg(micro_token_budget=4096))
    batch = trainer.objective.stream.next()
    loss, _, _, _ = trainer.accumulate_gradients(batch)
    collated = trainer.objective.collate(batch, trainer)
    ids, mask = collated["input_ids"], collated["action_mask"][:, 1:].bool()
    with torch.no_grad():
        zs = student(input_ids=ids, attention_mask=collated["attention_mask"]).logits[:, :-1].double()
        zt = teacher(input_ids=ids, attention_mask=collated["attention_mask"]).logits[:, :-1].double()
    pt, lt, ls = zt.softmax(-1), zt.log_softmax(-1), zs.log_softmax(-1)
    expected = (pt * (lt - ls)).sum(-1)[mask].mean()
    assert zs.abs().max() < 3.0  # the softcap is in the models' logits
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)


def test_distillation_refuses_heads_of_different_softcaps():
    student, teacher = _gemma2(0, 3.0), _gemma2(1, 5.0).requires_grad_(False)
    examples = encode_rows(embedded_rows("completions", 4), "completions", TOK, chat_template=False)
    trainer = Trainer(model=student, objective=DistillObjective(teacher).use_examples(examples, batch_size=4),
                      cfg=_cfg())
    with pytest.raises(ValueError, match=r"one logit scale and final softcap for both heads"):
        trainer.accumulate_gradients(trainer.objective.stream.next())


@pytest.mark.parametrize(("flags", "loss_type", "beta"), [
    ([], "sigmoid", 0.1), (["--loss-type", "hinge"], "hinge", 0.1),
    (["--loss-type", "simpo", "--beta", "2"], "simpo", 2.0),
])
def test_cpo_preset_builds_the_cpo_loss_it_names(tmp_path, flags, loss_type, beta):
    """--preset cpo trains TRL's CPO (reference-free: no reference model) with the --loss-type it is given;
    one step runs and logs the NLL term beside the rewards."""
    from ludic_fast.cli.offline import _loss
    from ludic_fast.cli.train import build_parser
    from ludic_fast.losses import CPOLoss

    args = build_parser("ludic-fast train").parse_args(["--preset", "cpo", *flags])
    loss = _loss(args)
    assert type(loss) is CPOLoss and (loss.loss_type, loss.beta) == (loss_type, beta) and not loss.uses_reference
    run = ["train", "--preset", "cpo", "--offline-steps", "1", "--pref-batch-size", "4", "--logger", "none",
           "--no-plot", "--device", "cpu", "--output-dir", str(tmp_path), *flags]
    assert main(run) == 0
    first = _records(tmp_path)[0]
    assert {"train/loss", "train/nll", "train/rewards_accuracy"} <= set(first)


@pytest.mark.parametrize(("flags", "message"), [
    (["--loss-type", "robust"], "--loss-type robust: cpo takes one of sigmoid, hinge, ipo, simpo"),
    (["--loss-type", "sigmoid,hinge"], "--loss-type sigmoid,hinge: cpo takes one of"),
    (["--loss-type", "hinge", "--loss-weights", "1"], "--loss-weights does not apply to --preset cpo"),
])
def test_bad_cpo_loss_type_flags_are_one_line_errors(tmp_path, capsys, flags, message):
    assert main(["train", "--preset", "cpo", *flags, "--output-dir", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"ludic-fast train: error: {message}")
