"""The embedded default: a tiny causal LM built from a transformers config, a character-level tokenizer
built in code, and a built-in verifiable task, so `ludic-fast demo` runs on a bare CPU machine with no
download."""

from ludic_fast.embedded.model import TINY_MODEL_DEFAULTS, build_tiny_model
from ludic_fast.embedded.task import AdditionTask
from ludic_fast.embedded.tokenizer import build_char_tokenizer

__all__ = ["AdditionTask", "build_char_tokenizer", "build_tiny_model", "TINY_MODEL_DEFAULTS"]
