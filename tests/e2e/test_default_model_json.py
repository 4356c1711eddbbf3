"""Structured output on the embedded default model: a strict schema (city and an
integer population, no other keys) and two more give valid JSON within 80
tokens for a set of prompts, greedy and sampled (the compact default grammar:
no free whitespace to spend the budget on; unbounded integers get I-JSON's range).
The two schemas of our own bound their strings, as a schema meant for a small
model should: sampled, SmolLM2-135M can otherwise repeat words inside a string
until the budget ends (seen with an unbounded `genres` item)."""

from __future__ import annotations

import json

import pytest

from laneserve import LLM, SamplingParams
from laneserve.structured.params import StructuredOutputsParams

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
BOOK = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer"},
        "genres": {
            "type": "array",
            "items": {"type": "string", "maxLength": 20},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["title", "year", "genres"],
    "additionalProperties": False,
}
VERDICT = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no", "unsure"]},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
        "reason": {"type": "string", "maxLength": 60},
    },
    "required": ["answer", "confidence", "reason"],
    "additionalProperties": False,
}
PROMPTS = {
    "city": [
        "What is the capital of France? Answer in JSON.",
        "Name a big city in Japan, as JSON.",
    ],
    "book": ["Recommend one classic novel, as JSON.", "Describe a science fiction book in JSON."],
    "verdict": ["Is the sky blue? Reply in JSON.", "Is 17 a prime number? Reply in JSON."],
}
SCHEMAS = {"city": CITY, "book": BOOK, "verdict": VERDICT}


@pytest.fixture(scope="module")
def llm() -> LLM:
    engine = LLM(dtype="float32")
    yield engine
    engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_schemas_give_valid_json_within_80_tokens(llm: LLM, temperature: float) -> None:
    for name, schema in SCHEMAS.items():
        params = SamplingParams(
            temperature=temperature,
            seed=3,
            max_tokens=80,
            structured_outputs=StructuredOutputsParams(json=schema),
        )
        convs = [[{"role": "user", "content": p}] for p in PROMPTS[name]]
        for out in llm.chat(convs, params):
            o = out.outputs[0]
            assert o.finish_reason == "stop", (name, o.text)
            value = json.loads(o.text)
            assert set(value) == set(schema["required"]), (name, o.text)
            if name == "city":
                assert isinstance(value["population"], int), o.text
