"""Loggers: TeeLogger survives a failing logger (Ludic's test), print format, JSONL, sparkline, the rich
dashboard's panels, wandb's lazy import, and the PNG of reward and loss curves."""

from __future__ import annotations

import io
import sys

import pytest

from ludic_fast.run.loggers import (
    JSONLLogger,
    PrintLogger,
    RichLiveLogger,
    TeeLogger,
    WandbLogger,
    plot_curves,
    read_jsonl,
    sparkline,
)


class _Boom:
    def log(self, step, stats):
        raise RuntimeError("boom")


class _Keep:
    def __init__(self):
        self.seen = []

    def log(self, step, stats):
        self.seen.append((step, dict(stats)))


def test_tee_survives_a_failing_logger(capsys):
    keep = _Keep()
    TeeLogger(_Boom(), keep).log(3, {"a": 1.0})
    assert keep.seen == [(3, {"a": 1.0})]
    assert "boom" in capsys.readouterr().err


def test_print_logger_format():
    text = PrintLogger(prefix="[t]", precision=2, max_items_per_line=2).format(5, {"b": 2.0, "a": 1.234, "c": "x"})
    assert text.splitlines() == ["[t] step=5 a=1.2 b=2", "           c=x"]
    assert PrintLogger(keys=["b"]).format(1, {"a": 1.0, "b": 2}) == "[trainer] step=1 b=2"


def test_print_logger_small_values_phase_and_eval():
    lg = PrintLogger(keys=["train/lr", "train/loss", "eval/reward"], precision=3)
    line = lg.format(1, {"train/lr": 1e-5, "train/loss": 0.123456})
    assert line == "[trainer] step=1 train/lr=1e-05 train/loss=0.123"
    lg.set_phase("rl", 80)
    assert lg.format(20, {"eval/reward": 0.5, "eval/step": 20}) == "[trainer] [rl] step=20/80 eval/reward=0.5"
    out = io.StringIO()
    PrintLogger(stream=out).warn("no signal")
    assert out.getvalue() == "[trainer] WARNING: no signal\n"


def test_tee_logger_drop_keys():
    seen = []

    class Rec:
        def log(self, step, stats):
            seen.append(dict(stats))

    TeeLogger(Rec(), drop_keys=["train/avg_total_reward"]).log(1, {"train/loss": 1.0, "train/avg_total_reward": 0.0})
    assert seen == [{"train/loss": 1.0}]


def test_jsonl_logger_round_trip(tmp_path):
    lg = JSONLLogger(tmp_path / "m.jsonl", extra={"phase": "rl"})
    lg.log(1, {"train/loss": 0.5})
    lg.log(2, {"train/loss": 0.25, "obj": object()})
    recs = read_jsonl(tmp_path / "m.jsonl")
    assert recs[0] == {"step": 1, "phase": "rl", "train/loss": 0.5} and recs[1]["step"] == 2


def test_sparkline():
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7]) == "▁▂▃▄▅▆▇█"
    assert sparkline([2, 2, 2]) == "▁▁▁" and sparkline([]) == "" and sparkline([1, 5, 9], width=2) == "▁█"


def test_rich_live_logger_panels():
    from rich.console import Console

    out = io.StringIO()
    console = Console(file=out, width=120, force_terminal=False)
    with RichLiveLogger(console=console, spark_key="avg_total_reward") as lg:
        for step, r in enumerate([0.1, 0.5, 0.9], 1):
            lg.log(
                step,
                {
                    "train/avg_total_reward": r,
                    "train/loss": 1.0 / step,
                    "perf/step_time_s": 0.1,
                    "eval/reward": 0.3,
                    "eval/step": 2,
                },
            )
        assert list(lg.values) == [0.1, 0.5, 0.9]
        assert set(lg.train) == {"train/avg_total_reward", "train/loss"} and set(lg.perf) == {"perf/step_time_s"}
        assert lg.eval_step == 2
        console.print(lg.render())
    text = out.getvalue()
    assert "▁▅█" in text and "eval (step 2)" in text and "perf" in text


def test_rich_live_logger_phase_and_warnings():
    from rich.console import Console

    out = io.StringIO()
    console = Console(file=out, width=120, force_terminal=False)
    with RichLiveLogger(console=console) as lg:
        lg.set_phase("sft", 40)
        lg.log(3, {"train/loss": 1e-5})
        lg.warn("every group's rewards tie")
        console.print(lg.render())
    text = out.getvalue()
    assert "sft  step 3/40" in text and "warnings" in text and "every group's rewards tie" in text and "1e-05" in text


def test_wandb_logger_needs_wandb(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match="wandb"):
        WandbLogger(project="x")


def test_plot_curves_writes_png(tmp_path):
    recs = [{"step": s, "phase": "sft", "train/loss": 2.0 / s, "train/avg_total_reward": 0.0} for s in (1, 2)]
    recs += [{"step": s, "phase": "rl", "train/loss": -0.1, "train/avg_total_reward": 0.1 * s} for s in (1, 2, 3)]
    recs.append({"step": 3, "phase": "rl", "eval/reward": 0.4})
    path = plot_curves(recs, tmp_path / "c.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
