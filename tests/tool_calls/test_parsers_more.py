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
