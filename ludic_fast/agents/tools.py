"""Tools as plain Python functions, their JSON schema, and parsing the model's tool calls.

`Tool.from_function(fn)` reads the schema from the signature and the docstring: the first paragraph is the
description, a Google-style "Args:" section gives each parameter's description, annotations give the JSON
types (str -> string, int -> integer, float -> number, bool -> boolean, list -> array, dict -> object);
parameters without a default are required. The schema is the OpenAI / transformers function form that
chat templates render from `apply_chat_template(..., tools=[...])`.

Tool calls are parsed from the model's text in the template's format. `HermesToolCallParser` reads the
Hermes / Qwen form `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (one block per call); a block
that is not a JSON object with a str "name" and an object "arguments" is a malformed call, reported as an
error string (the runner answers it with an error observation). Parsing never raises on model text.
"""

from __future__ import annotations

import inspect
import json
import re
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ludic_fast.agents.protocol import ToolCall

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
_ARG_LINE = re.compile(r"^\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _json_type(annotation: Any, where: str) -> dict[str, Any]:
    origin = typing.get_origin(annotation) or annotation
    if origin in _JSON_TYPES:
        return {"type": _JSON_TYPES[origin]}
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if len(args) == 1:  # Optional[X]
        return _json_type(args[0], where)
    raise TypeError(f"{where}: annotation {annotation!r} has no JSON type (use str, int, float, bool, list or dict)")


def _doc_parts(doc: str) -> tuple[str, dict[str, str]]:
    """(description = first paragraph, {parameter: description} from an "Args:" section)."""
    doc = inspect.cleandoc(doc or "")
    description = doc.split("\n\n", 1)[0].strip().replace("\n", " ")
    params: dict[str, str] = {}
    in_args = False
    for line in doc.splitlines():
        if line.strip() in ("Args:", "Arguments:", "Parameters:"):
            in_args = True
            continue
        if in_args:
            if line and not line[0].isspace():
                break
            m = _ARG_LINE.match(line)
            if m:
                params[m.group(1)] = m.group(2).strip()
    return description, params


@dataclass(frozen=True)
class Tool:
    """A callable tool: `name`, `fn` (plain or `async def`) and its OpenAI function `schema`."""

    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]

    @classmethod
    def from_function(cls, fn: Callable[..., Any], *, name: str | None = None) -> Tool:
        """The tool of a plain function (module docstring); a parameter without a JSON type is a TypeError."""
        if not callable(fn):
            raise TypeError(f"a tool must be a callable, got {type(fn).__name__}")
        tool_name = name or fn.__name__
        hints = typing.get_type_hints(fn)
        description, docs = _doc_parts(fn.__doc__ or "")
        props: dict[str, Any] = {}
        required = []
        for p in inspect.signature(fn).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise TypeError(f"tool {tool_name}: *args / **kwargs have no schema")
            where = f"tool {tool_name}, parameter {p.name}"
            props[p.name] = {**(_json_type(hints[p.name], where) if p.name in hints else {"type": "string"})}
            if p.name in docs:
                props[p.name]["description"] = docs[p.name]
            if p.default is p.empty:
                required.append(p.name)
        schema = {
            "type": "function",
            "function": {
                "name": tool_name,
                "description": description,
                "parameters": {"type": "object", "properties": props, "required": required},
            },
        }
        return cls(tool_name, fn, schema)

    def check_arguments(self, arguments: dict[str, Any]) -> str | None:
        """None when `arguments` fit the schema's names (required present, none unknown), else why not."""
        params = self.schema["function"]["parameters"]
        unknown = sorted(set(arguments) - set(params["properties"]))
        missing = [p for p in params["required"] if p not in arguments]
        if unknown:
            return f"tool {self.name} has no parameter(s) {', '.join(unknown)}"
        if missing:
            return f"tool {self.name} needs parameter(s) {', '.join(missing)}"
        return None


def as_tools(tools: Sequence[Tool | Callable[..., Any]] | None) -> dict[str, Tool]:
    """{name: Tool} of Tools or plain functions; a repeated name is a ValueError."""
    out: dict[str, Tool] = {}
    for t in tools or ():
        tool = t if isinstance(t, Tool) else Tool.from_function(t)
        if tool.name in out:
            raise ValueError(f"two tools are named {tool.name!r}")
        out[tool.name] = tool
    return out


@dataclass
class ParsedTurn:
    """A turn's text split into its content (the text outside tool-call markup), calls, and malformed-call errors."""

    content: str
    calls: list[ToolCall]
    errors: list[str]


class ToolCallParser(Protocol):
    def __call__(self, text: str) -> ParsedTurn: ...


@dataclass(frozen=True)
class HermesToolCallParser:
    """`<tool_call>{"name": str, "arguments": {...}}</tool_call>` blocks (Hermes, Qwen 2.5 / 3 templates).

    An opening tag without its closing tag is malformed too (a call cut off by the token limit)."""

    open_tag: str = "<tool_call>"
    close_tag: str = "</tool_call>"

    def __call__(self, text: str) -> ParsedTurn:
        calls: list[ToolCall] = []
        errors: list[str] = []
        content: list[str] = []
        rest = text
        while True:
            start = rest.find(self.open_tag)
            if start < 0:
                content.append(rest)
                break
            content.append(rest[:start])
            end = rest.find(self.close_tag, start)
            if end < 0:
                errors.append(f"tool call without {self.close_tag}: {rest[start:start + 80]!r}")
                break
            body = rest[start + len(self.open_tag) : end]
            rest = rest[end + len(self.close_tag) :]
            call, error = parse_call_json(body)
            if call is not None:
                calls.append(call)
            else:
                errors.append(error)
        return ParsedTurn("".join(content).strip(), calls, errors)


def parse_call_json(body: str) -> tuple[ToolCall | None, str]:
    """(the call, "") of a JSON object {"name": str, "arguments": object | JSON string}, else (None, why)."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return None, f"tool call is not valid JSON ({exc.msg} at {exc.pos}): {body.strip()[:80]!r}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, f"tool call needs a JSON object with a string 'name': {body.strip()[:80]!r}"
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None, f"tool call {obj['name']}: 'arguments' is a string that is not JSON"
    if not isinstance(args, dict):
        return None, f"tool call {obj['name']}: 'arguments' must be a JSON object"
    return ToolCall(obj["name"], args), ""


PARSERS: dict[str, Callable[[], ToolCallParser]] = {"hermes": HermesToolCallParser}


__all__ = ["Tool", "as_tools", "ParsedTurn", "ToolCallParser", "HermesToolCallParser", "parse_call_json", "PARSERS"]
