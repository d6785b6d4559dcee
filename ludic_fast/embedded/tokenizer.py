"""A character-level tokenizer built in code (a `tokenizers` WordLevel model wrapped in
`PreTrainedTokenizerFast`): one token per character, no download, saveable with `save_pretrained`.

Two alphabets: `CHARACTERS` (digits, + - * = : |, space, lower-case letters; the demo's, 47 ids with the
specials) and `ASCII_CHARACTERS`, every printable ASCII character plus newline and tab, whose first ids are
exactly `CHARACTERS`' (the others are appended after them), so a text of the small alphabet has the same ids
under both.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARACTERS = "0123456789+-*=:| abcdefghijklmnopqrstuvwxyz"
#: printable ASCII (and newline, tab): CHARACTERS first, the rest appended in code-point order
ASCII_CHARACTERS = CHARACTERS + "".join(
    c for c in sorted(set(string.printable) - set("\r\x0b\x0c")) if c not in CHARACTERS
)
#: user, system and tool turns are copied (a tool result inside <tool_response> tags); an assistant turn is its
#: content, its tool calls as Hermes `<tool_call>{json}</tool_call>` blocks, then <eos>. For user/assistant
#: messages this is prompt = user text, completion = answer + <eos>.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}<eos>"
    "{% elif m['role'] == 'tool' %}<tool_response>{{ m['content'] }}</tool_response>"
    "{% else %}{{ m['content'] }}{% endif %}"
    "{% endfor %}"
)


def build_char_tokenizer(characters: str = CHARACTERS) -> PreTrainedTokenizerFast:
    """Tokenizer with ids `<pad>=0, <bos>=1, <eos>=2, <unk>=3`, then one id per character of `characters`
    (`ASCII_CHARACTERS` for printable ASCII)."""
    if len(set(characters)) != len(characters):
        raise ValueError("characters must not repeat")
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *characters])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok
