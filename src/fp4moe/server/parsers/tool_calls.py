"""The qwen3_coder tool-call format, parsed into OpenAI ``tool_calls``:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Argument values are typed by the tool's JSON schema (integer, number, boolean, object/array as JSON,
string otherwise; one newline either side of a value is dropped). Streaming emits the call's id and name
as soon as ``<function=NAME>`` is complete, then the JSON arguments a parameter at a time, so clients that
concatenate ``arguments`` fragments get valid JSON at the end. Text outside tool calls is content.
"""

from __future__ import annotations

import json
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


def convert_value(raw: str, kind: str | list | None):
    """A parameter's text as the JSON type its schema declares."""
    value = raw[1:] if raw.startswith("\n") else raw
    value = value[:-1] if value.endswith("\n") else value
    kinds = kind if isinstance(kind, list) else [kind]
    for k in kinds:
        try:
            if k == "integer":
                return int(value.strip())
            if k == "number":
                number = float(value.strip())
                return (
                    int(number)
                    if number.is_integer() and "." not in value and "e" not in value.lower()
                    else number
                )
            if k == "boolean" and value.strip().lower() in ("true", "false"):
                return value.strip().lower() == "true"
            if k in ("object", "array"):
                return json.loads(value)
            if k == "null" and value.strip().lower() in ("null", "none"):
                return None
        except (ValueError, RecursionError):  # JSONDecodeError, a number past 4,300 digits, deep nesting
            continue
    if kind is None:  # unknown parameter: JSON if it parses, else the string
        try:
            return json.loads(value)
        except (ValueError, RecursionError):
            return value
    return value


class ToolCallParser:
    def __init__(self, tools: list[dict] | None = None):
        self.types = _schema_types(tools)
        self._buffer = ""
        self._in_call = False
        self._index = -1
        self._name: str | None = None
        self._params_done = 0
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
                self._in_call, self._name, self._params_done = True, None, 0
                self._index += 1
                self.calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "name": None, "arguments": {}})
            call = self.calls[-1]
            if self._name is None:
                m = _FUNCTION.search(self._buffer)
                if m is None:
                    return out
                self._name = call["name"] = m.group(1).strip()
                out.tool_calls.append(ToolCallDelta(self._index, id=call["id"], name=self._name))
            types = self.types.get(self._name, {})
            params = list(_PARAMETER.finditer(self._buffer))
            for m in params[self._params_done :]:
                key = m.group(1).strip()
                value = convert_value(m.group(2), types.get(key))
                call["arguments"][key] = value
                prefix = "{" if self._params_done == 0 else ", "
                out.tool_calls.append(
                    ToolCallDelta(
                        self._index,
                        arguments=f"{prefix}{json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}",
                    )
                )
                self._params_done += 1
            j = self._buffer.find(END)
            if j < 0:
                return out
            out.tool_calls.append(ToolCallDelta(self._index, arguments="}" if self._params_done else "{}"))
            self._buffer = self._buffer[j + len(END) :].lstrip("\n")
            self._in_call = False

    def finish(self) -> ParsedDelta:
        """Flush held-back text; an unterminated call is returned as plain content."""
        out = ParsedDelta()
        if self._in_call:
            self.calls.pop()
            out.content = START + self._buffer
        else:
            out.content = self._buffer
        self._buffer = ""
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
            "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)},
        }
        for c in calls
    ]
