"""`/v1/responses` through the real `openai` client: create, `instructions`,
`max_output_tokens`, streaming events in order, structured output through
`text.format`, function tools (a forced call, then its result sent back), and
the refusals; plus `/tokenize`, `/detokenize`, `/ping`, `/v1/embeddings`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import QWEN2, Server

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
]


class Item(BaseModel):
    ok: bool
    count: int = Field(ge=0, le=99)


@pytest.fixture(scope="module")
def tiny(shared_server: Callable[..., Server]) -> Server:
    return shared_server("qwen2", *QWEN2)  # shared with test_structured_output


def chat_text(s: Server, messages: list[dict], max_tokens: int) -> tuple[str, dict]:
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    r = s.post("/v1/chat/completions", body).json()
    return r["choices"][0]["message"]["content"], r["usage"]


def test_create_matches_chat(tiny: Server) -> None:
    """`instructions` is the system message; the text equals the chat answer."""
    client = tiny.client()
    r = client.responses.create(
        model="tiny", input="Hello there", instructions="Be brief.", max_output_tokens=12,
        temperature=0,
    )  # fmt: skip
    text, usage = chat_text(
        tiny,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
        12,
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == text
    assert r.usage.input_tokens == usage["prompt_tokens"]
    assert r.usage.output_tokens == usage["completion_tokens"]
    assert r.instructions == "Be brief."
    if usage["completion_tokens"] == 12:
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed"


def test_max_output_tokens_and_item_input(tiny: Server) -> None:
    r = tiny.client().responses.create(
        model="tiny",
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Count"}]},
            {"role": "assistant", "content": "one"},
            {"role": "user", "content": "again"},
        ],
        max_output_tokens=3,
        temperature=0,
        extra_body={"top_k": 1},
    )
    assert r.usage.output_tokens <= 3
    text, _ = chat_text(
        tiny,
        [
            {"role": "user", "content": "Count"},
            {"role": "assistant", "content": "one"},
            {"role": "user", "content": "again"},
        ],
        3,
    )
    assert r.output_text == text


def test_stream_events_in_order(tiny: Server) -> None:
    client = tiny.client()
    events = list(
        client.responses.create(
            model="tiny", input="Hi", max_output_tokens=10, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", kinds[-1],
    ]  # fmt: skip
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert set(kinds[4:-4]) <= {"response.output_text.delta"}
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == deltas == events[-4].text
    whole = client.responses.create(model="tiny", input="Hi", max_output_tokens=10, temperature=0)
    assert whole.output_text == deltas


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_structured_output_text_format(tiny: Server, temperature: float) -> None:
    """Random weights: only the grammar makes the output parse."""
    r = tiny.client().responses.parse(
        model="tiny", input="Describe one item as JSON.", text_format=Item,
        max_output_tokens=80, temperature=temperature,
    )  # fmt: skip
    assert r.status == "completed", r.output_text
    assert isinstance(r.output_parsed, Item)
    json_object = tiny.client().responses.create(
        model="tiny", input="JSON please", text={"format": {"type": "json_object"}},
        max_output_tokens=80, temperature=temperature,
    )  # fmt: skip
    if json_object.status == "completed":
        assert isinstance(json.loads(json_object.output_text), dict)


def test_function_tools_round_trip(tiny: Server) -> None:
    client = tiny.client()
    r = client.responses.create(
        model="tiny", input="Weather in Paris?", tools=TOOLS, tool_choice="required",
        max_output_tokens=80, temperature=0,
    )  # fmt: skip
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls)
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    follow = client.responses.create(
        model="tiny",
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            *[{"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments} for c in calls],
            *[{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"} for c in calls],
        ],
        tools=TOOLS, tool_choice="none", max_output_tokens=5, temperature=0,
    )  # fmt: skip
    assert [o.type for o in follow.output] == ["message"]
    named = client.responses.create(
        model="tiny", input="x", tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=80, temperature=0, stream=True,
    )  # fmt: skip
    kinds = [e.type for e in named]
    assert "response.function_call_arguments.done" in kinds
    assert kinds.index("response.output_item.added") < kinds.index(
        "response.function_call_arguments.delta"
    )


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "input"),
    ],
)
def test_refusals_are_400(tiny: Server, extra: dict, field: str) -> None:
    r = tiny.post("/v1/responses", {"model": "tiny", "input": "hi", **extra})
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


def test_tokenize_detokenize_ping_embeddings(tiny: Server, tiny_models: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_models["qwen2"]))
    r = tiny.post("/tokenize", {"model": "tiny", "prompt": "Zürich 🙂", "return_token_strs": True})
    body = r.json()
    ids = hf.encode("Zürich 🙂")
    assert body["tokens"] == ids and body["count"] == len(ids) and body["max_model_len"] == 256
    assert len(body["token_strs"]) == len(ids)
    msgs = [{"role": "user", "content": "hi"}]
    chat = tiny.post("/tokenize", {"messages": msgs}).json()
    text = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == hf.encode(text, add_special_tokens=False)
    back = tiny.post("/detokenize", {"tokens": ids}).json()
    assert back == {"prompt": "Zürich 🙂"}
    assert tiny.post("/detokenize", {"tokens": [10**9]}).status_code == 400
    assert tiny.post("/tokenize", {"prompt": "x", "bogus": 1}).status_code == 400
    assert httpx.get(f"{tiny.url}/ping").status_code == 200
    assert httpx.post(f"{tiny.url}/ping").status_code == 200
    e = tiny.post("/v1/embeddings", {"model": "tiny", "input": "hi"})
    assert e.status_code == 400 and "does not embed" in e.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        tiny.client().embeddings.create(model="tiny", input="hi")
