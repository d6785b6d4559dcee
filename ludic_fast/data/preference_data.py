"""Datasets of the offline presets: JSONL formats, the embedded rows, tokenisation.

JSONL formats (one JSON object a line; text is tokenised like SFT data: the prompt in the rollouts'
format, the completion followed by EOS):

    pairs (dpo, ipo, simpo, orpo, reward)   {"prompt": str, "chosen": str, "rejected": str}
    kto                                     {"prompt": str, "completion": str, "label": bool}
    completions (distill)                   {"prompt": str, "completion": str}

The embedded rows are built from the addition task (`ludic_fast.embedded.AdditionTask`): chosen = the
right sum, rejected = a wrong one; KTO alternates right (label true) and wrong (false) answers; distillation
completions are the right sums.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from ludic_fast.data.jsonl import jsonl_objects
from ludic_fast.data.pair_batching import KTOExample, PreferencePair
from ludic_fast.embedded import AdditionTask
from ludic_fast.rollout.prompts import encode_prompt

FORMATS: dict[str, tuple[str, ...]] = {
    "pairs": ("prompt", "chosen", "rejected"),
    "kto": ("prompt", "completion", "label"),
    "completions": ("prompt", "completion"),
}


def read_rows(path: str | Path, fmt: str) -> list[dict[str, Any]]:
    """Rows of a JSONL file in format `fmt` (FORMATS); ValueError naming file:line for a bad row."""
    keys = FORMATS[fmt]
    rows = []
    for n, row in jsonl_objects(path):
        if any(k not in row for k in keys):
            raise ValueError(f"{path}:{n}: a {fmt} row needs the keys {list(keys)}")
        for k in keys:
            want = bool if k == "label" else str
            if not isinstance(row[k], want):
                raise ValueError(f"{path}:{n}: {k!r} must be a {want.__name__}")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def embedded_rows(fmt: str, n: int = 256, seed: int = 0) -> list[dict[str, Any]]:
    """`n` text rows of format `fmt` from the addition task's train split (module docstring)."""
    rng = random.Random(seed)
    rows = []
    for i, s in enumerate(AdditionTask(seed=seed).samples("train", n)):
        right = s["answer"]
        wrong = str(int(right) + rng.choice([-11, -10, -2, -1, 1, 2, 10, 11]) if int(right) > 11 else int(right) + 1)
        if fmt == "pairs":
            rows.append({"prompt": s["prompt"], "chosen": right, "rejected": wrong})
        elif fmt == "kto":
            rows.append({"prompt": s["prompt"], "completion": right if i % 2 == 0 else wrong, "label": i % 2 == 0})
        elif fmt == "completions":
            rows.append({"prompt": s["prompt"], "completion": right})
        else:
            raise ValueError(f"fmt must be one of {sorted(FORMATS)}, got {fmt!r}")
    return rows


def _completion(tok: Any, text: str) -> list[int]:
    ids = [int(t) for t in tok(text, add_special_tokens=False)["input_ids"]]
    if tok.eos_token_id is not None:
        ids.append(int(tok.eos_token_id))
    return ids


def encode_rows(rows: list[dict[str, Any]], fmt: str, tok: Any, *, chat_template: bool) -> list[Any]:
    """Token-id examples: PreferencePair (pairs), KTOExample (kto), (prompt_ids, completion_ids) (completions)."""
    out: list[Any] = []
    for r in rows:
        prompt = encode_prompt(tok, r["prompt"], chat_template=chat_template)
        if fmt == "pairs":
            out.append(PreferencePair(prompt, _completion(tok, r["chosen"]), _completion(tok, r["rejected"])))
        elif fmt == "kto":
            out.append(KTOExample(prompt, _completion(tok, r["completion"]), bool(r["label"])))
        else:
            out.append((prompt, _completion(tok, r["completion"])))
    return out


__all__ = ["FORMATS", "read_rows", "embedded_rows", "encode_rows"]
