"""The flag-scope table against what each preset really reads, for every preset of the registry
(`cli/presets.py`) and every flag some offline presets read and others do not: `ludic-fast train` accepts the
flag exactly where the preset's build reads it. "Reads" is observed, not taken from the records: the flag's
value changes what the preset builds (its loss, objective or algorithm; a loss of another preset's class does
not count), or, for `--backend`, the preset's objective hands the engine's backend to the head in a step."""

from __future__ import annotations

import copy
import functools
import random
import re

import pytest
import torch

from ludic_fast.cli import train as train_cli
from ludic_fast.cli.preset_builders import BuildInputs
from ludic_fast.cli.preset_flags import check_flag_scope
from ludic_fast.cli.presets import PRESETS
from ludic_fast.cli.validation import UsageError
from ludic_fast.data.preference_data import embedded_rows, encode_rows
from ludic_fast.embedded import build_char_tokenizer, build_tiny_model
from ludic_fast.trainer import Trainer, TrainerConfig

PARSER = train_cli.build_parser("ludic-fast train")
TOK = build_char_tokenizer()
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
MODEL = build_tiny_model(len(TOK), seed=0, **SMALL)
OFFLINE = [p for p in PRESETS if p.offline]
#: flags every offline preset reads (its data and steps: the offline run reads them, not a preset's build)
SHARED = set.intersection(*(set(p.flags) for p in OFFLINE))
#: flags some offline presets read and others do not
SCOPED = sorted(set().union(*(p.flags for p in OFFLINE)) - SHARED)
#: a non-default command-line value of each scoped flag (with the flags it needs; "{teacher}": a saved model)
VALUES = {"beta": ["--beta", "0.37"], "entropy_stats": ["--entropy-stats"], "loss_type": ["--loss-type", "hinge"],
          "loss_weights": ["--loss-type", "sigmoid,hinge", "--loss-weights", "1,0.5"],
          "backend": ["--backend", "torch"],
          "teacher": ["--teacher", "{teacher}"], "teacher_steps": ["--teacher-steps", "1"],
          "distill_kind": ["--distill-kind", "reverse_kl"], "distill_beta": ["--distill-beta", "0.3"],
          "distill_temperature": ["--distill-temperature", "2"], "hard_weight": ["--hard-weight", "0.5"],
          "on_policy_fraction": ["--on-policy-fraction", "0.5"], "max_new_tokens": ["--max-new-tokens", "7"]}
#: the flags a value needs to be valid: given alike to the build it is compared against
NEEDS = {"loss_weights": ["--loss-type", "sigmoid,hinge"]}


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("teacher")
    build_tiny_model(len(TOK), seed=3, **SMALL).save_pretrained(path)
    return str(path)


def _args(preset: str, flags: list[str]):
    args = PARSER.parse_args(["--preset", preset, *flags])
    if "--teacher-steps" not in flags:
        args.teacher_steps = 0  # the embedded teacher untrained: fast, and the same in both builds
    return args


@functools.cache
def _inputs(preset: str) -> BuildInputs:
    """The model, tokenizer and examples a preset builds on (one model for every build)."""
    if not PRESETS[preset].offline:
        return BuildInputs()
    fmt = PRESETS[preset].data
    return BuildInputs(MODEL, TOK, encode_rows(embedded_rows(fmt, 8), fmt, TOK, chat_template=False))


def _state(value) -> object:
    """What a built object holds, comparable across builds: modules by their parameters, addresses dropped."""
    if isinstance(value, torch.nn.Module):
        return type(value).__name__, [float(p.detach().double().sum()) for p in value.parameters()]
    if isinstance(value, random.Random):
        return value.getstate()
    if hasattr(value, "__dict__") and not callable(value):
        return type(value).__name__, {k: _state(v) for k, v in sorted(vars(value).items())}
    return re.sub(r" at 0x[0-9a-f]+", "", repr(value))


def _built(preset: str, flags: list[str]):
    torch.manual_seed(0)  # the reward preset's value head: the same initial weights in every build
    try:
        return PRESETS[preset].build(_args(preset, flags), _inputs(preset))
    except (UsageError, TypeError):
        return None  # the preset's build cannot take the value (its loss has no such option, say)


def _build_reads(preset: str, dest: str, teacher: str) -> bool:
    """Whether the flag's value changes what `preset` builds (into an object of the preset's own loss class)."""
    needs = NEEDS.get(dest, [])
    given = [v.format(teacher=teacher) for v in VALUES[dest]]
    base, changed = _built(preset, needs), _built(preset, given)
    if base is None or changed is None:
        return False
    loss = PRESETS[preset].loss
    if loss is not None and not (type(base.loss_fn) is type(changed.loss_fn) is loss):
        return False  # e.g. --loss-type on ipo would train DPO's hinge: not ipo reading it
    return _state(base) != _state(changed)


class _Recording:
    """The engine's config, recording which fields are read."""

    def __init__(self, cfg: TrainerConfig):
        self._cfg, self.read = cfg, set()

    def __getattr__(self, name):
        self.read.add(name)
        return getattr(self._cfg, name)


def _step_reads_backend(preset: str) -> bool:
    """Whether one training step of the preset's objective reads the engine's `backend`."""
    inputs = BuildInputs(build_tiny_model(len(TOK), seed=0, **SMALL), TOK, _inputs(preset).examples)
    objective = PRESETS[preset].build(_args(preset, []), inputs).use_examples(inputs.examples, batch_size=4, seed=0)
    cfg = TrainerConfig(model_device="cpu", pad_token_id=TOK.pad_token_id, max_seq_len=32, micro_token_budget=1024,
                        sync_every_steps=0)
    trainer = Trainer(model=inputs.model, objective=objective, cfg=cfg)
    trainer.cfg = spy = _Recording(copy.copy(trainer.cfg))
    trainer.accumulate_gradients(objective.stream.next())
    return "backend" in spy.read


def _accepted(preset: str, dest: str, teacher: str) -> bool:
    args = PARSER.parse_args(["--preset", preset, *(v.format(teacher=teacher) for v in VALUES[dest])])
    try:
        check_flag_scope(PARSER, args)
    except UsageError:
        return False
    return True


def test_the_scoped_flags_are_the_offline_records_own():
    assert {"beta", "backend", "entropy_stats", "loss_type", "teacher"} <= set(SCOPED) <= set(VALUES)


@pytest.mark.parametrize("preset", PRESETS.names())
def test_each_scoped_flag_is_accepted_exactly_where_the_preset_reads_it(preset, teacher_dir):
    record = PRESETS[preset]
    for dest in SCOPED:
        if dest == "backend" and record.offline:
            reads = _step_reads_backend(preset)
        elif not record.offline and dest in record.flags:
            continue  # an RL preset's rollouts and loss read it (run by tests/test_cli.py), not its build
        else:
            reads = _build_reads(preset, dest, teacher_dir)
        assert _accepted(preset, dest, teacher_dir) == reads, (preset, dest, "read" if reads else "not read")
