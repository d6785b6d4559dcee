"""The extension points as data: the `Registry` type, and every preset, sampler and reward of the registries
reaches `--help` and the flag-scope check, read from the records (no second list here). Each flag of
`ludic-fast train` is read by a preset (or by every preset) and refused by the presets that do not read it."""

from __future__ import annotations

import json
import textwrap
import warnings
from dataclasses import dataclass

import pytest

from ludic_fast.cli import train as train_cli
from ludic_fast.cli.preset_flags import check_flag_scope, readers
from ludic_fast.cli.presets import PRESETS, TRAINER_FLAGS
from ludic_fast.cli.validation import UsageError
from ludic_fast.registry import Registry, load_attr
from ludic_fast.rollout.rewards import REWARD_FUNCS, WeightedReward, get_reward
from ludic_fast.rollout.sampler import SAMPLERS, Sampler

PARSER = train_cli.build_parser("ludic-fast train")
DESTS = [a.dest for a in PARSER._actions if a.dest != "help"]


@dataclass(frozen=True)
class _Thing:
    name: str
    help: str


THING = _Thing("third", "a third party's")


def test_registry_adds_gets_and_resolves_module_paths():
    reg = Registry("thing")
    reg.add(_Thing("a", "first"))
    assert reg.names() == ("a",) and "a" in reg and reg["a"].help == "first" and len(reg) == 1
    with pytest.raises(ValueError, match="thing 'a' is already registered"):
        reg.add(_Thing("a", "again"))
    with pytest.raises(ValueError, match="thing must be one of a or 'module:attr', got 'b'"):
        reg.get("b")
    assert reg.resolve("test_registry:THING") is THING
    with pytest.raises(ValueError, match="has no attribute 'NOPE'"):
        reg.resolve("test_registry:NOPE")
    with pytest.raises(ValueError, match="cannot import"):
        reg.resolve("no_such_module_xyz:THING")
    with pytest.raises(TypeError, match="expected a thing entry"):
        reg.resolve("test_registry:DESTS")
    assert load_attr("json:dumps", "x") is json.dumps


def test_every_preset_sampler_and_reward_is_in_help():
    text = PARSER.format_help()
    for preset in PRESETS:
        assert f"  {preset.name} " in text and preset.help in " ".join(text.split())
    for sampler in SAMPLERS:
        assert f"  {sampler.name} " in text
    for reward in REWARD_FUNCS:
        assert reward.name in text
    assert PARSER.get_default("preset") in PRESETS
    choices = next(a.choices for a in PARSER._actions if a.dest == "preset")
    assert tuple(choices) == PRESETS.names()


def test_every_flag_is_read_by_a_preset_and_the_records_name_only_real_flags():
    unread = [d for d in DESTS if not readers(d)]
    assert not unread, f"flags no preset reads: {unread}"
    named = set(TRAINER_FLAGS) | {f for p in PRESETS for f in p.flags} | {f for s in SAMPLERS for f in s.flags}
    assert named <= set(DESTS), f"records name flags the parser lacks: {sorted(named - set(DESTS))}"


@pytest.mark.parametrize("preset", PRESETS.names())
def test_each_flag_is_read_or_refused(preset):
    """Every flag the record does not read is a one-line error naming it; every flag it reads passes."""
    record = PRESETS[preset]
    for dest in DESTS:
        args = PARSER.parse_args(["--preset", preset])
        if dest == "preset":
            continue
        setattr(args, dest, object())  # differs from every default: counts as given
        if dest in TRAINER_FLAGS or dest in record.flags:
            check_flag_scope(PARSER, args)
        else:
            flag = "--" + dest.replace("_", "-")
            with pytest.raises(UsageError, match=f"^{flag} does not apply to --preset {preset} "):
                check_flag_scope(PARSER, args)


def test_the_offline_dispatch_is_the_records():
    from ludic_fast.cli import offline

    assert offline.OFFLINE_PRESETS == tuple(p.name for p in PRESETS if p.kind != "rl")
    assert set(train_cli.PRESETS) == {p.name for p in PRESETS if p.kind == "rl"}
    for name in offline.OFFLINE_PRESETS:
        assert offline.METRIC[name] == PRESETS[name].metric and offline.FORMAT[name] == PRESETS[name].data


def test_samplers_satisfy_the_protocol():
    from ludic_fast.embedded import build_char_tokenizer, build_tiny_model
    from ludic_fast.rollout.sampler import SamplerSettings

    tok = build_char_tokenizer()
    model = build_tiny_model(len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                             bos_token_id=tok.bos_token_id)
    sampler = SAMPLERS["hf"].build(SamplerSettings(model=model, tokenizer=tok))
    assert isinstance(sampler, Sampler) and sampler.version == 0
    with pytest.raises(ValueError, match="model_path is required"):
        SAMPLERS["vllm"].build(SamplerSettings(model=model, tokenizer=tok))


def test_rewards_by_name_argument_and_module_path():
    assert get_reward("exact")(" 3 ", "3") == 1.0
    assert get_reward("format:[0-9]+")("42", "") == 1.0 and get_reward("format:[0-9]+")("4a", "") == 0.0
    assert get_reward("test_registry:_half")("x", "y") == 0.5
    with pytest.raises(TypeError, match="expected a function"):
        get_reward("test_registry:DESTS")
    both = WeightedReward(["exact", "test_registry:_half"], [2.0, 0.5])
    assert both("3", "3") == pytest.approx(2.0 * 1 + 0.5 * 0.5)
    assert both.scores("4", "3") == {"exact": 0.0, "test_registry:_half": 0.5}
    with pytest.raises(ValueError, match="one weight per reward"):
        WeightedReward(["exact"], [1.0, 2.0])


