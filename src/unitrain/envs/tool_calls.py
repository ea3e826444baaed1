"""Tool calls in the text of an assistant turn, in the formats the chat templates write them: parse_turn
reads a decoded turn into an AssistantTurn (its content, its calls and what was wrong with the malformed
ones), render_call writes one call as the template does.

  hermes       Qwen2.5, Qwen3, Hermes: any number of blocks
               <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
               ("arguments" may also be a JSON string holding the object, as some models write it)
  llama3_json  Llama 3.1/3.2: the reply is one JSON object {"name": ..., "parameters": {...}}, optionally
               after <|python_tag|>; a reply that does not start with "{" is a plain answer

Either format accepts "arguments" or "parameters" for the arguments. A malformed call never raises: it
becomes an entry of `tool_call_errors` saying what was expected, the feedback the environment gives.
"""

from __future__ import annotations

import json
import re

from unitrain.envs.base import AssistantTurn, ToolCall

FORMATS = ("hermes", "llama3_json")

_EXPECTED = {
    "hermes": '<tool_call>\n{"name": "...", "arguments": {...}}\n</tool_call>',
    "llama3_json": '{"name": "...", "parameters": {...}}',
}
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()
_WHITESPACE = re.compile(r"\s*")
_CALL_SEPARATOR = re.compile(r"\s*;?\s*")  # after a call: whitespace and at most one ";"


def parse_turn(text: str, fmt: str) -> AssistantTurn:
    """The decoded assistant turn `text` (no end-of-turn token) with its tool calls in format `fmt`."""
    if fmt == "hermes":
        content, calls, errors = _parse_hermes(text)
    elif fmt == "llama3_json":
        content, calls, errors = _parse_llama3_json(text)
    else:
        raise ValueError(f"unknown tool-call format '{fmt}' (formats: {', '.join(FORMATS)})")
    return AssistantTurn(text=text, content=content, tool_calls=tuple(calls), tool_call_errors=tuple(errors))


def render_call(call: ToolCall, fmt: str) -> str:
    """One call as the chat template writes it in an assistant turn (json.dumps is the templates' tojson)."""
    arguments = json.dumps(call.arguments, ensure_ascii=False)
    name = json.dumps(call.name, ensure_ascii=False)
    if fmt == "hermes":
        return f'{_HERMES_OPEN}\n{{"name": {name}, "arguments": {arguments}}}\n{_HERMES_CLOSE}'
    if fmt == "llama3_json":
        return f'{{"name": {name}, "parameters": {arguments}}}'
    raise ValueError(f"unknown tool-call format '{fmt}' (formats: {', '.join(FORMATS)})")


def _parse_hermes(text: str) -> tuple[str, list[ToolCall], list[str]]:
    outside, calls, errors = [], [], []
    position = 0
    while (start := text.find(_HERMES_OPEN, position)) >= 0:
        outside.append(text[position:start])
        position = _hermes_call(text, start + len(_HERMES_OPEN), calls, errors)
    outside.append(text[position:])
    return "".join(outside).strip(), calls, errors


def _hermes_call(text: str, body_start: int, calls: list[ToolCall], errors: list[str]) -> int:
    """Reads the call whose body starts at `body_start`; returns the position after its </tool_call>."""
    try:  # one JSON value, then the closing tag: a string argument may itself hold "</tool_call>"
        value, end = _DECODER.raw_decode(text, _WHITESPACE.match(text, body_start).end())
        close = _WHITESPACE.match(text, end).end()
        if text.startswith(_HERMES_CLOSE, close):
            _add_parsed_call(value, "hermes", calls, errors)
            return close + len(_HERMES_CLOSE)
    except json.JSONDecodeError:
        pass
    end = text.find(_HERMES_CLOSE, body_start)
    if end < 0:  # the rest of the turn is the unfinished call, not content
        errors.append(f"{_HERMES_OPEN} without {_HERMES_CLOSE}; expected {_EXPECTED['hermes']}")
        return len(text)
    _add_call(text[body_start:end], "hermes", calls, errors)  # says what is wrong with the body
    return end + len(_HERMES_CLOSE)


def _parse_llama3_json(text: str) -> tuple[str, list[ToolCall], list[str]]:
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG) :].lstrip()
    if not body.startswith("{"):
        return text.strip(), [], []
    calls, errors = [], []
    position = 0
    # One object is the template's form; more, separated by ";", is how some servers emit parallel calls.
    while position < len(body) and body[position] == "{":
        try:
            value, position = _DECODER.raw_decode(body, position)
        except json.JSONDecodeError as e:
            errors.append(_invalid_json(e, "llama3_json"))
            return "", calls, errors
        _add_parsed_call(value, "llama3_json", calls, errors)
        position = _CALL_SEPARATOR.match(body, position).end()
    return body[position:].strip(), calls, errors


def _add_call(body: str, fmt: str, calls: list[ToolCall], errors: list[str]) -> None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        errors.append(_invalid_json(e, fmt))
        return
    _add_parsed_call(value, fmt, calls, errors)


def _add_parsed_call(value, fmt: str, calls: list[ToolCall], errors: list[str]) -> None:
    """The decoded JSON `value` as a call, or the reason it is none."""
    expected = f"expected {_EXPECTED[fmt]}"
    if not isinstance(value, dict):
        errors.append(f"a tool call must be a JSON object; {expected}")
        return
    name = value.get("name")
    if not isinstance(name, str) or not name:
        errors.append(f'a tool call needs a "name" string; {expected}')
        return
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass  # reported below as arguments that are no object
    if not isinstance(arguments, dict):
        errors.append(f"the arguments of '{name}' must be a JSON object; {expected}")
        return
    calls.append(ToolCall(name=name, arguments=arguments))


def _invalid_json(error: json.JSONDecodeError, fmt: str) -> str:
    return f"invalid JSON in a tool call ({error.msg} at character {error.pos}); expected {_EXPECTED[fmt]}"
