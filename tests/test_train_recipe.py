"""`ludic-fast train`'s model recipe: profile defaults (printed by --help; a given flag wins), --dtype / --attn
resolution, refusals on CPU, the TrainerConfig it produces, and a packed bf16-autocast run on CPU that prints
the peak-memory estimate before its first step."""

from __future__ import annotations

import importlib.util

import pytest
from test_cli import FAST

from ludic_fast.cli import train as train_cli
from ludic_fast.cli.recipe import PROFILES, apply_recipe, recipe_trainer_kwargs
from ludic_fast.cli.validation import UsageError


def _args(*flags: str):
    args = train_cli.build_parser("x").parse_args(list(flags))
    apply_recipe(args)
    return args


def test_help_prints_both_profiles_defaults(capsys):
    with pytest.raises(SystemExit):
        train_cli.build_parser("x").parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "default: 0.001 (tiny profile) / 1e-06 (real profile)" in out
    assert "default: 3 (tiny profile) / 512 (real profile)" in out
    assert "default auto: bf16 on CUDA, fp32 on CPU" in out


def test_profiles_fill_unset_flags_and_a_given_flag_wins():
    tiny = _args("--device", "cpu")
    assert tiny.profile == "tiny" and {k: getattr(tiny, k) for k in PROFILES["tiny"]} == PROFILES["tiny"]
    real = _args("--device", "cpu", "--model", "Qwen/Qwen2.5-0.5B-Instruct")
    assert real.profile == "real" and real.lr == 1e-6 and real.max_new_tokens == 512 and real.max_seq_len == 1024
    mixed = _args("--device", "cpu", "--profile", "real", "--lr", "3e-6")
    assert mixed.lr == 3e-6 and mixed.sft_lr == 1e-5


def test_dtype_and_attention_on_cpu():
    args = _args("--device", "cpu")
    assert args.dtype == "fp32" and args.attn == "sdpa"
    assert recipe_trainer_kwargs(args) == {"mixed_precision_dtype": None, "layout": "padded", "backend": "auto",
                                           "body_kernels": None, "compile_body": False}
    args = _args("--device", "cpu", "--dtype", "bf16", "--attn", "eager", "--layout", "packed", "--backend", "torch")
    assert recipe_trainer_kwargs(args)["mixed_precision_dtype"] == "bf16" and args.attn == "eager"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--body-kernels"], "--body-kernels needs --device cuda"),
        (["--attn", "flash_attention_2"], "--attn flash_attention_2 needs --device cuda"),
        (["--attn", "flex_attention"], "--attn flex_attention needs --device cuda"),
        (["--backend", "triton"], "--backend triton needs --device cuda"),
    ],
)
def test_cpu_refusals(flags, message, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(UsageError, match=message):
        _args("--device", "cpu", *flags)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed here")
def test_flash_attention_without_the_package_is_a_usage_error():
    with pytest.raises(UsageError, match="--attn flash_attention_2 needs the optional package flash_attn"):
        _args("--device", "cuda", "--attn", "flash_attention_2")  # apply_recipe only: no CUDA needed


def test_packed_bf16_run_prints_the_memory_estimate_first(tmp_path, capsys):
    argv = ["train", *FAST, "--rl-steps", "1", "--eval-every", "0", "--no-plot", "--output-dir", str(tmp_path),
            "--layout", "packed", "--dtype", "bf16", "--attn", "eager"]
    assert train_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "recipe: profile tiny, dtype bf16, attn eager, layout packed" in out
    sft, rl = out.index("sft: peak memory estimate"), out.index("rl: peak memory estimate")
    assert sft < rl