def _half(completion: str, answer: str) -> float:
    return 0.5


def test_a_user_sampler_and_weighted_rewards_run_from_the_command_line(tmp_path, monkeypatch):
    """`--sampler mod:attr` builds the user's sampler (it samples every rollout) and `--reward exact --reward
    mod:fn --reward-weights 1,0.5` logs each component's mean and their weighted sum as the reward."""
    (tmp_path / "user_ext.py").write_text(textwrap.dedent("""
        from ludic_fast.rollout.sampler import SAMPLERS
        CALLS = []

        def counting(settings):
            inner = SAMPLERS["hf"].build(settings)
            real = inner.generate
            def generate(prompts, sampling, *, seed=None):
                CALLS.append(len(prompts))
                return real(prompts, sampling, seed=seed)
            inner.generate = generate
            return inner

        def length(completion, answer):
            return float(len(completion))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    argv = ["train", "--sampler", "user_ext:counting", "--reward", "exact", "--reward", "user_ext:length",
            "--reward-weights", "1,0.5", "--sft-steps", "0", "--rl-steps", "2", "--prompts-per-batch", "4",
            "--group-size", "2", "--eval-every", "0", "--logger", "none", "--no-plot", "--device", "cpu",
            "--output-dir", str(out)]
    assert train_cli.main(argv) == 0
    import user_ext

    assert user_ext.CALLS == [8, 8]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r.get("phase") == "rl"]
    assert len(rl) == 2
    for r in rl:
        want = 1.0 * r["train/reward/exact"] + 0.5 * r["train/reward/user_ext:length"]
        assert r["train/avg_total_reward"] == pytest.approx(want)
        assert r["train/reward/user_ext:length"] > 0


def test_unknown_sampler_and_bad_reward_are_one_line_errors(capsys):
    assert train_cli.main(["train", "--sampler", "nosuch_mod_xyz:f"]) == 2
    assert "--sampler: sampler 'nosuch_mod_xyz:f': cannot import" in capsys.readouterr().err
    assert train_cli.main(["train", "--reward", "exact", "--reward-weights", "1,2"]) == 2
    assert "--reward-weights: one weight per --reward (1), got 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_cli.main(["train", "--sampler", "nosuch"])
    assert "invalid choice: 'nosuch'" in capsys.readouterr().err


def test_engine_is_the_deprecated_name_of_sampler():
    with pytest.warns(FutureWarning, match="--engine is deprecated: use --sampler"):
        args = PARSER.parse_args(["--engine", "vllm"])
    assert args.engine == "vllm"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert PARSER.parse_args(["--sampler", "vllm"]).engine == "vllm"


def test_every_preset_sampler_and_reward_has_a_row_in_the_docs_tables():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "presets.md").read_text(encoding="utf-8")
    rows = {line.split("|")[1].strip().strip("`") for line in text.splitlines() if line.startswith("| `")}
    for name in [*PRESETS.names(), *SAMPLERS.names()]:
        assert name in rows, f"{name} has no row in docs/presets.md"
    for reward in REWARD_FUNCS:
        assert (f"{reward.name}:<arg>" if reward.takes_arg else reward.name) in rows


def test_the_samplers_old_names_and_paths_still_work_with_a_deprecation_warning():
    import importlib
    import sys

    from ludic_fast import rollout
    from ludic_fast.rollout import hf_sampler, vllm_sampler, vllm_server
    from ludic_fast.rollout.sources import RolloutBatchSource

    for old, new in [("HFGenerateEngine", rollout.HFSampler), ("VLLMEngine", rollout.VLLMSampler),
                     ("VLLMServerEngine", rollout.VLLMServerSampler)]:
        with pytest.warns(DeprecationWarning, match=f"{old} is deprecated"):
            assert getattr(rollout, old) is new
    with pytest.warns(DeprecationWarning, match="server_engine is deprecated"):
        assert vllm_server.server_engine is vllm_server.server_sampler
    for old, new in [("ludic_fast.rollout.engine", hf_sampler), ("ludic_fast.rollout.vllm_engine", vllm_sampler)]:
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=f"{old} is deprecated"):
            assert importlib.import_module(old) is new
    from ludic_fast.rollout.engine import SamplingConfig, cut_at_eos  # the old path's other names

    assert cut_at_eos([1, 2], [0.0, 0.0], {2}) == ([1, 2], [0.0, 0.0], "stop") and SamplingConfig().temperature == 1
    args = dict(task=None, tokenizer=None, credit_assigner=None, prompts_per_batch=1, group_size=1,
                sampling=SamplingConfig(), chat_template=False)
    with pytest.warns(DeprecationWarning, match="engine= is deprecated"):
        assert RolloutBatchSource(engine="S", **args).sampler == "S"
    with pytest.raises(TypeError, match="exactly once"):
        RolloutBatchSource(sampler="S", engine="S", **args)


def test_the_offline_modules_old_paths_and_names_still_work_with_a_deprecation_warning():
    import importlib
    import sys

    from ludic_fast.cli import dataset_presets
    from ludic_fast.objectives import dataset
    from ludic_fast.rollout import dataset_source

    for old, new in [("ludic_fast.rollout.offline", dataset_source), ("ludic_fast.objectives.offline", dataset),
                     ("ludic_fast.cli.offline", dataset_presets)]:
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=f"{old} is deprecated"):
            assert importlib.import_module(old) is new
    with pytest.warns(DeprecationWarning, match="OfflineBatchSource is deprecated"):
        assert dataset_source.OfflineBatchSource is dataset_source.DatasetBatchSource
    with pytest.warns(DeprecationWarning, match="OfflineObjective is deprecated"):
        assert dataset.OfflineObjective is dataset.DatasetObjective
