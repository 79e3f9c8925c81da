"""Reasoning and qwen3_coder tool-call parsers, whole and streamed at every split point."""

import json

import pytest

from fp4moe.server.parsers.reasoning import ReasoningParser, split_reasoning
from fp4moe.server.parsers.tool_calls import ToolCallParser, convert_value, parse_tool_calls

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "coords": {"type": "object"},
                    "ratio": {"type": "number"},
                },
            },
        },
    }
]


def _stream_reasoning(text, chunk, opened=True):
    p = ReasoningParser(opened)
    r = c = ""
    for i in range(0, len(text), chunk):
        d = p.feed(text[i : i + chunk])
        r, c = r + d.reasoning, c + d.content
    d = p.finish()
    return r + d.reasoning, c + d.content


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 100])
def test_reasoning_split_streamed_at_any_boundary(chunk):
    text = "I should add 2 and 2.\n</think>\n\nThe answer is 4."
    assert _stream_reasoning(text, chunk) == ("I should add 2 and 2.\n", "The answer is 4.")
    assert _stream_reasoning("<think>hmm</think>ok", chunk, opened=False) == ("hmm", "ok")
    assert _stream_reasoning("no tags at all", chunk, opened=False) == ("", "no tags at all")
    assert _stream_reasoning("cut short while thinking <", chunk) == ("cut short while thinking <", "")


def test_split_reasoning_whole():
    assert split_reasoning("a\n</think>\n\nb") == ("a", "b")
    assert split_reasoning("plain", prompt_opened_think=False) == (None, "plain")


def test_tool_call_parsed_and_typed_by_schema():
    text = (
        "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
        '<parameter=coords>\n{"lat": 48.9}\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n'
        "</function>\n</tool_call>"
    )
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "Let me check."
    assert len(calls) == 1 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {
        "city": "Paris",
        "days": 3,
        "metric": True,
        "coords": {"lat": 48.9},
        "ratio": 0.5,
    }


@pytest.mark.parametrize("chunk", [1, 4, 9, 1000])
def test_tool_calls_streamed_fragments_concatenate_to_json(chunk):
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>"
    )
    p = ToolCallParser(TOOLS)
    content, calls = "", {}
    for i in range(0, len(text), chunk):
        d = p.feed(text[i : i + chunk])
        content += d.content
        for tc in d.tool_calls:
            entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            entry["id"] = entry["id"] or tc.id
            entry["name"] = entry["name"] or tc.name
            entry["arguments"] += tc.arguments
    content += p.finish().content
    assert content.strip() == ""
    assert [c["name"] for c in calls.values()] == ["get_weather", "get_weather"]
    assert [json.loads(c["arguments"]) for c in calls.values()] == [{"city": "Oslo"}, {}]
    assert all(c["id"] for c in calls.values())


def test_unterminated_call_stays_content():
    content, calls = parse_tool_calls("text <tool_call>\n<function=get_weather>\n<parameter=city>\nX")
    assert calls == [] and content.startswith("text <tool_call>")


def test_value_conversion():
    assert convert_value("\n42\n", "integer") == 42
    assert convert_value("4x", "integer") == "4x"  # not an integer: kept as the text
    assert convert_value("\n[1, 2]\n", "array") == [1, 2]
    assert convert_value("hello", None) == "hello" and convert_value("7", None) == 7
    assert convert_value("\n  two lines\nhere\n", "string") == "  two lines\nhere"
