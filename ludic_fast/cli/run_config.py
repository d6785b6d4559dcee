"""`ludic-fast train --config FILE`: a run's settings from a YAML or TOML file, and the file a run saves.

The file maps flag names (`lr`, `sft-steps` or `sft_steps`) to values: numbers, strings, booleans, lists for the
repeatable and comma-separated flags (`reward: [exact, numeric]`, `loss_type: [sigmoid, sft]`), null for the
default. Flags given on the command line beside `--config` override the file's. A key that is no flag is a
one-line error naming it, and the file's flags go through the same checks as typed ones (the flag-scope check
too: a key the preset does not read is refused).

Every run writes `config.yaml` in its output directory: every setting its preset reads, as resolved (the
profile's defaults filled in), except where the run writes (`output_dir`) and `resume`; so
`ludic-fast train --config <run>/config.yaml --output-dir <new>` runs the same run again. Beside it `run.json`
records the command line, the preset record, the engine configs, versions, commit and machine
(`ludic_fast.run.record`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from ludic_fast.cli.presets import PRESETS, TRAINER_FLAGS
from ludic_fast.cli.validation import UsageError

#: settings of where and how a run writes, left out of the saved config (the rerun names its own)
NOT_SAVED = ("config", "output_dir", "resume")


def read_config_file(path: str) -> dict[str, Any]:
    """The mapping in a .yaml / .yml / .toml file (UsageError naming `--config` for anything else)."""
    suffix = Path(path).suffix.lower()
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"--config {path}: cannot read it ({exc.strerror or exc})") from None
    try:
        if suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        elif suffix == ".toml":
            data = _toml_loads(text)
        else:
            raise UsageError(f"--config {path}: expected a .yaml, .yml or .toml file")
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - any parse error of either format: one line naming the file
        reason = " ".join(str(exc).split())[:200]
        raise UsageError(f"--config {path}: not valid {suffix[1:].upper()} ({reason})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: expected a mapping of flag names to values, got {type(data).__name__}")
    return data


def _toml_loads(text: str) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise UsageError("--config: reading TOML on Python 3.10 needs tomli (pip install tomli)") from None
    return tomllib.loads(text)


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest not in ("help", "config")}


def command_line_dests(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The dest names of the options written in `argv` (long options, `--x=v` and unique prefixes too)."""
    options = parser._option_string_actions
    out = set()
    for token in argv:
        if not token.startswith("--") or token == "--":
            continue
        name = token.split("=", 1)[0]
        matches = [name] if name in options else [o for o in options if o.startswith(name)]
        if len({options[m].dest for m in matches}) == 1:
            out.add(options[matches[0]].dest)
    return out


def config_argv(parser: argparse.ArgumentParser, path: str, argv: list[str]) -> list[str]:
    """The file's settings as command-line tokens, leaving out those `argv` sets (the command line wins)."""
    actions = _actions(parser)
    options = parser._option_string_actions
    given = command_line_dests(parser, argv)
    tokens: list[str] = []
    for key, value in read_config_file(path).items():
        option = "--" + str(key).replace("_", "-")
        dest = options[option].dest if option in options else str(key).replace("-", "_")
        if dest not in actions:
            raise UsageError(f"--config {path}: unknown key {key!r} (not a flag of ludic-fast train)")
        if dest not in given and value is not None:
            tokens += _tokens(actions[dest], value, f"--config {path}: {key}")
    return tokens


def _tokens(action: argparse.Action, value: Any, where: str) -> list[str]:
    flag = action.option_strings[0]
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise UsageError(f"{where}: expected true or false, got {value!r}")
        return [flag if value else "--no-" + flag[2:]]
    if action.nargs == 0:  # store_true
        if not isinstance(value, bool):
            raise UsageError(f"{where}: expected true or false, got {value!r}")
        return [flag] if value else []
    if isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [value]
        return [t for item in items for t in (flag, _text(item))]
    if isinstance(value, list):  # a comma-separated flag (--loss-type, --loss-weights, --reward-weights)
        return [flag, ",".join(_text(v) for v in value)]
    return [flag, _text(value)]


def _text(value: Any) -> str:
    if isinstance(value, bool) or isinstance(value, (dict, list)):
        return json.dumps(value)
    return repr(value) if isinstance(value, float) else str(value)


def parse_with_config(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """`parser.parse_args(argv)`, the `--config` file's settings first when one is given (UsageError for a bad
    file or key)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config is None:
        return parser.parse_args(argv)
    return parser.parse_args(config_argv(parser, known.config, argv) + argv)


def saved_settings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """The settings a run saves to config.yaml: the flags its preset reads (module docstring), as plain data,
    each under its flag's name (`sampler`, `sft_lr`)."""
    actions = _actions(parser)
    reads = [*TRAINER_FLAGS, *PRESETS[args.preset].flags]
    out: dict[str, Any] = {}
    for dest in dict.fromkeys(reads):
        if dest in NOT_SAVED or dest not in actions:
            continue
        value = getattr(args, dest)
        if dest == "vllm_arg":
            value = [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in value]
        out[actions[dest].option_strings[0][2:].replace("-", "_")] = value
    return out


def write_config(path: str | os.PathLike[str], parser: argparse.ArgumentParser, args: argparse.Namespace) -> Path:
    """config.yaml of `saved_settings(parser, args)`."""
    import yaml

    from ludic_fast.run.atomic_io import atomic_write_text

    path = Path(path)
    header = "# ludic-fast train --config this-file [--output-dir NEW] re-runs this run; flags beside it override it\n"
    atomic_write_text(path, header + yaml.safe_dump(saved_settings(parser, args), sort_keys=False))
    return path


def record_run(out: Path, parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str], *,
               trainer_configs: dict[str, Any], objective: Any) -> None:
    """Write `config.yaml` (the re-runnable settings) and `run.json` (the command line `ludic-fast <argv>`, every
    resolved flag, the preset record, the engine's config of each phase, what the preset trains, versions,
    commit, machine) into the run directory `out`."""
    from ludic_fast.run.record import write_run_record

    write_config(out / "config.yaml", parser, args)
    write_run_record(out / "run.json", command_line=["ludic-fast", *argv], settings=vars(args),
                     preset=PRESETS[args.preset], trainer_configs=trainer_configs, objective=objective)


__all__ = ["NOT_SAVED", "record_run", "read_config_file", "command_line_dests", "config_argv", "parse_with_config",
           "saved_settings", "write_config"]
