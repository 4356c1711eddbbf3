"""The default JSON grammar is compact (OpenAI's "," and ":" separators, no
whitespace between tokens); `disable_any_whitespace: false` lets JSON whitespace in,
a `whitespace_pattern` only that whitespace; schema bounds limit number digits."""

from __future__ import annotations

from pathlib import Path

import pytest
from llguidance import LLMatcher, LLTokenizer

from laneserve.structured.grammar import bound_integers, grammar_text
from laneserve.structured.params import StructuredOutputsParams as S

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok(tiny_models: dict[str, Path]) -> LLTokenizer:
    return LLTokenizer(str(tiny_models["llama"] / "tokenizer.json"))


def accepts(tok: LLTokenizer, p: S, text: str) -> bool:
    m = LLMatcher(tok, grammar_text(p), log_level=0)
    ok = m.consume_tokens(tok.tokenize_str(text))
    return ok and not m.is_error() and m.is_accepting()


def test_default_is_compact(tok: LLTokenizer) -> None:
    p = S(json=SCHEMA)
    assert accepts(tok, p, '{"city":"Paris","population":2100000}')
    assert not accepts(tok, p, '{"city": "Paris", "population": 2100000}')
    assert not accepts(tok, p, '{\n\n"city":"Paris","population":1}')
    assert accepts(tok, S(json=SCHEMA, disable_any_whitespace=True), '{"city":"a","population":1}')


def test_flexible_whitespace_on_request(tok: LLTokenizer) -> None:
    p = S(json=SCHEMA, disable_any_whitespace=False)
    assert accepts(tok, p, '{\n  "city": "Paris",\n  "population": 2100000\n}')
    assert accepts(tok, p, '{"city":"Paris","population":2100000}')
    spaces = S(json=SCHEMA, whitespace_pattern=r"[ ]?")
    assert accepts(tok, spaces, '{"city": "Paris", "population": 2}')
    assert not accepts(tok, spaces, '{"city":\n"Paris","population":2}')


def test_bounded_numbers_through_the_schema(tok: LLTokenizer) -> None:
    bounded = {**SCHEMA, "properties": {**SCHEMA["properties"], "population": {"type": "integer", "minimum": 0, "maximum": 99999}}}  # fmt: skip
    p = S(json=bounded)
    assert accepts(tok, p, '{"city":"x","population":99999}')
    assert not accepts(tok, p, '{"city":"x","population":100000}')


def test_disable_any_whitespace_must_be_a_boolean() -> None:
    with pytest.raises(ValueError, match="boolean"):
        S(json=SCHEMA, disable_any_whitespace="yes")  # type: ignore[arg-type]


def test_unbounded_integers_get_the_safe_range(tok: LLTokenizer) -> None:
    p = S(json=SCHEMA)
    assert accepts(tok, p, '{"city":"x","population":9007199254740991}')
    assert accepts(tok, p, '{"city":"x","population":-9007199254740991}')
    assert not accepts(tok, p, '{"city":"x","population":9007199254740992}')
    assert not accepts(tok, p, '{"city":"x","population":11111111111111111111}')
    # a schema's own bounds stay; enum / const values are data, left alone
    own = {"type": "integer", "minimum": 5}
    assert bound_integers(own) == {"type": "integer", "minimum": 5, "maximum": 2**53 - 1}
    data = {"enum": [{"type": "integer"}]}
    assert bound_integers(data) == data
