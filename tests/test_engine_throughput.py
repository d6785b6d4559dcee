"""Throughput is the engine's, for every objective: `perf/tokens` (non-pad tokens of the step's micro-batches),
`perf/examples`, and their rates over the step's compute time `perf/step_time_s - perf/batch_time_s`
(`ludic_fast.engine.trainer`). Checked on the dpo, reward and distill presets of `ludic-fast train` and on the
engine directly against token counts derived by hand from the examples, padded and packed."""

from __future__ import annotations

import json

import pytest
import torch

from ludic_fast.cli.train import main
from ludic_fast.data.pair_batching import PreferencePair
from ludic_fast.data.preference_data import embedded_rows, encode_rows
from ludic_fast.embedded import build_char_tokenizer, build_tiny_model
from ludic_fast.engine.config import EngineConfig
from ludic_fast.engine.trainer import Engine
from ludic_fast.losses import DPOLoss
from ludic_fast.objectives.distill import DistillObjective
from ludic_fast.objectives.preference import PreferenceObjective
from ludic_fast.objectives.reward import RewardObjective

TOK = build_char_tokenizer()
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
MAX_LEN = 16  # below the last example's length: a truncated sequence counts its kept tokens only


def _rates_hold(record: dict) -> None:
    compute = record["perf/step_time_s"] - record["perf/batch_time_s"]
    assert record["perf/tokens_per_s"] == pytest.approx(record["perf/tokens"] / compute, rel=1e-9)
    assert record["perf/examples_per_s"] == pytest.approx(record["perf/examples"] / compute, rel=1e-9)


@pytest.mark.parametrize("preset", ["dpo", "reward", "distill"])
def test_offline_presets_log_throughput(tmp_path, preset):
    extra = ["--teacher-steps", "1"] if preset == "distill" else []
    args = ["train", "--preset", preset, "--offline-steps", "2", "--pref-batch-size", "4", "--logger", "none",
            "--no-plot", "--device", "cpu", "--output-dir", str(tmp_path), "--threads", "1", *extra]
    assert main(args) == 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("phase") == preset]
    assert len(train) == 2
    for r in train:
        assert r["perf/tokens"] > 0 and r["perf/examples"] == 4.0
        _rates_hold(r)


def _examples(preset: str) -> list:
    """Six embedded examples (9 or 10 tokens a sequence: padding) and one of over MAX_LEN (truncated)."""
    fmt = "completions" if preset == "distill" else "pairs"
    examples = encode_rows(embedded_rows(fmt, 6), fmt, TOK, chat_template=False)
    first = examples[0]
    if fmt == "pairs":
        return [*examples, PreferencePair(first.prompt * 2, first.chosen, first.rejected * 3)]
    return [*examples, (first[0] * 2, first[1] * 3)]


def _tokens_by_hand(examples: list) -> int:
    """Σ over the sequences of each example (a pair's two, a completion's one) of min(length, MAX_LEN)."""
    if isinstance(examples[0], PreferencePair):
        lengths = [len(e.prompt) + len(r) for e in examples for r in (e.chosen, e.rejected)]
    else:
        lengths = [len(p) + len(c) for p, c in examples]
    return sum(min(n, MAX_LEN) for n in lengths)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("preset", ["dpo", "reward", "distill"])
def test_tokens_are_the_non_pad_tokens_of_the_step(preset, layout):
    examples = _examples(preset)
    other = build_tiny_model(len(TOK), seed=1, **SMALL).requires_grad_(False)
    torch.manual_seed(0)
    objective = {"dpo": lambda: PreferenceObjective(DPOLoss(), other),
                 "reward": lambda: RewardObjective(torch.nn.Linear(32, 1)),
                 "distill": lambda: DistillObjective(other)}[preset]()
    cfg = EngineConfig(model_device="cpu", pad_token_id=TOK.pad_token_id, lr=1e-2, max_seq_len=MAX_LEN,
                       micro_token_budget=4 * 2 * MAX_LEN, sync_every_steps=0, layout=layout)
    engine = Engine(model=build_tiny_model(len(TOK), seed=0, **SMALL), cfg=cfg,
                    objective=objective.use_examples(examples, batch_size=len(examples)))
    record = engine.train_step_sync()  # every example in the step, in several micro-batches
    assert record["perf/tokens"] == _tokens_by_hand(examples)
    cells = sum(m.batch["input_ids"].numel() for m in objective.micro_batches(engine, examples))
    assert (cells > _tokens_by_hand(examples)) == (layout == "padded")  # the padded batches did hold pads
    assert record["perf/examples"] == len(examples)
    _rates_hold(record)
