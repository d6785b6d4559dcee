"""A character-level tokenizer built in code (a `tokenizers` WordLevel model wrapped in
`PreTrainedTokenizerFast`): one token per character, no download, saveable with `save_pretrained`."""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARACTERS = "0123456789+-*=:| abcdefghijklmnopqrstuvwxyz"
#: user turns are copied, assistant turns end with <eos>: prompt = user text, completion = answer + <eos>.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}<eos>{% endif %}{% endfor %}"


def build_char_tokenizer(characters: str = CHARACTERS) -> PreTrainedTokenizerFast:
    """Tokenizer with ids `<pad>=0, <bos>=1, <eos>=2, <unk>=3`, then one id per character of `characters`."""
    if len(set(characters)) != len(characters):
        raise ValueError("characters must not repeat")
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *characters])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok
