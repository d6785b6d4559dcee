"""NoPositiveResampling: retire, persist, restore, and crash safety of the history file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from ludic_fast.data.curriculum import NoPositiveResampling
from ludic_fast.data.types import SAWBatch, SAWItem
from ludic_fast.run.atomic_io import atomic_write_json


def _item(prompt_id, rollout_id, total_reward, step=0):
    return SAWItem(
        input_ids=[1, 2],
        attention_mask=[1, 1],
        action_mask=[0, 1],
        weight=0.0,
        meta={"request_meta": {"prompt_id": prompt_id}, "rollout_id": rollout_id, "total_reward": total_reward,
              "step_index": step},
    )


def test_retires_at_threshold_and_filters_later_epochs():
    npr = NoPositiveResampling(threshold=0.9)
    npr.observe("easy", [1.0] * 9 + [0.0])  # 9/10 = 0.9 -> retired (≥)
    npr.observe("hard", [1.0] * 8 + [0.0] * 2)  # 0.8 -> active
    npr.observe(3, [-1.0, 1.0])  # ±1 rewards: success is reward > 0 -> 0.5
    assert npr.pass_rate("easy") == pytest.approx(0.9) and npr.is_retired("easy")
    assert not npr.is_retired("hard") and npr.pass_rate(3) == 0.5 and npr.pass_rate("never") is None
    assert npr.active(["easy", "hard", 3, "never"]) == ["hard", 3, "never"]
    # retirement is permanent, and the pass rate accumulates over epochs
    npr.observe("hard", [1.0] * 10)  # 18/20 = 0.9
    assert npr.is_retired("hard")


def test_min_attempts_and_validation():
    npr = NoPositiveResampling(min_attempts=4)
    npr.observe("p", [1.0, 1.0, 1.0])
    assert not npr.is_retired("p")
    npr.observe("p", [1.0])
    assert npr.is_retired("p")
    with pytest.raises(ValueError, match="threshold"):
        NoPositiveResampling(threshold=0.0)
    with pytest.raises(ValueError, match="min_attempts"):
        NoPositiveResampling(min_attempts=0)


def test_preprocess_counts_each_rollout_once():
    npr = NoPositiveResampling()
    # rollout r1 has two steps (two items) and must count once
    items = [_item("a", "r1", 1.0), _item("a", "r1", 1.0, step=1), _item("a", "r2", 0.0), _item("b", "r3", 1.0)]
    batch = SAWBatch(items)
    assert npr.preprocess(batch) is batch and len(batch.items) == 4
    assert npr.history == {"a": [1, 2], "b": [1, 1]}
    assert npr.is_retired("b") and not npr.is_retired("a")
    with pytest.raises(ValueError, match="prompt_id"):
        npr.preprocess(SAWBatch([SAWItem([1], [1], [1], 0.0, meta={"total_reward": 1.0})]))


def test_persist_and_restore(tmp_path):
    path = tmp_path / "sub" / "npr.json"
    npr = NoPositiveResampling(path)
    npr.observe("a", [1.0, 1.0])
    npr.observe("b", [0.0, 1.0])
    state = json.loads(path.read_text())
    assert state["history"] == {"a": [2, 2], "b": [1, 2]} and state["retired"] == ["a"]
    restored = NoPositiveResampling(path)
    assert restored.history == npr.history and restored.retired == {"a"}
    assert restored.active(["a", "b"]) == ["b"]
    assert os.listdir(path.parent) == ["npr.json"]  # no temp files left behind
    other = NoPositiveResampling()
    other.load_state_dict(npr.state_dict())
    assert other.history == npr.history and other.retired == npr.retired
    with pytest.raises(ValueError, match="version"):
        other.load_state_dict({"version": 99, "history": {}, "retired": []})
    with pytest.raises(ValueError, match="successes, attempts"):
        other.load_state_dict({"version": 1, "history": {"a": [3, 2]}, "retired": []})


def test_failed_replace_leaves_old_file_intact(tmp_path, monkeypatch):
    path = tmp_path / "npr.json"
    npr = NoPositiveResampling(path)
    npr.observe("a", [1.0])
    before = path.read_bytes()

    def boom(src, dst):
        raise OSError("disk unplugged")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk unplugged"):
        npr.observe("b", [0.0] * 100)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["npr.json"]
    monkeypatch.undo()
    assert NoPositiveResampling(path).history == {"a": [1, 1]}


def test_kill_during_write_never_leaves_a_half_written_file(tmp_path):
    path = tmp_path / "npr.json"
    atomic_write_json(path, {"version": 1, "history": {"old": [1, 2]}, "retired": []})
    # The child writes a large history and is SIGKILLed inside fsync, after the temp file holds data
    # but before os.replace: the visible file must still be the old, complete one.
    script = textwrap.dedent(
        f"""
        import os, signal
        from ludic_fast.data.curriculum import NoPositiveResampling
        npr = NoPositiveResampling({str(path)!r})
        os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
        for i in range(2000):
            npr.history[f"prompt-{{i}}"] = [i % 3, 3]
        npr.save()
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    leftovers = [p for p in os.listdir(tmp_path) if p != "npr.json"]
    assert leftovers and os.path.getsize(tmp_path / leftovers[0]) > 0  # the crash really was mid-write
    restored = NoPositiveResampling(path)
    assert restored.history == {"old": [1, 2]}
