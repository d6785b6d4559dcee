"""The pipeline example scripts (examples/pipeline_rl/actor.py and learner.py) as `main(argv)` functions for
processes forked from a test (tests/_forked.py), with what they import when they run imported once here and
inherited by the forked ones."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import _forked as forked

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "pipeline_rl"
PRELOAD = ("ludic_fast.cli.train", "ludic_fast.distributed.pipeline_ranks", "ludic_fast.engine.stop")


def actor_and_learner_mains() -> tuple[Callable[[list[str]], int], Callable[[list[str]], int]]:
    """`main` of actor.py and of learner.py."""
    return forked.script_main(EXAMPLES / "actor.py", PRELOAD), forked.script_main(EXAMPLES / "learner.py", PRELOAD)
