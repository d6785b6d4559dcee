"""`ludic-fast` command line: `train`, `bench`, `demo` (the embedded default run)."""

from __future__ import annotations

import argparse
import importlib
import sys

_COMMANDS = {
    "train": ("ludic_fast.cli.train", "Run the bundled trainer (SFT warm-up + RL) on a task."),
    "demo": ("ludic_fast.cli.train", "Run the embedded default: tiny model, built-in task, CPU."),
    "bench": ("ludic_fast.benchmark.cli", "Benchmark the head and losses against reference and peers."),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="ludic-fast", description=__doc__)
    usage = "; ".join(f"{name}: {text.rstrip('.')}" for name, (_, text) in _COMMANDS.items())
    parser.add_argument("command", choices=sorted(_COMMANDS), help=usage)
    args = parser.parse_args(argv[:1])
    module = importlib.import_module(_COMMANDS[args.command][0])
    return int(module.main([args.command, *argv[1:]]) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
