"""DSML tool calls (DeepSeek V3.2 `deepseek_v32`, V4 `deepseek_v4`): what the chat
formats write for a turn's calls parses back to the same calls, streamed in any
pieces and collected alike; malformed markup never becomes a call."""

from __future__ import annotations

import json
import random

import pytest

from laneserve.chat_formats import deepseek_v4, deepseek_v32
from laneserve.tool_calls import get_parser
from laneserve.tool_calls.stream import ParsedCalls, extract, merge_calls

CALLS = [
    {"id": "c1", "type": "function",
     "function": {"name": "get_weather", "arguments": json.dumps({"city": "Zürich <b>", "days": 3}, ensure_ascii=False)}},
    {"id": "c2", "type": "function",
     "function": {"name": "plan", "arguments": json.dumps(
         {"steps": [1, {"x": None}], "ok": True, "note": "line1\nline2 \"q\""})}},
]  # fmt: skip


def _answer(parser: str, content: str) -> str:
    """The assistant turn as the chat format writes it, minus the end-of-sentence."""
    msg = [{"role": "assistant", "content": content, "tool_calls": CALLS}]
    if parser == "deepseek_v4":
        text = deepseek_v4.encode(msg, False)
    else:
        text = deepseek_v32.encode(msg, False)
    return text.removeprefix(deepseek_v4.BOS).removesuffix(deepseek_v4.EOS)


def _pairs(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("parser", ["deepseek_v32", "deepseek_v4"])
@pytest.mark.parametrize("content", ["", "Let me look that up."])
def test_round_trip_streamed_and_collected_agree(parser: str, content: str) -> None:
    text = _answer(parser, content)
    whole = extract(ParsedCalls(get_parser(parser)), text)
    assert whole.content == (content or None)
    assert _pairs(whole.calls) == _pairs(CALLS)
    assert [c["function"]["arguments"] for c in whole.calls] == [
        c["function"]["arguments"] for c in CALLS
    ]  # the arguments text itself survives
    rng = random.Random(0)
    for _ in range(20):
        stream, events, i = ParsedCalls(get_parser(parser)), [], 0
        while i < len(text):
            n = rng.randint(1, 7)
            events += stream.feed(text[i : i + n])
            i += n
        events += stream.finish()
        streamed = "".join(e for e in events if isinstance(e, str))
        assert streamed == content
        assert _pairs(merge_calls([e for e in events if not isinstance(e, str)])) == _pairs(CALLS)


def test_each_parser_reads_only_its_own_block() -> None:
    v4_text = _answer("deepseek_v4", "x")
    assert extract(ParsedCalls(get_parser("deepseek_v32")), v4_text).calls == []
    assert extract(ParsedCalls(get_parser("deepseek_v4")), v4_text).calls


@pytest.mark.parametrize(
    "bad",
    [
        '<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="n" string="false">not json'
        "</｜DSML｜parameter>\n</｜DSML｜invoke>",
        '<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" string="true">1</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="a" string="true">2</｜DSML｜parameter>\n</｜DSML｜invoke>',
        '<｜DSML｜invoke name="f">\nstray text\n</｜DSML｜invoke>',
        '<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" string="true">open',  # cut short
    ],
)
def test_malformed_invokes_are_not_calls(bad: str) -> None:
    text = f"hi\n\n<｜DSML｜tool_calls>\n{bad}\n</｜DSML｜tool_calls>"
    found = extract(ParsedCalls(get_parser("deepseek_v4")), text)
    assert found.calls == [] and found.content == text


def test_registered_for_the_serve_flag() -> None:
    from laneserve.tool_calls import PARSERS

    assert {"deepseek_v32", "deepseek_v4"} <= set(PARSERS)
