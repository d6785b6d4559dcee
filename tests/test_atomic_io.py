"""atomic_io: a write replaces the file whole, and a write that fails leaves the old file and no temp file."""

from __future__ import annotations

import json
import os

import pytest

from ludic_fast.run.atomic_io import atomic_write_json, atomic_write_text


def test_write_creates_parents_and_replaces(tmp_path):
    path = tmp_path / "a" / "b" / "state.json"
    atomic_write_json(path, {"step": 1, "b": [1, 2]})
    assert json.loads(path.read_text()) == {"step": 1, "b": [1, 2]}
    atomic_write_text(path, "second")
    assert path.read_text() == "second"
    assert sorted(p.name for p in path.parent.iterdir()) == ["state.json"]


def test_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "results.md"
    atomic_write_text(path, "old table")

    def broken_fsync(fd):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk gone"):
        atomic_write_text(path, "new table that never lands")
    assert path.read_text() == "old table"
    assert [p.name for p in tmp_path.iterdir()] == ["results.md"]  # the temp file was removed
