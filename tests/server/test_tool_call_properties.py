"""Property test of the qwen3_coder tool-call parser over random and adversarial outputs, cut at every
position and streamed in random pieces: no call is emitted before its ``</tool_call>``, every ``arguments``
string is strict JSON, and streamed and whole parses agree."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp4moe.server.parsers.tool_calls import END, ToolCallParser, parse_tool_calls

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {
                    "n": {"type": "number"},
                    "i": {"type": "integer"},
                    "o": {"type": "object"},
                    "b": {"type": "boolean"},
                    "s": {"type": "string"},
                },
            },
        },
    }
]
PIECES = [
    "<tool_call>", "</tool_call>", "<tool_call>\n<function=f>\n", "<function=f>", "<function=g>",
    "<function=>", "<function= \n", "</function>", "</function>\n</tool_call>", "<parameter=n>",
    "<parameter=i>", "<parameter=o>", "<parameter=b>", "<parameter=s>", "<parameter=u>", "<parameter=>",
    "</parameter>", "\n", "NaN", "nan", "-Infinity", "inf", "1e999", "3", "2.5", "true", '{"a": NaN}',
    '{"a": 1}', "[" * 3000, "9" * 5000, "<", "<tool", "</tool_", "<tool_call", "x", "é", "\"", "\\",
]  # fmt: skip
VALUES = [
    "NaN", "nan", "-Infinity", "inf", "1e999", "3", "2.5", "true", "null", '{"a": NaN}', '{"a": 1}', "[1, 2]",
    "[" * 3000, "9" * 5000, "\n7\n", "", "<", "x</parameter", "é\"\\",
]  # fmt: skip
PARAMETER = st.builds(
    "<parameter={}>{}</parameter>\n".format, st.sampled_from(["n", "i", "o", "b", "s", "u", ""]),
    st.one_of(st.sampled_from(VALUES), st.text(max_size=4)),
)  # fmt: skip
CALL = st.builds(
    lambda name, params, tail: f"<tool_call>\n<function={name}>\n{''.join(params)}{tail}",
    st.sampled_from(["f", "g", "", " "]), st.lists(PARAMETER, max_size=3),
    st.sampled_from(["</function>\n</tool_call>", "</tool_call>", "</function>", ""]),
)  # fmt: skip
NOISE = st.one_of(st.sampled_from(PIECES), st.text(max_size=4))
OUTPUTS = st.lists(st.one_of(CALL, NOISE), max_size=8).map("".join)
SETTINGS = settings(
    max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


def _strict(arguments: str) -> dict:
    def refuse(name):
        raise AssertionError(f"{name} in arguments")

    value = json.loads(arguments, parse_constant=refuse)
    assert isinstance(value, dict)
    return value


def _streamed(text: str, cuts: list[int]) -> tuple[str, list[tuple[str, dict]]]:
    parser, content, calls = ToolCallParser(TOOLS), "", {}
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    for a, b in zip(bounds, bounds[1:], strict=False):
        d = parser.feed(text[a:b])
        content += d.content
        for tc in d.tool_calls:
            assert tc.id and tc.name  # a call arrives whole: id, name and arguments together
            assert tc.index not in calls
            calls[tc.index] = (tc.name, _strict(tc.arguments))
    content += parser.finish().content
    return content, [calls[i] for i in sorted(calls)]


@SETTINGS
@given(OUTPUTS, st.lists(st.integers(0, 10_000), max_size=6))
def test_no_call_before_its_end_and_arguments_always_json(text, cuts):
    _, whole = parse_tool_calls(text, TOOLS)
    full = [(c["function"]["name"], _strict(c["function"]["arguments"])) for c in whole]
    for cut in range(len(text) + 1):
        prefix = text[:cut]
        content, calls = parse_tool_calls(prefix, TOOLS)
        assert len(calls) <= prefix.count(END)
        got = [(c["function"]["name"], _strict(c["function"]["arguments"])) for c in calls]
        assert got == full[: len(got)]  # a cut never changes a call already complete
        if not calls:
            assert content == prefix  # nothing of an unfinished call is lost: it is all content
    streamed_content, streamed = _streamed(text, cuts)
    whole_content, _ = parse_tool_calls(text, TOOLS)
    assert streamed == full
    assert streamed_content.strip() == whole_content.strip()
