"""Reasoning parsers: the thinking is split off the answer the same way streamed
(in any pieces) and collected; `deepseek_v3` / `deepseek_v4` only read it when the
request turns thinking on; combined with DSML tool calls after the thinking."""

from __future__ import annotations

import json
import random

import pytest

from laneserve.entrypoints.chat_parsing import ChoiceParser, delta_of, message_of
from laneserve.reasoning import Thought, reasoning_plan
from laneserve.reasoning.parsers import split
from laneserve.tool_calls.choice import ToolPlan
from laneserve.tool_calls.registry import get_parser

R1 = reasoning_plan("deepseek_r1", None)

CASES = [  # (answer, reasoning, content)
    ("Let me think.\nOK.</think>The answer is 4.", "Let me think.\nOK.", "The answer is 4."),
    ("<think>\nwritten by the model</think>\n\nHi", "\nwritten by the model", "\n\nHi"),
    ("cut short before the end", "cut short before the end", ""),  # all reasoning
    ("</think>only content", "", "only content"),
    ("a < b and </thin k> is not the tag</think>x", "a < b and </thin k> is not the tag", "x"),
]


@pytest.mark.parametrize(("text", "thought", "content"), CASES)
def test_split_and_streaming_agree(text: str, thought: str, content: str) -> None:
    assert R1 is not None
    got_thought, got_content = split(R1, text)
    assert (got_thought or "", got_content) == (thought, content)
    rng = random.Random(1)
    for _ in range(30):
        stream, events, i = R1.stream(), [], 0
        while i < len(text):
            n = rng.randint(1, 4)
            events += stream.feed(text[i : i + n])
            i += n
        events += stream.finish()
        assert "".join(e.text for e in events if isinstance(e, Thought)) == thought
        assert "".join(e for e in events if isinstance(e, str)) == content


def test_plans_follow_the_parser_and_the_request() -> None:
    assert reasoning_plan(None, {"thinking": True}) is None
    assert reasoning_plan("deepseek_r1", None) is not None
    for name in ("deepseek_v3", "deepseek_v4"):
        assert reasoning_plan(name, None) is None
        assert reasoning_plan(name, {"thinking": False}) is None
        assert reasoning_plan(name, {"thinking": True}) is not None
        assert reasoning_plan(name, {"enable_thinking": True}) is not None
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        reasoning_plan("qwen3", None)


def test_reasoning_then_dsml_tool_calls() -> None:
    answer = (
        "I need the weather.</think>Checking.\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )
    tools = ToolPlan("auto", get_parser("deepseek_v4"))
    plan = reasoning_plan("deepseek_v4", {"thinking": True})
    whole = message_of(ChoiceParser(plan, tools).feed(answer, True), reasoning=True)
    assert whole["reasoning_content"] == "I need the weather."
    assert whole["content"] == "Checking."
    assert [json.loads(c["function"]["arguments"]) for c in whole["tool_calls"]] == [
        {"city": "Paris"}
    ]
    parser, deltas = ChoiceParser(plan, tools), []
    for i in range(0, len(answer), 3):
        deltas += [delta_of(e) for e in parser.feed(answer[i : i + 3], False)]
    deltas += [delta_of(e) for e in parser.feed("", True)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "I need the weather."
    assert "".join(d.get("content", "") for d in deltas) == "Checking."
    assert parser.called


def test_without_reasoning_the_message_has_no_reasoning_field() -> None:
    msg = message_of(
        ChoiceParser(None, ToolPlan("auto", get_parser("hermes"))).feed("hi", True), False
    )
    assert msg == {"role": "assistant", "content": "hi"}
