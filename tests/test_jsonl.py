"""ludic_fast.data.jsonl.jsonl_objects: line numbers, blank lines, and the file:line error for a bad line."""

from __future__ import annotations

import pytest

from ludic_fast.data.jsonl import jsonl_objects
from ludic_fast.rollout.offline import OfflineBatchSource


def test_jsonl_objects_numbers_lines_and_skips_blanks(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"a": 1}\n\n  \n{"b": [2]}\n', encoding="utf-8")
    assert jsonl_objects(path) == [(1, {"a": 1}), (4, {"b": [2]})]


@pytest.mark.parametrize("line, why", [('{"a": 1', "Expecting ',' delimiter at column 8"), ("[1, 2]", "a list")])
def test_jsonl_objects_names_file_and_line(tmp_path, line, why):
    path = tmp_path / "d.jsonl"
    path.write_text('{"a": 1}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="^" + str(path) + ":2: not a JSON object") as err:
        jsonl_objects(path)
    assert why in str(err.value)


def test_offline_source_reports_the_bad_line(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text('{"messages": []}\nnot json\n', encoding="utf-8")
    with pytest.raises(ValueError, match=":2: not a JSON object"):
        OfflineBatchSource.from_chat_jsonl(path, tokenizer=None)
