"""Structured output through the real `openai` client against `laneserve serve`:
`chat.completions.parse` with Pydantic models, vLLM's `structured_outputs` and
`guided_*` fields, a 100-request batch whose every output validates, and the
400s for constraints that do not compile."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field
from tokenizers import Tokenizer

from tests.server.conftest import QWEN2, Server, start_server, stop_server

USER = [{"role": "user", "content": "Describe one item as JSON."}]


class Flag(BaseModel):
    ok: bool
    level: Literal["low", "mid", "high"]


class Point(BaseModel):
    x: int = Field(ge=-50, le=50)
    y: int = Field(ge=-50, le=50)
    label: str = Field(max_length=6)


class Order(BaseModel):
    size: Literal["S", "M", "L"]
    count: int = Field(ge=1, le=9)
    flags: Flag


@pytest.fixture(scope="module")
def tiny(shared_server: Callable[..., Server]) -> Server:
    return shared_server("qwen2", *QWEN2)  # shared with test_responses_api


@pytest.mark.parametrize("model", [Flag, Point, Order])
def test_parse_returns_a_valid_object(tiny: Server, model: type[BaseModel]) -> None:
    """Random weights: only the grammar makes these outputs parse."""
    for temperature in (0.0, 1.0):
        out = tiny.client().chat.completions.parse(
            model="tiny",
            messages=USER,
            response_format=model,
            max_tokens=80,
            temperature=temperature,
            # NOTE: random weights would fill any whitespace the grammar allows
            extra_body={"structured_outputs": {"disable_any_whitespace": True}},
        )
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, model), choice.message.content


def test_json_object_and_streaming(tiny: Server, tiny_models: dict[str, Path]) -> None:
    c = tiny.client()
    kw = {"model": "tiny", "messages": USER, "max_tokens": 80, "temperature": 0}
    compact = {"structured_outputs": {"disable_any_whitespace": True}}
    schema = {
        "type": "json_schema",
        "json_schema": {
            "name": "p",
            "schema": {**Point.model_json_schema(), "additionalProperties": False},
        },
    }
    whole = c.chat.completions.create(response_format=schema, extra_body=compact, **kw)
    whole = whole.choices[0].message.content
    Point.model_validate_json(whole)
    parts = c.chat.completions.create(response_format=schema, stream=True, extra_body=compact, **kw)
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == whole
    any_object = c.chat.completions.create(
        response_format={"type": "json_object"},
        extra_body={"structured_outputs": None},
        **{**kw, "max_tokens": 200},
    ).choices[0]
    if any_object.finish_reason == "stop":  # unbounded: it may run out of tokens
        assert isinstance(json.loads(any_object.message.content), dict)
    else:
        assert any_object.message.content.startswith("{")
    # closing quotes and braces favoured, the object ends within the budget: it must parse
    vocab = Tokenizer.from_file(str(tiny_models["qwen2"] / "tokenizer.json"))
    bias = {str(vocab.token_to_id(t)): 6 for t in ('"', "}")}
    closed = c.chat.completions.create(
        response_format={"type": "json_object"},
        logit_bias=bias,
        extra_body=compact,
        **{**kw, "max_tokens": 200},
    ).choices[0]
    assert closed.finish_reason == "stop", closed.message.content
    assert isinstance(json.loads(closed.message.content), dict)


COMPACT = {"disable_any_whitespace": True}
STRICT_FLAG = {**Flag.model_json_schema(), "additionalProperties": False}
REGEX = r"[a-z]{2,6}-\d{1,3}"
CHOICES = ["north", "south", "east", "west"]
GRAMMAR = 'start: "(" NUM ("+" NUM){0,2} ")"\nNUM: /[0-9]{1,2}/'


def _body(i: int) -> tuple[dict, object]:
    """(extra_body, validator) for request i of the batch."""
    kinds = [
        ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
        ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
        (
            {"guided_json": STRICT_FLAG, "structured_outputs": COMPACT},
            Flag.model_validate_json,
        ),
        (
            {"structured_outputs": {"grammar": GRAMMAR}},
            lambda t: re.fullmatch(r"\(\d+(\+\d+)*\)", t),
        ),
        ({"guided_regex": r"(yes|no), [0-9]"}, lambda t: re.fullmatch(r"(yes|no), [0-9]", t)),
    ]
    return kinds[i % len(kinds)]


def test_batch_of_100_every_output_validates(tiny: Server) -> None:
    c = tiny.client()

    def one(i: int) -> tuple[str, str, int]:
        extra, _ = _body(i)
        r = c.completions.create(
            model="tiny", prompt=f"item {i}:", max_tokens=48, temperature=0.7, seed=i,
            extra_body=extra,
        )  # fmt: skip
        return r.choices[0].text, r.choices[0].finish_reason, i

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(100)))
    for text, reason, i in results:
        assert reason == "stop", (i, text)
        assert _body(i)[1](text), (i, text)


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"structured_outputs": {"regex": "[a-z"}}, "invalid regex"),
        ({"guided_regex": "a(b"}, "invalid regex"),
        ({"structured_outputs": {"json": {"type": "objekt"}}}, "invalid json"),
        ({"structured_outputs": {"grammar": "start: nowhere"}}, "invalid grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
          "schema": {"type": "object", "properties": {"a": {"type": "intger"}}}}}}, "invalid json"),
    ],
)  # fmt: skip
def test_constraints_that_do_not_compile_are_400(tiny: Server, extra: dict, fragment: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        tiny.client().chat.completions.create(
            model="tiny", messages=USER, max_tokens=4, extra_body=extra
        )
    assert fragment in str(e.value)


@pytest.mark.slow
def test_parse_on_the_default_model() -> None:
    """The embedded SmolLM2-135M-Instruct fills Pydantic schemas with real content."""
    from laneserve.model.loader import default_model_path

    class Person(BaseModel):
        name: str
        age: int

    class City(BaseModel):
        city: str
        country: str
        population_millions: float

    class Answer(BaseModel):
        answer: Literal["yes", "no"]
        reason: str

    s = start_server(default_model_path(), name="smol")
    try:
        c = s.client()
        for model, question in [
            (Person, "Invent a person and give their name and age."),
            (City, "Name a large city, its country and population in millions."),
            (Answer, "Is the sky blue? Answer with a reason."),
        ]:
            out = c.chat.completions.parse(
                model="smol", messages=[{"role": "user", "content": question}],
                response_format=model, max_tokens=200, temperature=0,
                extra_body={"structured_outputs": COMPACT},
            )  # fmt: skip
            assert isinstance(out.choices[0].message.parsed, model), out.choices[0].message
    finally:
        stop_server(s)
