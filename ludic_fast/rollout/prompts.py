"""One prompt format for SFT, rollouts and evaluation.

With `chat_template=True` a task prompt is the tokenizer's chat template of one user message with the
generation prompt, and an SFT example is the template of [user: prompt, assistant: answer]
(`offline.chat_item`): the tokens the policy is trained to continue are exactly those it is rolled out
and evaluated on. With `chat_template=False` the prompt is the raw text's tokens and an SFT example is
prompt + answer + EOS. `resolve_chat_template(tokenizer, None)` picks the template whenever the
tokenizer has one.
"""

from __future__ import annotations

from typing import Any

from ludic_fast.data.types import SAWItem
from ludic_fast.rollout.dataset_source import _template_ids, chat_item


def has_chat_template(tokenizer: Any) -> bool:
    """True when `tokenizer.chat_template` is set."""
    return bool(getattr(tokenizer, "chat_template", None))


def resolve_chat_template(tokenizer: Any, chat_template: bool | None) -> bool:
    """`chat_template` itself, or (None) whether the tokenizer has a template; True without one raises."""
    if chat_template is None:
        return has_chat_template(tokenizer)
    if chat_template and not has_chat_template(tokenizer):
        raise ValueError("chat_template=True but the tokenizer has no chat template")
    return bool(chat_template)


def encode_prompt(tokenizer: Any, prompt: str, *, chat_template: bool) -> list[int]:
    """Token ids of a task prompt: template(user: prompt) + generation prompt, or the raw text's ids."""
    if chat_template:
        return _template_ids(tokenizer, [{"role": "user", "content": prompt}], True)
    return [int(t) for t in tokenizer(prompt)["input_ids"]]


def sft_item(tokenizer: Any, prompt: str, answer: str, *, chat_template: bool, meta: dict | None = None) -> SAWItem:
    """SAW item training `answer` after `prompt` in the same format `encode_prompt` rolls out."""
    if chat_template:
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        return chat_item(tokenizer, messages, meta)
    prompt_ids = encode_prompt(tokenizer, prompt, chat_template=False)
    action = [int(t) for t in tokenizer(answer, add_special_tokens=False)["input_ids"]]
    if tokenizer.eos_token_id is not None:
        action.append(int(tokenizer.eos_token_id))
    if not action:
        raise ValueError(f"answer {answer!r} tokenises to an empty action")
    ids = prompt_ids + action
    return SAWItem(
        input_ids=ids,
        attention_mask=[1] * len(ids),
        action_mask=[0] * len(prompt_ids) + [1] * len(action),
        weight=1.0,
        meta={"prompt_length": len(prompt_ids), "completion_length": len(action), **(meta or {})},
    )


__all__ = ["has_chat_template", "resolve_chat_template", "encode_prompt", "sft_item"]
