"""Tool calling through the real `openai` client against `laneserve serve` (tiny
random Qwen2 model, the ChatML tool template from examples/, the hermes parser).

Random weights never choose to call a tool on their own, so "required" and named
choices (which the grammar enforces) carry most checks; "auto" runs with an
output constraint that makes the model write a call, and with one that makes it
answer in plain text, so the whole path (template, generation, parser, response
and stream shapes) runs for real."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict

from laneserve.frontend.tokenizer import Tokenizer
from tests.server.conftest import Server, start_server, stop_server
from tests.tiny_models import build_tiny_model

TEMPLATE = Path(__file__).parents[2] / "examples" / "tool_chat_template_chatml.jinja"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
PING = {
    "type": "function",
    "function": {
        "name": "ping",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
TOOLS = [WEATHER, PING]
BOOKING = {
    "type": "function",
    "function": {
        "name": "book_table",
        "description": "Reserve a restaurant table",
        "parameters": {
            "type": "object",
            "properties": {
                "restaurant": {"type": "string", "enum": ["Rosa", "Kato"]},
                "people": {"type": "integer", "minimum": 1, "maximum": 12},
                "outdoor": {"type": "boolean"},
                "budget": {"type": "number"},
            },
            "required": ["restaurant", "people", "outdoor"],
            "additionalProperties": False,
        },
    },
}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
COMPACT = {
    "structured_outputs": {"disable_any_whitespace": True}
}  # random weights: no free whitespace
CALL_REGEX = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)", '
    r'"days": [1-7]\}\}\n</tool_call>'
)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tool prompt is long in a 320-token vocabulary: a longer context."""
    return build_tiny_model(tmp_path_factory.mktemp("tools"), "qwen2", seed=2, max_positions=2048)


@pytest.fixture(scope="module")
def tiny(model: Path) -> Iterator[Server]:
    s = start_server(
        model,
        "--max-model-len", "2048", "--max-num-seqs", "8", "--chat-template", str(TEMPLATE),
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    )  # fmt: skip
    yield s
    stop_server(s)


def _valid_weather(arguments: str) -> dict:
    args = json.loads(arguments)
    assert set(args) == {"city", "days"} and args["city"] in ("Paris", "Oslo", "Lima")
    assert 1 <= args["days"] <= 7
    return args


def _check_call(name: str, arguments: str) -> None:
    if name == "get_weather":
        _valid_weather(arguments)
    else:
        assert name == "ping" and json.loads(arguments) == {}


def _streamed(tiny: Server, **kw) -> tuple[str, list[dict], str | None]:
    """(content, tool calls, finish reason) assembled from stream chunks."""
    content, calls, reason = "", {}, None
    for chunk in tiny.client().chat.completions.create(model="tiny", stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for tc in ch.delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                assert entry["id"] is None, "a call's id comes once"
                entry["id"], entry["name"] = tc.id, tc.function.name
            entry["arguments"] += tc.function.arguments or ""
        reason = ch.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


def test_required_calls_validate(tiny: Server) -> None:
    for temperature in (0.0, 1.0):
        out = tiny.client().chat.completions.create(
            model="tiny", messages=USER, tools=TOOLS, tool_choice="required",
            temperature=temperature, max_tokens=120, n=2, extra_body=COMPACT,
        )  # fmt: skip
        for choice in out.choices:
            assert choice.finish_reason == "tool_calls"
            assert choice.message.content is None and choice.message.tool_calls
            for call in choice.message.tool_calls:
                assert call.type == "function" and call.id.startswith("call_")
                _check_call(call.function.name, call.function.arguments)


def test_required_call_satisfies_the_chosen_tools_schema(tiny: Server) -> None:
    """Every tool has required keys of several types (no `ping` to fall back on), so
    whichever tool the model picks, the grammar must have held it to that tool's own
    parameters: each call validates against its schema with `jsonschema`."""
    tools = [WEATHER, BOOKING]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    ask = [{"role": "user", "content": "Book a table for four outside at Rosa tonight."}]
    names = set()
    for temperature, seed in ((0.0, None), (1.0, 5)):
        out = tiny.client().chat.completions.create(
            model="tiny", messages=ask, tools=tools, tool_choice="required",
            parallel_tool_calls=False, temperature=temperature, seed=seed, max_tokens=120, n=3,
            extra_body=COMPACT,
        )  # fmt: skip
        for choice in out.choices:
            assert choice.finish_reason == "tool_calls"
            [call] = choice.message.tool_calls
            names.add(call.function.name)
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    assert names <= set(schemas)


def test_named_choice_streams_the_same_call(tiny: Server) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(
        messages=USER,
        tools=TOOLS,
        tool_choice=named,
        temperature=0,
        max_tokens=60,
        extra_body=COMPACT,
    )
    out = tiny.client().chat.completions.create(model="tiny", **kw)
    [call] = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and out.choices[0].finish_reason == "stop"
    args = _valid_weather(call.function.arguments)
    content, calls, reason = _streamed(tiny, **kw)
    assert content == "" and reason == "stop"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", args)]


def test_parallel_tool_calls_false_gives_one_call(tiny: Server) -> None:
    out = tiny.client().chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        temperature=1.0, seed=3, max_tokens=120, n=4, extra_body=COMPACT,
    )  # fmt: skip
    assert all(len(c.message.tool_calls) == 1 for c in out.choices)


