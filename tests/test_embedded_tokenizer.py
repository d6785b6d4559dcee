"""The embedded character tokenizer: printable ASCII with the demo alphabet's ids unchanged."""

from __future__ import annotations

import string

from ludic_fast.embedded.tokenizer import ASCII_CHARACTERS, CHARACTERS, build_char_tokenizer


def test_ascii_tokenizer_covers_printable_ascii_and_keeps_the_demo_ids():
    small, full = build_char_tokenizer(), build_char_tokenizer(ASCII_CHARACTERS)
    assert len(small) == 4 + len(CHARACTERS) == 47
    printable = "".join(sorted(set(string.printable) - set("\r\x0b\x0c")))
    ids = full(printable, add_special_tokens=False)["input_ids"]
    assert full.unk_token_id not in ids and len(ids) == len(printable)
    assert full.decode(ids) == printable
    # a text of the demo alphabet has the same ids under both
    assert full(CHARACTERS, add_special_tokens=False)["input_ids"] == small(CHARACTERS, add_special_tokens=False)[
        "input_ids"] == list(range(4, 47))
    # the demo's chat format is unchanged: user text, then answer + <eos>
    chat = [{"role": "user", "content": "37+48="}, {"role": "assistant", "content": "85"}]
    assert small.apply_chat_template(chat, tokenize=False) == "37+48=85<eos>"
    assert small(printable, add_special_tokens=False)["input_ids"].count(small.unk_token_id) == len(
        set(printable) - set(CHARACTERS))
