"""examples/preference_custom_loop.py runs (its DPO step 0 asserts equality with the materialised-logits twin) and
both of its objectives improve on the tiny models."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "preference_custom_loop.py"


def test_example_runs_and_learns(capsys):
    spec = importlib.util.spec_from_file_location("preference_custom_loop", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.dpo(steps=6)
    mod.distill(steps=6)
    lines = capsys.readouterr().out.splitlines()
    dpo_loss = [float(line.split("loss ")[1].split()[0]) for line in lines if line.startswith("dpo")]
    jsd = [float(line.split("JSD ")[1]) for line in lines if line.startswith("distill")]
    assert dpo_loss[-1] < dpo_loss[0] and jsd[-1] < jsd[0]
