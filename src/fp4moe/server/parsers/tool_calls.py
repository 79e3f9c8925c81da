"""The qwen3_coder tool-call format, parsed into OpenAI ``tool_calls``:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Argument values are typed by the tool's JSON schema (integer, number, boolean, object/array as JSON,
string otherwise; one newline either side of a value is dropped). A call is emitted only once its
``</tool_call>`` has arrived, whole (id, name and arguments in one delta): a call cut off by ``max_tokens``
or the end of the output is never a call but content, streamed or not, and every ``arguments`` string is
valid JSON (non-finite numbers stay strings). Text outside tool calls is content.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass, field

from fp4moe.server.parsers.reasoning import partial_tag_suffix

START, END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


def _schema_types(tools: list[dict] | None) -> dict[str, dict[str, str]]:
    types: dict[str, dict[str, str]] = {}
    for tool in tools or []:
        fn = tool.get("function", tool)
        props = ((fn.get("parameters") or {}).get("properties")) or {}
        types[fn.get("name", "")] = {k: (v or {}).get("type", "string") for k, v in props.items()}
    return types


def _strict_json(text: str):
    """``json.loads`` without NaN/Infinity, which are not JSON."""
    return json.loads(text, parse_constant=_no_constant)


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def convert_value(raw: str, kind: str | list | None):
    """A parameter's text as the JSON type its schema declares; the text itself where it does not convert
    to a value JSON can carry (NaN, infinities, too deep)."""
    value = raw[1:] if raw.startswith("\n") else raw
    value = value[:-1] if value.endswith("\n") else value
    converted = _convert(value, kind)
    try:
        json.dumps(converted, allow_nan=False)
    except (ValueError, RecursionError):
        return value
    return converted


def _convert(value: str, kind: str | list | None):
    kinds = kind if isinstance(kind, list) else [kind]
    for k in kinds:
        try:
            if k == "integer":
                return int(value.strip())
            if k == "number":
                number = float(value.strip())
                if not math.isfinite(number):
                    continue
                return (
                    int(number)
                    if number.is_integer() and "." not in value and "e" not in value.lower()
                    else number
                )
            if k == "boolean" and value.strip().lower() in ("true", "false"):
                return value.strip().lower() == "true"
            if k in ("object", "array"):
                return _strict_json(value)
            if k == "null" and value.strip().lower() in ("null", "none"):
                return None
        except (ValueError, RecursionError):  # JSONDecodeError, a number past 4,300 digits, deep nesting
            continue
    if kind is None:  # unknown parameter: JSON if it parses, else the string
        try:
            return _strict_json(value)
        except (ValueError, RecursionError):
            return value
    return value


class ToolCallParser:
    def __init__(self, tools: list[dict] | None = None):
        self.types = _schema_types(tools)
        self._buffer = ""
        self._in_call = False
        self.calls: list[dict] = []  # completed calls: {"id", "name", "arguments"}

    def feed(self, delta: str) -> ParsedDelta:
        self._buffer += delta
        out = ParsedDelta()
        while True:
            if not self._in_call:
                i = self._buffer.find(START)
                if i < 0:
                    keep = partial_tag_suffix(self._buffer, START)
                    out.content += self._buffer[: len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return out
                out.content += self._buffer[:i]
                self._buffer = self._buffer[i + len(START) :]
                self._in_call = True
            j = self._buffer.find(END)
            if j < 0:  # held back until the call is complete: a cut-off call must never look finished
                return out
            block, self._buffer = self._buffer[:j], self._buffer[j + len(END) :]
            self._in_call = False
            call = self._parse_call(block)
            if call is None:  # no <function=NAME>: not a call, the markup stays text
                out.content += START + block + END
                continue
            self._buffer = self._buffer.lstrip("\n")
            self.calls.append(call)
            arguments = json.dumps(call["arguments"], ensure_ascii=False, allow_nan=False)
            out.tool_calls.append(
                ToolCallDelta(len(self.calls) - 1, id=call["id"], name=call["name"], arguments=arguments)
            )

    def _parse_call(self, block: str) -> dict | None:
        m = _FUNCTION.search(block)
        if m is None or not m.group(1).strip():
            return None
        name = m.group(1).strip()
        types = self.types.get(name, {})
        arguments = {}
        for p in _PARAMETER.finditer(block, m.end()):
            key = p.group(1).strip()
            arguments[key] = convert_value(p.group(2), types.get(key))
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "name": name, "arguments": arguments}

    def finish(self) -> ParsedDelta:
        """Flush held-back text; an unterminated call is returned as plain content."""
        out = ParsedDelta(content=(START if self._in_call else "") + self._buffer)
        self._buffer, self._in_call = "", False
        return out


def parse_tool_calls(text: str, tools: list[dict] | None = None) -> tuple[str, list[dict]]:
    """(content, OpenAI tool_calls) of a whole output."""
    parser = ToolCallParser(tools)
    content = parser.feed(text).content + parser.finish().content
    calls = openai_tool_calls(parser.calls)
    return content.strip() if calls else content, calls


def openai_tool_calls(calls: list[dict]) -> list[dict]:
    """Completed calls ({"id", "name", "arguments"}) as OpenAI ``tool_calls`` (arguments as a JSON string)."""
    return [
        {
            "id": c["id"],
            "type": "function",
            "function": {
                "name": c["name"],
                "arguments": json.dumps(c["arguments"], ensure_ascii=False, allow_nan=False),
            },
        }
        for c in calls
    ]
