"""Flags shared by the pipeline example's actor and learner (on top of `ludic-fast train`'s)."""

from __future__ import annotations

import argparse


def add_pipeline_args(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    g = p.add_argument_group("pipeline")
    g.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    g.add_argument("--prefix", default="ludic", help="key prefix shared by the actors and the learner of one run")
    return g
