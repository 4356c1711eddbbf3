"""Tool-call parsers on outputs written the way each model family writes them, and
streaming that agrees with whole-answer extraction however the text is split."""

from __future__ import annotations

import json
import random

import pytest

from laneserve.tool_calls import get_parser
from laneserve.tool_calls.choice import ToolPlan, forced_schema, plan
from laneserve.tool_calls.stream import (
    CallArray,
    CallDelta,
    NamedCall,
    ParsedCalls,
    extract,
    merge_calls,
)

# (parser, model output, expected content, expected [(name, arguments)])
CASES = [
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
        '{"zone": "CET"}}\n</tool_call>',
        "Let me check.\n",
        [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "CET"})],
    ),
    (  # Qwen stops at EOS without the closing tag
        "hermes",
        '<tool_call>\n{"name": "search", "arguments": {"q": "ünïcode <tags>"}}\n',
        None,
        [("search", {"q": "ünïcode <tags>"})],
    ),
    (
        "hermes",
        "No tools needed: 2 < 3 and <b>bold</b>.",
        "No tools needed: 2 < 3 and <b>bold</b>.",
        [],
    ),
    (  # a marker with no valid call in it stays content
        "hermes",
        "<tool_call>\nnot json\n</tool_call>",
        "<tool_call>\nnot json\n</tool_call>",
        [],
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        None,
        [("get_weather", {"city": "Oslo"})],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}',
        None,
        [("a", {}), ("b", {"x": 1})],
    ),
    ("llama3_json", "The answer is {42}.", "The answer is {42}.", []),
    (
        "deepseek_v3",
        "I will look it up.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
        'get_weather\n```json\n{"city": "Lima"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>'
        'function<｜tool▁sep｜>get_time\n```json\n{"zone": "PET"}\n```<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜>",
        "I will look it up.",
        [("get_weather", {"city": "Lima"}), ("get_time", {"zone": "PET"})],
    ),
    (
        "deepseek_v31",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Quito"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        None,
        [("get_weather", {"city": "Quito"})],
    ),
]


def _calls(found: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in found]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_whole_answer(parser: str, text: str, content: str | None, calls: list) -> None:
    found = extract(ParsedCalls(get_parser(parser)), text)
    assert found.content == content
    assert _calls(found.calls) == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in found.calls)
    assert len({c["id"] for c in found.calls}) == len(found.calls)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_streaming_agrees_however_split(parser: str, text: str, content, calls) -> None:
    rng = random.Random(0)
    for trial in range(30):
        stream = ParsedCalls(get_parser(parser))
        events, pos = [], 0
        while pos < len(text):
            step = 1 if trial == 0 else rng.randint(1, 12)
            events += stream.feed(text[pos : pos + step])
            pos += step
        events += stream.finish()
        streamed = "".join(e for e in events if isinstance(e, str))
        assert (streamed or None) == content or (streamed == "" and content is None)
        assert _calls(merge_calls([e for e in events if isinstance(e, CallDelta)])) == calls


def test_content_is_sent_before_the_answer_ends() -> None:
    """Text before a marker streams at once; only a possible marker start is held."""
    stream = ParsedCalls(get_parser("hermes"))
    assert stream.feed("Sure, ") == ["Sure, "]
    assert stream.feed("one moment <tool") == ["one moment "]
    assert stream.feed("_call>\n") == []
    [call] = stream.feed('{"name": "f", "arguments": {}}\n</tool_call>')
    assert isinstance(call, CallDelta) and call.name == "f" and call.id


def test_parallel_calls_off_keeps_the_first() -> None:
    text = CASES[0][1]
    found = extract(ParsedCalls(get_parser("hermes"), max_calls=1), text)
    assert _calls(found.calls) == [("get_weather", {"city": "Paris", "unit": "celsius"})]


def test_named_call_streams_its_arguments() -> None:
    stream = NamedCall("get_weather")
    first, second = stream.feed('{"city": '), stream.feed('"Rome"}')
    assert first[0].name == "get_weather" and first[0].id and second[0].id is None
    assert stream.finish() == []
    assert _calls(merge_calls(first + second)) == [("get_weather", {"city": "Rome"})]


def test_required_array() -> None:
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    assert _calls(extract(CallArray(), text).calls) == [("a", {"x": 1}), ("b", {})]
    cut = extract(CallArray(), '[{"name": "a", "param')  # max_tokens: no call
    assert cut.calls == [] and cut.content == '[{"name": "a", "param'


TOOLS = [
    {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
    {"name": "ping", "parameters": None},
]


def test_forced_schemas() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert forced_schema(TOOLS, named, True) == TOOLS[0]["parameters"]
    assert forced_schema(TOOLS, "auto", True) is None
    required = forced_schema(TOOLS, "required", False)
    assert required is not None and required["minItems"] == 1 and required["maxItems"] == 1
    names = [i["properties"]["name"]["enum"] for i in required["items"]["anyOf"]]
    assert names == [["get_weather"], ["ping"]]
    with pytest.raises(ValueError, match="no tool named 'nope'"):
        forced_schema(TOOLS, {"type": "function", "function": {"name": "nope"}}, True)


def test_plans() -> None:
    assert plan(None, None, True, None) is None
    assert plan(TOOLS, "none", True, "hermes") is None
    auto = plan(TOOLS, None, True, "hermes")
    assert auto is not None and auto.mode == "auto" and auto.parser is not None
    assert auto.parser.name == "hermes" and auto.max_calls is None
    assert plan(TOOLS, "required", True, None) == ToolPlan("required")
    with pytest.raises(ValueError, match="--enable-auto-tool-choice"):
        plan(TOOLS, None, True, None)
    with pytest.raises(ValueError, match="only allowed when tools are given"):
        plan(None, "required", True, "hermes")
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        get_parser("mystery")


def test_finish_reasons() -> None:
    assert ToolPlan("required").finish_reason("stop", True) == "tool_calls"
    assert ToolPlan("named", name="f").finish_reason("stop", True) == "stop"
    assert ToolPlan("auto", get_parser("hermes")).finish_reason("stop", False) == "stop"
    assert ToolPlan("auto", get_parser("hermes")).finish_reason("length", True) == "length"
