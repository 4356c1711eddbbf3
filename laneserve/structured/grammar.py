"""A request's constraint as an llguidance grammar, and its validation.

llguidance compiles JSON schemas, regexes and Lark grammars lazily, token by
token, so compiling needs no tokenizer and a request's grammar is checked on the
host that receives it (a 400 there) before any worker sees it.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import llguidance
from llguidance import LLMatcher

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

    from laneserve.structured.params import StructuredOutputsParams

ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


def grammar_text(p: StructuredOutputsParams) -> str:
    """The llguidance grammar for `p` (ValueError for a malformed JSON schema string)."""
    if p.json is not None or p.json_object:
        schema = p.json if p.json is not None else ANY_JSON_OBJECT
        if isinstance(schema, str):
            schema = _parse_schema(schema)
        return LLMatcher.grammar_from_json_schema(bound_integers(schema), defaults=_json_options(p))
    if p.regex is not None:
        return LLMatcher.grammar_from_regex(p.regex)
    if p.choice is not None:
        return llguidance.grammar_from("choice", json.dumps(p.choice))
    assert p.grammar is not None
    # NOTE: a Lark grammar passes through; a GBNF one is converted to Lark
    return llguidance.grammar_from("grammar", p.grammar)


def check(p: StructuredOutputsParams) -> None:
    """ValueError naming what is wrong when `p` does not compile."""
    try:
        text = grammar_text(p)
    except ValueError as e:
        raise ValueError(f"structured_outputs: invalid {p.kind}: {e}") from None
    error = LLMatcher.validate_grammar(text)
    if error:
        raise ValueError(f"structured_outputs: invalid {p.kind}: {error.strip()}")


# I-JSON's interoperable integer range (RFC 7493): beyond it JSON parsers lose digits
SAFE_INT = 2**53 - 1
_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})  # values, not schemas


def bound_integers(node: Any) -> Any:
    """A copy of the schema whose integers without a bound get I-JSON's range, so
    that a model cannot write digits until its token budget ends (llguidance
    compiles a range into a bounded number of digits)."""
    if isinstance(node, list):
        return [bound_integers(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: v if k in _DATA_KEYS else bound_integers(v) for k, v in node.items()}
    kind = node.get("type")
    if kind == "integer" or (isinstance(kind, list) and "integer" in kind):
        if "minimum" not in node and "exclusiveMinimum" not in node:
            out["minimum"] = -SAFE_INT
        if "maximum" not in node and "exclusiveMaximum" not in node:
            out["maximum"] = SAFE_INT
    return out


def _parse_schema(text: str) -> dict[str, Any]:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError("the JSON schema must be a JSON object")
    return schema


def _json_options(p: StructuredOutputsParams) -> JsonCompileOptions:
    """Compact by default: OpenAI's separators and no whitespace between tokens, so
    a model cannot spend its budget on free whitespace. `disable_any_whitespace:
    false` allows any JSON whitespace, a `whitespace_pattern` that whitespace.
    (Numbers are bounded only by the schema's `minimum` / `maximum`: llguidance
    compiles a range into digits; it has no length option for unbounded ones.)"""
    if p.whitespace_pattern is not None:
        return {"whitespace_flexible": True, "whitespace_pattern": p.whitespace_pattern}
    if p.disable_any_whitespace is False:
        return {"whitespace_flexible": True}
    return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
