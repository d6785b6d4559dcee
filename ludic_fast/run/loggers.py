"""Training loggers (Ludic's `TrainingLogger.log(step, stats)` protocol) and the end-of-run curve plot.

PrintLogger     "{prefix} [phase] step=N[/total] k=v ..." lines, floats at `precision` significant digits,
                wrapped every `max_items_per_line` items with continuation lines indented to the header;
                `warn(msg)` prints a warning line.
RichLiveLogger  a rich Live dashboard: train / eval / perf panels (keys split by prefix; `eval_`/`eval/`
                keys to eval, `perf/` and `gpu_` keys to perf) and a sparkline of `spark_key` (falling back
                to `train/<spark_key>`) over the last min(history, spark_window, width) values, min-max scaled;
                the phase and step counter in the header, warnings in a panel of their own.
JSONLLogger     one JSON object per call `{"step": N, **extra, **stats}` appended to a file (flushed);
                `keep_jsonl_records` drops the records past a resumed run's checkpoint.
TeeLogger       fans out to several loggers (optionally without some keys); a failing logger is reported
                once per call and skipped.
WandbLogger     `wandb.log(stats, step=step)`; wandb imported lazily; project defaults to $WANDB_PROJECT or "Ludic".
plot_curves     a PNG of the reward and loss curves (matplotlib, Agg backend) from JSONL records.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ludic_fast.data.jsonl import jsonl_objects
from ludic_fast.run.atomic_io import atomic_write_text

SPARK_BLOCKS = "▁▂▃▄▅▆▇█"


def _fmt(value: Any, precision: int) -> str:
    """Floats with `precision` significant digits (%g: 1e-05 stays 1e-05, 0.25 is 0.25), others as str."""
    if isinstance(value, float):
        return f"{value:.{precision}g}"
    return str(value)


def sparkline(values: Sequence[float], width: int | None = None) -> str:
    """Min-max scaled block characters of the last `width` finite values ("" when there are none)."""
    vals = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if width is not None:
        vals = vals[-width:] if width > 0 else []
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    span = hi - lo
    top = len(SPARK_BLOCKS) - 1
    return "".join(SPARK_BLOCKS[0 if span == 0 else round((v - lo) / span * top)] for v in vals)


class PrintLogger:
    """Plain-text lines to stdout (or `stream`)."""

    def __init__(
        self,
        prefix: str = "[trainer]",
        keys: Sequence[str] | None = None,
        precision: int = 4,
        max_items_per_line: int = 6,
        stream: Any = None,
    ):
        if max_items_per_line < 1:
            raise ValueError(f"max_items_per_line must be >= 1, got {max_items_per_line}")
        self.prefix, self.keys, self.precision = prefix, list(keys) if keys else None, precision
        self.max_items_per_line, self.stream = max_items_per_line, stream
        self.phase: str | None = None
        self.total_steps: int | None = None

    def set_phase(self, phase: str | None, total_steps: int | None = None) -> None:
        """Label the following lines `[phase] step=N/total_steps`."""
        self.phase, self.total_steps = phase, total_steps

    def format(self, step: int, stats: Mapping[str, Any]) -> str:
        keys = [k for k in self.keys if k in stats] if self.keys else sorted(stats)
        parts = [f"{k}={_fmt(stats[k], self.precision)}" for k in keys]
        counter = f"{step}/{self.total_steps}" if self.total_steps is not None else str(step)
        header = f"{self.prefix}{f' [{self.phase}]' if self.phase else ''} step={counter}"
        lines = []
        for i in range(0, max(len(parts), 1), self.max_items_per_line):
            chunk = " ".join(parts[i : i + self.max_items_per_line])
            lines.append(f"{header} {chunk}".rstrip() if i == 0 else " " * len(header) + " " + chunk)
        return "\n".join(lines)

    def log(self, step: int, stats: Mapping[str, Any]) -> None:
        print(self.format(step, stats), file=self.stream or sys.stdout, flush=True)

    def warn(self, message: str) -> None:
        print(f"{self.prefix} WARNING: {message}", file=self.stream or sys.stdout, flush=True)


class JSONLLogger:
    """Appends `{"step": step, **extra, **stats}` as one JSON line per call (non-JSON values as strings)."""

    def __init__(self, path: str | os.PathLike[str], *, extra: Mapping[str, Any] | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.extra = dict(extra or {})

    def log(self, step: int, stats: Mapping[str, Any]) -> None:
        record = {"step": step, **self.extra, **stats}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=str) + "\n")


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records a JSONLLogger wrote."""
    return [record for _, record in jsonl_objects(path)]


