"""A request's constraint as an llguidance grammar, and its validation.

llguidance compiles JSON schemas, regexes and Lark grammars lazily, token by
token, so compiling needs no tokenizer and a request's grammar is checked on the
host that receives it (a 400 there) before any worker sees it.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Protocol

import llguidance
from llguidance import LLMatcher

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


class Constraint(Protocol):
    """The fields of a constraint this module reads (`params.StructuredOutputsParams`)."""

    json: str | dict[str, Any] | None
    regex: str | None
    choice: list[str] | None
    grammar: str | None
    json_object: bool | None
    disable_any_whitespace: bool
    whitespace_pattern: str | None

    @property
    def kind(self) -> str: ...


def grammar_text(p: Constraint) -> str:
    """The llguidance grammar for `p` (ValueError for a malformed JSON schema string)."""
    if p.json is not None or p.json_object:
        schema = p.json if p.json is not None else ANY_JSON_OBJECT
        if isinstance(schema, str):
            schema = _parse_schema(schema)
        return LLMatcher.grammar_from_json_schema(schema, defaults=_json_options(p))
    if p.regex is not None:
        return LLMatcher.grammar_from_regex(p.regex)
    if p.choice is not None:
        return llguidance.grammar_from("choice", json.dumps(p.choice))
    assert p.grammar is not None
    # NOTE: a Lark grammar passes through; a GBNF one is converted to Lark
    return llguidance.grammar_from("grammar", p.grammar)


def check(p: Constraint) -> None:
    """ValueError naming what is wrong when `p` does not compile."""
    try:
        text = grammar_text(p)
    except ValueError as e:
        raise ValueError(f"structured_outputs: invalid {p.kind}: {e}") from None
    error = LLMatcher.validate_grammar(text)
    if error:
        raise ValueError(f"structured_outputs: invalid {p.kind}: {error.strip()}")


def _parse_schema(text: str) -> dict[str, Any]:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError("the JSON schema must be a JSON object")
    return schema


def _json_options(p: Constraint) -> JsonCompileOptions:
    options: JsonCompileOptions = {"whitespace_flexible": not p.disable_any_whitespace}
    if p.whitespace_pattern is not None:
        options["whitespace_pattern"] = p.whitespace_pattern
    return options
