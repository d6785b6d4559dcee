"""`vllm_model_dir`: the embedded model saved for vLLM to serve goes to <output-dir>/vllm_model, or without
--output-dir to a temporary folder that is removed at exit (a model's copy per run otherwise piled up in the
temp dir)."""

from __future__ import annotations

import shutil
from pathlib import Path

from _at_exit import rmtree_at_exit

from ludic_fast.cli import train_phases
from ludic_fast.cli.run_setup import build_tokenizer
from ludic_fast.cli.train_parser import build_parser


def _args(*argv: str):
    args = build_parser("ludic-fast train").parse_args(list(argv))
    args.attn = "sdpa"  # resolved from "auto" by the run's setup
    return args


def test_without_output_dir_the_served_model_goes_at_exit(monkeypatch):
    removals = rmtree_at_exit(monkeypatch)
    args = _args()
    path = Path(train_phases.vllm_model_dir(args, build_tokenizer(args)))
    assert (path / "config.json").is_file() and len(removals) == 1
    for a, k in removals:
        shutil.rmtree(*a, **k)
    assert not path.exists() and not path.parent.exists()


def test_with_output_dir_the_served_model_stays(tmp_path, monkeypatch):
    removals = rmtree_at_exit(monkeypatch)
    args = _args("--output-dir", str(tmp_path))
    path = Path(train_phases.vllm_model_dir(args, build_tokenizer(args)))
    assert path == tmp_path / "vllm_model" and (path / "config.json").is_file() and removals == []
