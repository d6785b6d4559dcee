"""Which `ludic-fast train` flags apply to which preset, read from the preset records (`cli/presets.py`): a flag
given on the command line (or in a `--config` file) that the chosen preset does not read is a one-line error
before anything runs, never silently ignored. Every preset reads `TRAINER_FLAGS`; each reads its own `flags`;
the sampler flags (`--vllm-arg`, `--vllm-url`) apply only to the samplers that read them."""

from __future__ import annotations

import argparse

from ludic_fast.cli.presets import PRESETS, RL_FLAGS, TRAINER_FLAGS
from ludic_fast.cli.validation import UsageError

#: flags of the RL presets (kept for code that reads this name; the records are the source)
RL_ONLY = tuple(d for d in RL_FLAGS if not any(d in p.flags for p in PRESETS if p.offline))


def readers(dest: str) -> tuple[str, ...]:
    """The presets that read the flag `dest` (every preset for a trainer flag)."""
    if dest in TRAINER_FLAGS:
        return PRESETS.names()
    return tuple(p.name for p in PRESETS if dest in p.flags)


def unusable_flags(preset: str, given: list[str]) -> list[str]:
    """The flags (dest names) of `given` that `preset` does not read, in the order given."""
    reads = set(TRAINER_FLAGS) | set(PRESETS[preset].flags)
    return [d for d in given if d not in reads]


def given_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The dest names whose parsed value differs from the parser's default (given on the command line)."""
    return [a.dest for a in parser._actions
            if a.dest != "help" and hasattr(args, a.dest) and getattr(args, a.dest) != parser.get_default(a.dest)]


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_flag_scope(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """UsageError for the first flag given that `args.preset` does not read (call it on the parsed flags, before
    the recipe fills in its defaults)."""
    unusable = unusable_flags(args.preset, given_flags(parser, args))
    if unusable:
        kind = "an offline preset" if PRESETS[args.preset].offline else "an RL preset"
        raise UsageError(f"{_flag(unusable[0])} does not apply to --preset {args.preset} ({kind}): drop it")


__all__ = ["RL_ONLY", "readers", "unusable_flags", "given_flags", "check_flag_scope"]