def keep_jsonl_records(path: str | os.PathLike[str], keep: Callable[[dict[str, Any]], bool]) -> None:
    """Rewrite a JSONLLogger's file (atomically) with only the records `keep` accepts; a missing file stays so.
    A resumed run keeps the records up to its checkpoint's step and logs the later steps again."""
    if not Path(path).exists():
        return
    kept = [r for r in read_jsonl(path) if keep(r)]
    atomic_write_text(path, "".join(json.dumps(r, default=str) + "\n" for r in kept))


def keep_records_for_resume(path: str | os.PathLike[str], *, phases: Sequence[str], resumed: str | None,
                            step: int | None = None) -> None:
    """Trim a phase-tagged record file (each record has "phase" and "step") for a run that resumes phase
    `resumed` from its checkpoint at `step`: the phases before it in `phases` are complete and not run again,
    so their records are kept whole; `resumed`'s records up to `step` are kept (its later steps are trained and
    logged again); the phases after it are dropped. `resumed=None` is a fresh run: the file is removed.
    A record of a phase not in `phases` is refused (ValueError) rather than guessed."""
    path = Path(path)
    if resumed is None:
        path.unlink(missing_ok=True)
        return
    if resumed not in phases:
        raise ValueError(f"resumed={resumed!r} is not one of phases={list(phases)}")
    if step is None:
        raise ValueError("step: a resumed phase needs its checkpoint's step")
    order = {phase: k for k, phase in enumerate(phases)}
    here = order[resumed]

    def keep(record: dict[str, Any]) -> bool:
        if record.get("phase") not in order:  # raised before the file is rewritten: it stays as it was
            raise ValueError(f"{path}: a record of phase {record.get('phase')!r}, not one of {list(phases)}: "
                             "cannot tell whether a resume keeps it")
        return order[record["phase"]] < here or (order[record["phase"]] == here and record["step"] <= step)

    keep_jsonl_records(path, keep)


class TeeLogger:
    """Calls every logger; an exception in one is printed to stderr and does not stop the others.
    `drop_keys` are removed from the stats first (e.g. RL-only metrics in an SFT phase)."""

    def __init__(self, *loggers: Any, drop_keys: Iterable[str] = ()):
        self.loggers = [lg for lg in loggers if lg is not None]
        self.drop_keys = frozenset(drop_keys)

    def log(self, step: int, stats: Mapping[str, Any]) -> None:
        if self.drop_keys:
            stats = {k: v for k, v in stats.items() if k not in self.drop_keys}
        for logger in self.loggers:
            try:
                logger.log(step, stats)
            except Exception as exc:  # noqa: BLE001 - a logger must never stop training
                print(f"[TeeLogger] {type(logger).__name__} failed: {exc!r}", file=sys.stderr)

    def close(self) -> None:
        for logger in self.loggers:
            close = getattr(logger, "close", None)
            if callable(close):
                close()


