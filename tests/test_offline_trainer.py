"""Offline presets end to end on the embedded model (CPU, a few steps each): every preset runs through
`ludic-fast train`, writes its records, and DPO / distillation move their metric; objectives' validation."""

from __future__ import annotations

import json

import pytest
import torch

from ludic_fast.cli.train import main
from ludic_fast.data.pair_batching import collate_pairs
from ludic_fast.data.preference_data import embedded_rows, encode_rows, read_rows
from ludic_fast.embedded import build_char_tokenizer, build_tiny_model
from ludic_fast.losses import DPOLoss, SimPOLoss
from ludic_fast.offline_trainer import OfflineConfig, OfflineTrainer, PreferenceObjective, reference_logps


def _run(tmp_path, preset, *extra):
    out = tmp_path / preset
    teacher = ["--teacher-steps", "2"] if preset == "distill" else []
    rc = main(["train", "--preset", preset, "--offline-steps", "4", "--pref-batch-size", "4", "--logger", "none",
               "--no-plot", "--device", "cpu", *teacher, "--output-dir", str(out), *extra])
    assert rc == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(r["phase"] == preset for r in records)
    assert all(torch.isfinite(torch.tensor(r["train/loss"])) for r in records)
    return records, json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("preset", ["dpo", "ipo", "simpo", "orpo", "kto", "reward", "distill"])
def test_every_offline_preset_runs(tmp_path, preset):
    _run(tmp_path, preset)
    saved = tmp_path / preset / "model"
    assert (saved / "model.safetensors").is_file() and (saved / "tokenizer_config.json").is_file()
    assert (saved / "value_head.safetensors").is_file() == (preset == "reward")


def test_on_policy_distillation_runs(tmp_path):
    _run(tmp_path, "distill", "--on-policy-fraction", "1.0", "--distill-kind", "jsd", "--hard-weight", "0.3")


def test_dpo_moves_its_metric():
    tok = build_char_tokenizer()
    model = build_tiny_model(len(tok), seed=0)
    examples = encode_rows(embedded_rows("pairs", 16), "pairs", tok, chat_template=False)
    ref = build_tiny_model(len(tok), seed=0).requires_grad_(False)
    cfg = OfflineConfig(steps=25, batch_size=8, micro_batch_size=4, lr=3e-3)
    records = OfflineTrainer(model, PreferenceObjective(DPOLoss(), ref), examples, cfg).train()
    first, last = records[0], records[-1]
    assert abs(first["train/rewards_margin"]) < 1e-3  # policy == reference at the start
    assert last["train/rewards_margin"] > 0.5 and last["train/loss"] < first["train/loss"] - 0.2


def test_reference_logps_match_the_head():
    tok = build_char_tokenizer()
    model = build_tiny_model(len(tok), seed=0)
    batch = collate_pairs(encode_rows(embedded_rows("pairs", 2), "pairs", tok, chat_template=False))
    ref = reference_logps(model, batch)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    mask = batch["action_mask"][:, 1:]
    assert torch.allclose(ref[:, 1:], lp * mask, atol=1e-5)


def test_reference_logps_keep_float64():
    """A float64 reference model gives float64 log-probs (they were narrowed to float32), equal to its own
    log-softmax to float64 rounding."""
    tok = build_char_tokenizer()
    model = build_tiny_model(len(tok), seed=0).double()
    batch = collate_pairs(encode_rows(embedded_rows("pairs", 2), "pairs", tok, chat_template=False))
    ref = reference_logps(model, batch)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    assert ref.dtype == torch.float64
    assert torch.allclose(ref[:, 1:], lp * batch["action_mask"][:, 1:], atol=1e-12, rtol=0)


def test_reference_sums_are_computed_once_per_pair():
    tok = build_char_tokenizer()
    model = build_tiny_model(len(tok), seed=0)
    ref = build_tiny_model(len(tok), seed=1).requires_grad_(False)
    examples = encode_rows(embedded_rows("pairs", 4), "pairs", tok, chat_template=False)
    objective = PreferenceObjective(DPOLoss(), ref)
    engine = OfflineTrainer(model, objective, examples, OfflineConfig())
    calls = []
    ref.model.register_forward_hook(lambda *_: calls.append(1))
    first = objective.collate(examples[:3], engine)
    again = objective.collate(examples[1:], engine)  # examples 1, 2 cached: only example 3 is scored
    assert len(calls) == 2
    whole = collate_pairs(examples[1:])
    want = (reference_logps(ref, whole) * whole["action_mask"]).sum(1)
    assert torch.allclose(again["ref_seq_logps"], want, atol=1e-5)
    assert torch.equal(first["ref_seq_logps"][2:], again["ref_seq_logps"][:4])  # pairs 1 and 2, reused
    loss, _ = engine.micro_loss(again)
    assert torch.isfinite(loss)


