"""The mistral and pythonic parsers on outputs written as those models write them
(Mistral 7B v0.3's JSON list, the tokenizer-v11 `NAME[ARGS]{...}` form, Llama 3.2 /
4 pythonic lists), whole and streamed however split."""

from __future__ import annotations

import pytest

from laneserve.tool_calls import PARSERS
from tests.tool_calls import test_parsers as base

CASES = [
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"city": "San Francisco", '
        '"state": "CA", "unit": "fahrenheit"}}]',
        None,
        [("get_current_weather", {"city": "San Francisco", "state": "CA", "unit": "fahrenheit"})],
    ),
    (
        "mistral",
        'Sure.[TOOL_CALLS]get_current_weather[ARGS]{"city": "Dallas", "unit": "celsius"}'
        '[TOOL_CALLS]add[ARGS]{"a": 3.5, "b": [1, 2]}',
        "Sure.",
        [
            ("get_current_weather", {"city": "Dallas", "unit": "celsius"}),
            ("add", {"a": 3.5, "b": [1, 2]}),
        ],
    ),
    ("mistral", "No call here [TOOLS] at all.", "No call here [TOOLS] at all.", []),
    (
        "pythonic",
        "[get_weather(city='San Francisco', metric='celsius')]",
        None,
        [("get_weather", {"city": "San Francisco", "metric": "celsius"})],
    ),
    (
        "pythonic",
        "<|python_start|>[get_weather(city=\"Paris\", days=2), register_user(name='Jo', "
        "address={'city': 'Oslo'}, role=None, ok=True, tags=['a', 'b'], flag=true)]<|python_end|>",
        None,
        [
            ("get_weather", {"city": "Paris", "days": 2}),
            (
                "register_user",
                {
                    "name": "Jo",
                    "address": {"city": "Oslo"},
                    "role": None,
                    "ok": True,
                    "tags": ["a", "b"],
                    "flag": True,
                },
            ),
        ],
    ),
    ("pythonic", "The answer is 4.", "The answer is 4.", []),
]


def test_registered() -> None:
    assert {"mistral", "pythonic"} <= set(PARSERS)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_whole(parser: str, text: str, content: str | None, calls: list) -> None:
    base.test_whole_answer(parser, text, content, calls)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_streamed(parser: str, text: str, content: str | None, calls: list) -> None:
    base.test_streaming_agrees_however_split(parser, text, content, calls)


QWEN3_TOOLS = [
    {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "zip": {"type": "string"},
                "where": {"type": "object"},
            },
        },
    }
]
QWEN3_TEXT = (
    "I will look it up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n"
    "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
    "<parameter=zip>\n94103\n</parameter>\n<parameter=where>\n{'lat': 37.7, 'lon': -122.4}\n"
    "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=other>\n<parameter=n>\n"
    "[1, 2]\n</parameter>\n<parameter=note>\nline one\nline two\n</parameter>\n</function>\n</tool_call>"
)
QWEN3_CALLS = [
    (
        "get_weather",
        {
            "city": "San Francisco",
            "days": 3,
            "metric": True,
            "zip": "94103",
            "where": {"lat": 37.7, "lon": -122.4},
        },
    ),
    ("other", {"n": [1, 2], "note": "line one\nline two"}),
]


def test_qwen3_coder_types_values_by_the_schema() -> None:
    from laneserve.tool_calls import get_parser
    from laneserve.tool_calls.stream import CallDelta, ParsedCalls, extract, merge_calls

    found = extract(ParsedCalls(get_parser("qwen3_coder", QWEN3_TOOLS)), QWEN3_TEXT)
    assert found.content == "I will look it up.\n"
    assert base._calls(found.calls) == QWEN3_CALLS
    for step in (1, 5, 17):
        stream = ParsedCalls(get_parser("qwen3_coder", QWEN3_TOOLS))
        events = []
        for i in range(0, len(QWEN3_TEXT), step):
            events += stream.feed(QWEN3_TEXT[i : i + step])
        events += stream.finish()
        assert "".join(e for e in events if isinstance(e, str)) == "I will look it up.\n"
        assert (
            base._calls(merge_calls([e for e in events if isinstance(e, CallDelta)])) == QWEN3_CALLS
        )