def test_auto_reads_a_call_the_model_wrote(tiny: Server) -> None:
    kw = dict(
        messages=USER, tools=TOOLS, temperature=0, max_tokens=200,
        extra_body={"structured_outputs": {"regex": CALL_REGEX}},
    )  # fmt: skip
    out = tiny.client().chat.completions.create(model="tiny", **kw)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    args = _valid_weather(call.function.arguments)
    content, calls, reason = _streamed(tiny, **kw)
    assert (content, reason) == ("", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", args)]


def test_auto_plain_answer_is_content(tiny: Server) -> None:
    kw = dict(
        messages=USER, tools=TOOLS, temperature=0, max_tokens=40,
        extra_body={"structured_outputs": {"choice": ["It is sunny <b>today</b>.", "No idea."]}},
    )  # fmt: skip
    out = tiny.client().chat.completions.create(model="tiny", **kw)
    choice = out.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content in ("It is sunny <b>today</b>.", "No idea.")
    assert _streamed(tiny, **kw) == (choice.message.content, [], "stop")


def test_history_with_calls_reaches_the_template(tiny: Server, model: Path) -> None:
    """The assistant's calls and the tool's answer are rendered: the prompt's token
    count equals the template's rendering of the same conversation."""
    first = tiny.client().chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, tool_choice="required", temperature=0,
        max_tokens=120, extra_body=COMPACT,
    )  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    history = [
        *USER,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"},
    ]
    second = tiny.client().chat.completions.create(
        model="tiny", messages=history, tools=TOOLS, tool_choice="none", max_tokens=4, temperature=0
    )
    assert second.choices[0].message.tool_calls is None
    tok = Tokenizer(model, str(TEMPLATE))
    rendered = [
        *USER,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": json.loads(call.function.arguments),
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"},
    ]
    ids = tok.apply_chat_template(rendered, True, tools=TOOLS)
    assert "<tool_response>\n18 C and sunny" in tok.decode(ids, False)
    assert second.usage.prompt_tokens == len(ids)
    # and the answer is the model's greedy continuation of exactly that rendering
    plain = tiny.client().completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0)
    assert second.choices[0].message.content == plain.choices[0].text
    assert second.usage.completion_tokens == plain.usage.completion_tokens >= 1


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        (dict(tool_choice="required"), "only allowed when tools are given"),
        (
            dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
            "no tool named 'nope'",
        ),
        (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "colour": "red"}}]), "colour"),
        (
            dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
            "cannot be combined",
        ),
        (
            dict(
                tools=[
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}
                ],
                tool_choice="required",
            ),
            "not a usable JSON schema",
        ),
        (
            dict(
                tools=TOOLS,
                messages=[
                    {
                        "role": "user",
                        "content": "x",
                        "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{}"}}],
                    }
                ],
            ),
            "only assistant messages carry tool_calls",
        ),
    ],
)
def test_bad_tool_requests_are_400(tiny: Server, kw: dict, needle: str) -> None:
    kw = {"messages": USER, "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as err:
        tiny.client().chat.completions.create(model="tiny", **kw)
    assert needle in str(err.value)
    assert tiny.greedy()  # and the server goes on


class _Place(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "Oslo"]


class _Trip(BaseModel):
    model_config = ConfigDict(extra="forbid")
    to: _Place
    back: _Place | None = None


NESTED = {"type": "function", "function": {"name": "trip", "parameters": _Trip.model_json_schema()}}


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "trip"}}, "auto", "none"]
)
def test_local_defs_in_tool_parameters_for_every_choice(tiny: Server, choice: object) -> None:
    """Pydantic writes nested models as `$ref: "#/$defs/..."`: every tool_choice
    takes them (required moves each tool's schema under its own `$defs`)."""
    assert "$defs" in NESTED["function"]["parameters"]
    forced = choice not in ("auto", "none")
    out = tiny.client().chat.completions.create(
        model="tiny", messages=USER, tools=[NESTED, PING], tool_choice=choice,
        temperature=0, max_tokens=120, extra_body=COMPACT if forced else None,
    )  # fmt: skip
    msg = out.choices[0].message
    if not forced:
        return  # NOTE: not constrained: the answer is the model's (the request is valid)
    assert msg.tool_calls, msg
    for call in msg.tool_calls:
        if call.function.name == "trip":
            _Trip.model_validate_json(call.function.arguments)
        else:
            assert call.function.name == "ping" and json.loads(call.function.arguments) == {}