def _objective(kind, other):
    from ludic_fast.losses import KTOLoss
    from ludic_fast.offline_trainer import DistillObjective, RewardObjective

    return {"dpo": lambda: PreferenceObjective(DPOLoss(), other),
            "kto": lambda: PreferenceObjective(KTOLoss(), other),
            "simpo": lambda: PreferenceObjective(SimPOLoss(), None),
            "reward": lambda: RewardObjective(torch.nn.Linear(128, 1)),
            "distill": lambda: DistillObjective(other, kind="jsd")}[kind]()


FORMATS = {"dpo": "pairs", "kto": "kto", "simpo": "pairs", "reward": "pairs", "distill": "completions"}


def _loss_and_grad(kind, **cfg):
    """The loss of 6 examples in one micro-batch and its gradient to the LM head, on a fresh engine."""
    tok = build_char_tokenizer()
    model = build_tiny_model(len(tok), seed=0, attn_implementation="sdpa")
    other = build_tiny_model(len(tok), seed=1, attn_implementation="sdpa").requires_grad_(False)
    examples = encode_rows(embedded_rows(FORMATS[kind], 6), FORMATS[kind], tok, chat_template=False)
    torch.manual_seed(0)  # the reward model's value head
    objective = _objective(kind, other)
    engine = OfflineTrainer(model, objective, examples, OfflineConfig(**cfg))
    loss, _ = engine.micro_loss(objective.collate(examples, engine))
    head = engine.model.lm_head.weight if kind != "reward" else objective.value_head.weight
    return loss.float(), torch.autograd.grad(loss, head)[0], engine


@pytest.mark.parametrize("kind", ["dpo", "kto", "reward", "distill"])
def test_packed_layout_gives_the_padded_loss_and_gradient(kind):
    """Packed == padded loss and gradient; the packed engine moved the sdpa policy (and the frozen reference /
    teacher) to per-sequence SDPA, which skips the masked work."""
    from ludic_fast.integrations.packing import attention_implementation
    from ludic_fast.integrations.sdpa_varlen import SDPA_VARLEN

    padded, g_padded, _ = _loss_and_grad(kind, layout="padded")
    packed, g_packed, engine = _loss_and_grad(kind, layout="packed")
    assert attention_implementation(engine.model) == SDPA_VARLEN
    assert torch.allclose(padded, packed, rtol=1e-4, atol=1e-6), (padded, packed)
    assert torch.allclose(g_padded, g_packed, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
@pytest.mark.parametrize("kind", ["simpo", "distill"])
def test_mixed_precision_close_to_fp32(kind, amp):
    loss32, g32, _ = _loss_and_grad(kind)
    loss, g, engine = _loss_and_grad(kind, mixed_precision=amp)
    assert g.dtype == torch.float32 and (engine.scaler is not None) == (amp == "fp16")  # fp32 master weights
    assert torch.allclose(loss32, loss, rtol=3e-2), (loss32, loss)
    assert float((g32 - g).abs().max() / g32.abs().max()) < 0.1


def test_validation(tmp_path):
    with pytest.raises(ValueError, match="ref_model"):
        PreferenceObjective(DPOLoss())
    PreferenceObjective(SimPOLoss())  # no reference model needed
    with pytest.raises(ValueError, match="batch_size"):
        OfflineConfig(batch_size=0)
    with pytest.raises(ValueError, match="layout"):
        OfflineConfig(layout="ragged")
    with pytest.raises(ValueError, match="mixed_precision"):
        OfflineConfig(mixed_precision="fp8")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "completion": "2", "label": "yes"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: 'label' must be a bool"):
        read_rows(bad, "kto")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "1+1=", "completion": "2"}\n{"prompt": \n')
    with pytest.raises(ValueError, match="broken.jsonl:2: not a JSON object"):
        read_rows(broken, "completions")
    assert main(["train", "--preset", "kto", "--pref-data", str(bad), "--logger", "none"]) == 2
