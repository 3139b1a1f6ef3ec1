"""What crosses between a model and its tools: the calls parsed from one assistant turn
(`parse_tool_calls`: every `<tool_call>{"name", "arguments"}</tool_call>` block, the Hermes / Qwen
form), the arguments checked against a tool's JSON schema (`argument_problem`), and a call's
`ToolResult`: the observation text the model reads (`result_text`, `cap_text`, `exception_text`)
and its status. No tool runs here: running them is `rollout/tools.py`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TOOL_STATUSES = ("ok", "parse_error", "error", "infra_error")
MAX_CONTENT_CHARS = 8192
"""An observation longer than this keeps its head and tail (the sampler cuts it again, in tokens)."""
MAX_ERROR_CHARS = 300
"""An exception's `<ExceptionType>: <message>` is cut to this."""


# ---------------------------------------------------------------------------------------------
# Parsing one assistant turn.
@dataclass(frozen=True)
class ToolCall:
    """One `<tool_call>` block of a turn: `name` None (and `error` set) when it could not be parsed."""

    name: str | None
    arguments: dict
    error: str | None = None


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>...</tool_call>` block of ONE assistant turn's text, in order.

    The Hermes / Qwen2.5 form, `<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>`,
    whitespace and newlines inside allowed; "arguments" may also be a JSON string holding an object
    (as some templates emit) or absent (no arguments). An opened block never closed is one ToolCall
    with an error; no block: [].

    >>> parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    [ToolCall(name='add', arguments={'a': 1, 'b': 2}, error=None)]
    >>> parse_tool_calls('<tool_call>{"name": "add"')[0].error
    'block never closed (no </tool_call>)'
    """
    calls, position = [], 0
    while (start := text.find(_OPEN, position)) != -1:
        end = text.find(_CLOSE, start + len(_OPEN))
        if end == -1:
            calls.append(ToolCall(None, {}, f"block never closed (no {_CLOSE})"))
            break
        calls.append(_parse_block(text[start + len(_OPEN):end]))
        position = end + len(_CLOSE)
    return calls


def _parse_block(body: str) -> ToolCall:
    try:
        call = json.loads(body)
    except (ValueError, RecursionError) as error:
        return ToolCall(None, {}, f"invalid JSON: {error}")
    if not isinstance(call, dict):
        return ToolCall(None, {}, f'expected a JSON object {{"name": ..., "arguments": {{...}}}}, got {type(call).__name__}')
    name = call.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(None, {}, 'missing "name" (a non-empty string)')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError) as error:
            return ToolCall(None, {}, f'"arguments" is a string that is not JSON: {error}')
    if not isinstance(arguments, dict):
        return ToolCall(None, {}, f'"arguments" must be a JSON object, got {type(arguments).__name__}')
    return ToolCall(name, arguments)


# ---------------------------------------------------------------------------------------------
# Results.
@dataclass(frozen=True)
class ToolResult:
    """What one call gave: `content` is the observation the model sees (for a failure, a short
    error text it can learn from); `status` one of TOOL_STATUSES; `reason` for logs and counts."""

    content: str
    status: str
    reason: str = ""

    def __post_init__(self):
        if self.status not in TOOL_STATUSES:
            raise ValueError(f"status must be one of {TOOL_STATUSES}, got {self.status!r}")


def error_result(message: str, reason: str = "") -> ToolResult:
    """An `error` result: the model reads `error: <message>`; `reason` (default the message) is counted."""
    return ToolResult(f"error: {message}", "error", reason or message)


def timed_out_result(timeout_s: float) -> ToolResult:
    """The `error` result of a call that passed its deadline."""
    return error_result(f"timed out after {timeout_s:g}s", "timed out")


def cap_text(text: str, limit: int = MAX_CONTENT_CHARS) -> str:
    """`text` if at most `limit` characters, else its head and tail around a marker (`limit` in all).

    >>> cap_text("abcdefghij" * 3, 24)
    'abcdef\\n...[cut]...\\nfghij'
    """
    if len(text) <= limit:
        return text
    marker = "\n...[cut]...\n"
    room = max(limit - len(marker), 2)
    head = (room + 1) // 2
    return text[:head] + marker + text[len(text) - (room - head):]


def exception_text(error: BaseException) -> str:
    """`<ExceptionType>: <message>`, cut to MAX_ERROR_CHARS."""
    message = str(error)
    text = f"{type(error).__name__}: {message}" if message else type(error).__name__
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 3] + "..."


def result_text(value: Any) -> str:
    """A tool's return value as the text the model sees: a str as is, None as "null", JSON
    (compact) for numbers, bools, lists and dicts, `str()` for anything else.

    >>> result_text("hi"), result_text(None), result_text({"a": [1, 2.5]}), result_text(3)
    ('hi', 'null', '{"a":[1,2.5]}', '3')
    """
    if isinstance(value, str):
        return cap_text(value)
    if value is None or isinstance(value, (bool, int, float, list, tuple, dict)):
        try:
            return cap_text(json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str))
        except (TypeError, ValueError, RecursionError):
            pass
    return cap_text(str(value))


# ---------------------------------------------------------------------------------------------
# Arguments against the schema.
_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def _type_problem(value: Any, schema: dict) -> str | None:
    """Why `value` does not fit `schema` (type, nullable, enum, array items), or None."""
    if value is None and schema.get("nullable"):
        return None
    types = schema.get("type")
    types = [types] if isinstance(types, str) else list(types or [])
    if types and not any(_JSON_TYPES.get(name, lambda v: True)(value) for name in types):
        return f"must be {' or '.join(types)}, got {_json_type(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"must be one of {schema['enum']}, got {value!r}"
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            problem = _type_problem(item, schema["items"])
            if problem:
                return f"item {index} {problem}"
    return None


def _json_type(value: Any) -> str:
    return next((name for name in ("boolean", "integer", "number", "string", "array", "object", "null")
                 if _JSON_TYPES[name](value)), type(value).__name__)


def argument_problem(arguments: dict, parameters: dict) -> str | None:
    """Why `arguments` do not fit a function schema's `parameters`, naming the argument, or None.

    >>> argument_problem({"a": 1}, {"properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]})
    "missing required argument 'b'"
    >>> argument_problem({"a": "1"}, {"properties": {"a": {"type": "integer"}}})
    "argument 'a' must be integer, got string"
    """
    properties = parameters.get("properties", {})
    for name in arguments:
        if name not in properties:
            return f"unknown argument {name!r} (arguments: {', '.join(properties) or 'none'})"
    for name in parameters.get("required", []):
        if name not in arguments:
            return f"missing required argument {name!r}"
    for name, value in arguments.items():
        problem = _type_problem(value, properties[name])
        if problem:
            return f"argument {name!r} {problem}"
    return None
