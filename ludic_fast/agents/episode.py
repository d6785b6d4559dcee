"""Token-exact multi-turn episodes: the sequence the trainer scores is built turn by turn from sampled ids.

The rule (why: re-rendering a conversation through its chat template and re-tokenising it changes earlier
tokens under many templates — reasoning stripped from earlier assistant turns, whitespace normalised,
merges across a turn boundary — so the trained tokens would differ from the sampled ones and the
importance ratio would be wrong):

    ids_0     = template(first messages, tools, add_generation_prompt=True)             context
    ids_{k+1} = ids_k ++ completion_k                                                     actions (sampled)
                      ++ close ++ delta(observations_k)                                   context

`completion_k` are the token ids the sampler returned for the prompt `ids_k`, kept verbatim with their
sampling log-probs; nothing already in the sequence is ever re-tokenised. `close` are the tokens the template
writes after an assistant turn's stop token (e.g. Qwen's "\\n" after <|im_end|>), and `delta(obs)` is the
template's rendering of the observation messages plus the next generation prompt, found by rendering a
stand-in conversation with and without them:

    A = template(first ++ [assistant "x"]),   B = template(first ++ [assistant "x"] ++ obs, gen. prompt)
    delta(obs) = B[len(A):]   (B must extend A, else ValueError: the template cannot be split per turn)
    close = A after its last stop token

Only sampled tokens are actions (action mask 1); the prompt, observation, tool-result and template tokens
are context (mask 0).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ludic_fast.agents.protocol import Message

_STAND_IN = "x"


def render_ids(tokenizer: Any, messages: Sequence[Message], *, tools: list[dict] | None,
               add_generation_prompt: bool, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of `messages` through the tokenizer's chat template (text rendered, then tokenised once)."""
    text = tokenizer.apply_chat_template(
        list(messages), tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=False,
        **(template_kwargs or {}),
    )
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


class ChatTokens:
    """The token ids of an episode's first prompt and of each observation, through a chat template.

    stop_ids: the sampler's stop tokens (the template's end-of-assistant-turn token must be one of them).
    tools: OpenAI tool schemas passed to the template (None: no tools).
    """

    def __init__(self, tokenizer: Any, stop_ids: Iterable[int], *, tools: list[dict] | None = None,
                 template_kwargs: dict[str, Any] | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("multi-turn episodes need a tokenizer with a chat template")
        self.tokenizer = tokenizer
        self.stop_ids = {int(t) for t in stop_ids}
        if not self.stop_ids:
            raise ValueError("stop_ids must name at least one token")
        self.tools = tools
        self.template_kwargs = dict(template_kwargs or {})

    def _render(self, messages: Sequence[Message], gen: bool) -> list[int]:
        return render_ids(self.tokenizer, messages, tools=self.tools, add_generation_prompt=gen,
                          template_kwargs=self.template_kwargs)

    def prompt_ids(self, first: Sequence[Message]) -> list[int]:
        """ids_0: the first messages with the generation prompt."""
        return self._render(first, True)

    def assistant_ids(self, first: Sequence[Message], assistant: Message) -> list[int]:
        """The tokens a model writes for `assistant` (content, tool calls, through its stop token), as the
        template renders them after `first`: for demonstrations (SFT in the rollouts' exact format)."""
        prompt = self.prompt_ids(first)
        full = self._render([*first, assistant], False)
        if full[: len(prompt)] != prompt:
            raise ValueError("the chat template's generation prompt is not a prefix of the rendered assistant turn")
        stops = [i for i in range(len(prompt), len(full)) if full[i] in self.stop_ids]
        if not stops:
            raise ValueError(
                f"the chat template ends an assistant turn with none of the stop tokens {sorted(self.stop_ids)}"
            )
        return full[len(prompt) : stops[-1] + 1]

    def observation_ids(self, first: Sequence[Message], assistant: Message, observations: Sequence[Message]
                        ) -> list[int]:
        """close ++ delta(observations) after an assistant turn that ended with a stop token (module docstring).

        `assistant` is the turn's message; only its tool calls are used (its content is replaced by a stand-in),
        so templates that render tool results after a tool-calling turn see one."""
        stand_in = {"role": "assistant", "content": _STAND_IN}
        if assistant.get("tool_calls"):
            stand_in["tool_calls"] = assistant["tool_calls"]
        a = self._render([*first, stand_in], False)
        b = self._render([*first, stand_in, *observations], True)
        if b[: len(a)] != a:
            raise ValueError(
                "the chat template renders a conversation differently once observations follow it, so its "
                "tokens cannot be split per turn"
            )
        stops = [i for i, t in enumerate(a) if t in self.stop_ids]
        if not stops:
            raise ValueError(
                f"the chat template writes none of the stop tokens {sorted(self.stop_ids)} after an assistant "
                "turn: give the sampler the template's end-of-turn token as a stop token"
            )
        return a[stops[-1] + 1 :] + b[len(a) :]


@dataclass
class TurnSpan:
    """Where one sampled turn sits in the episode's sequence: ids[start:end] are its completion tokens."""

    start: int
    end: int
    logprobs: list[float]
    finish_reason: str


@dataclass
class EpisodeTokens:
    """The growing token sequence of an episode: ids, action mask (1 = sampled), and the sampled turns."""

    ids: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    turns: list[TurnSpan] = field(default_factory=list)

    def add_context(self, ids: Sequence[int]) -> None:
        self.ids.extend(int(t) for t in ids)
        self.action_mask.extend([0] * len(ids))

    def add_turn(self, ids: Sequence[int], logprobs: Sequence[float], finish_reason: str) -> TurnSpan:
        if len(ids) != len(logprobs):
            raise ValueError(f"a turn has {len(ids)} token ids but {len(logprobs)} log-probs")
        span = TurnSpan(len(self.ids), len(self.ids) + len(ids), [float(x) for x in logprobs], finish_reason)
        self.ids.extend(int(t) for t in ids)
        self.action_mask.extend([1] * len(ids))
        self.turns.append(span)
        return span

    @property
    def action_logprobs(self) -> list[float]:
        """The sampling log-probs of every action token, in position order."""
        return [lp for span in self.turns for lp in span.logprobs]


def demonstration_tokens(chat: ChatTokens, messages: Sequence[Message]) -> EpisodeTokens:
    """A whole demonstrated conversation as an episode's tokens: every assistant turn an action (log-prob 0),
    built exactly as `EpisodeRunner` builds a sampled episode, so SFT on it trains the rollouts' format."""
    firsts = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
    if not firsts:
        raise ValueError("a demonstration needs messages before its first assistant turn, and one assistant turn")
    first = list(messages[:firsts])
    tokens = EpisodeTokens()
    tokens.add_context(chat.prompt_ids(first))
    i = firsts
    while i < len(messages):
        assistant = messages[i]
        ids = chat.assistant_ids(first, assistant)
        tokens.add_turn(ids, [0.0] * len(ids), "stop")
        j = i + 1
        while j < len(messages) and messages[j].get("role") != "assistant":
            j += 1
        if j < len(messages):
            tokens.add_context(chat.observation_ids(first, assistant, messages[i + 1 : j]))
        i = j
    return tokens


__all__ = ["render_ids", "ChatTokens", "TurnSpan", "EpisodeTokens", "demonstration_tokens"]