class RichLiveLogger:
    """Live dashboard (train / eval / perf panels + sparkline); use as a context manager or call close()."""

    def __init__(
        self,
        keys: Sequence[str] | None = None,
        spark_key: str = "avg_total_reward",
        history: int = 100,
        spark_window: int = 50,
        precision: int = 4,
        console: Any = None,
        live: Any = None,
    ):
        from rich.console import Console
        from rich.live import Live

        self.keys, self.spark_key, self.precision = list(keys) if keys else None, spark_key, precision
        self.spark_window = spark_window
        self.values: deque[float] = deque(maxlen=history)
        self.train: dict[str, Any] = {}
        self.eval: dict[str, Any] = {}
        self.perf: dict[str, Any] = {}
        self.step = 0
        self.eval_step: Any = None
        self.phase: str | None = None
        self.total_steps: int | None = None
        self.warnings: list[str] = []
        self.console = console or Console()
        self.live = live or Live(console=self.console, refresh_per_second=4, transient=False)
        self._started = False

    @staticmethod
    def _panel_of(key: str) -> str:
        if key.startswith(("eval/", "eval_")):
            return "eval"
        if key.startswith(("perf/", "gpu_")):
            return "perf"
        return "train"

    def _table(self, title: str, values: Mapping[str, Any]) -> Any:
        from rich.panel import Panel
        from rich.table import Table

        table = Table.grid(padding=(0, 1))
        table.add_column(style="cyan", no_wrap=True)
        table.add_column(justify="right")
        for key in sorted(values):
            table.add_row(key, _fmt(values[key], self.precision))
        return Panel(table, title=title, border_style="blue")

    def render(self) -> Any:
        from rich.columns import Columns
        from rich.console import Group
        from rich.text import Text

        width = max(10, (self.console.width or 80) - len(self.spark_key) - 20)
        spark = sparkline(list(self.values), min(len(self.values), self.spark_window, width))
        last = f" {_fmt(self.values[-1], self.precision)}" if self.values else ""
        eval_title = "eval" if self.eval_step is None else f"eval (step {self.eval_step})"
        counter = f"{self.step}/{self.total_steps}" if self.total_steps is not None else str(self.step)
        phase = f"{self.phase}  " if self.phase else ""
        parts = [
            Text(f"{phase}step {counter}   {self.spark_key} {spark}{last}"),
            Columns(
                [self._table("train", self.train), self._table(eval_title, self.eval), self._table("perf", self.perf)]
            ),
        ]
        if self.warnings:
            from rich.panel import Panel

            parts.append(Panel(Text("\n".join(self.warnings)), title="warnings", border_style="yellow"))
        return Group(*parts)

    def set_phase(self, phase: str | None, total_steps: int | None = None) -> None:
        """Show `phase step N/total_steps` in the header; the train panel and sparkline start afresh."""
        self.phase, self.total_steps = phase, total_steps
        self.train.clear()
        self.values.clear()

    def warn(self, message: str) -> None:
        """Add a line to the warnings panel (and refresh the dashboard when it is showing)."""
        self.warnings.append(message)
        if self._started:
            self.live.update(self.render(), refresh=True)
        else:
            self.console.print(f"[yellow]WARNING:[/yellow] {message}")

    def log(self, step: int, stats: Mapping[str, Any]) -> None:
        self.step = step
        for key, value in stats.items():
            if self.keys and key not in self.keys and self._panel_of(key) == "train":
                continue
            getattr(self, self._panel_of(key))[key] = value
        if "eval/step" in stats:
            self.eval_step = stats["eval/step"]
        spark = stats.get(self.spark_key, stats.get(f"train/{self.spark_key}"))
        if isinstance(spark, (int, float)):
            self.values.append(float(spark))
        if not self._started:
            self.live.start()
            self._started = True
        self.live.update(self.render(), refresh=True)

    def close(self) -> None:
        if self._started:
            self.live.stop()
            self._started = False

    def __enter__(self) -> RichLiveLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class WandbLogger:
    """Weights & Biases logging (`pip install 'ludic-fast[wandb]'`); imported on construction only."""

    def __init__(
        self,
        init_kwargs: Mapping[str, Any] | None = None,
        *,
        project: str | None = None,
        name: str | None = None,
        group: str | None = None,
        tags: Sequence[str] | None = None,
        notes: str | None = None,
        config: Mapping[str, Any] | None = None,
        dir: str | None = None,
        mode: str | None = None,
    ):
        try:
            import wandb
        except ImportError as exc:
            raise ImportError("WandbLogger needs the optional package wandb: pip install 'ludic-fast[wandb]'") from exc
        kwargs = dict(init_kwargs or {})
        kwargs.setdefault("project", project or os.environ.get("WANDB_PROJECT") or "Ludic")
        for key, value in (
            ("name", name),
            ("group", group),
            ("tags", tags),
            ("notes", notes),
            ("config", dict(config) if config else None),
            ("dir", dir),
            ("mode", mode),
        ):
            if value is not None:
                kwargs.setdefault(key, value)
        self._wandb = wandb
        self.run = wandb.init(**kwargs)

    def log(self, step: int, stats: Mapping[str, Any]) -> None:
        self._wandb.log(dict(stats), step=step)

    def close(self) -> None:
        self._wandb.finish()

    def __enter__(self) -> WandbLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def plot_curves(
    records: Iterable[Mapping[str, Any]],
    path: str | os.PathLike[str],
    *,
    reward_key: str = "train/avg_total_reward",
    loss_key: str = "train/loss",
    eval_key: str = "eval/reward",
    title: str = "ludic-fast",
    no_reward_phases: Sequence[str] = ("sft",),
) -> Path:
    """PNG with two panels: reward (train, and eval when logged) and loss against step, one line per
    `phase` (records without a phase form one line); phases in `no_reward_phases` (SFT: no rollouts,
    its logged reward is a placeholder 0) get no train-reward line. Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for r in records:
        phase = str(r.get("phase", "train"))
        for key in (reward_key, loss_key, eval_key):
            if key == reward_key and phase in no_reward_phases:
                continue
            value = r.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value) and "step" in r:
                series.setdefault((key, phase), []).append((float(r["step"]), float(value)))
    fig, (ax_r, ax_l) = plt.subplots(1, 2, figsize=(11, 4))
    for (key, phase), pts in sorted(series.items()):
        ax = ax_l if key == loss_key else ax_r
        xs, ys = zip(*pts)
        label = f"{phase} {key}"
        ax.plot(xs, ys, marker="o" if key == eval_key else None, markersize=3, label=label)
    for ax, name in ((ax_r, "reward"), (ax_l, "loss")):
        ax.set_xlabel("step")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


__all__ = [
    "PrintLogger",
    "RichLiveLogger",
    "JSONLLogger",
    "keep_jsonl_records",
    "TeeLogger",
    "WandbLogger",
    "plot_curves",
    "read_jsonl",
    "sparkline",
    "SPARK_BLOCKS",
]
