"""A request's constraint as an llguidance grammar, and its validation.

llguidance compiles JSON schemas, regexes and Lark grammars lazily, token by
token, so compiling needs no tokenizer and a request's grammar is checked on the
host that receives it (a 400 there) before any worker sees it: first against
the bounds of `limits.py` (cheap scans: the engine never sees a constraint over
them), then compiled under `parser_limits()`. Both the JSON-schema translation
and the validation are memoized by text; a panic of the engine is a ValueError.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import llguidance
from llguidance import LLMatcher, LLParserLimits

from laneserve.structured.constraint import Constraint
from laneserve.structured.limits import check_limits

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


def grammar_text(p: Constraint) -> str:
    """The llguidance grammar for `p` (ValueError for a malformed JSON schema string)."""
    if p.json is not None or p.json_object:
        schema = p.json if p.json is not None else ANY_JSON_OBJECT
        if isinstance(schema, str):
            schema = _parse_schema(schema)
        text = json.dumps(bound_integers(schema))
        return _json_grammar(text, json.dumps(_json_options(p), sort_keys=True))
    if p.regex is not None:
        return LLMatcher.grammar_from_regex(p.regex)
    if p.choice is not None:
        return llguidance.grammar_from("choice", json.dumps(p.choice))
    assert p.grammar is not None
    # NOTE: a Lark grammar passes through; a GBNF one is converted to Lark
    return llguidance.grammar_from("grammar", p.grammar)


# llguidance's own bounds, the same on the host that checks and on the worker:
# its defaults but for the grammar size (the defaults allow 500 000 symbols)
MAX_GRAMMAR_SYMBOLS = 200_000


def parser_limits() -> LLParserLimits:
    return LLParserLimits(max_grammar_size=MAX_GRAMMAR_SYMBOLS, verbose_errors=False)


def check(p: Constraint) -> None:
    """ValueError naming what is wrong when `p` is over a limit or does not compile.

    The compile is memoized by the grammar's text (a repeated schema is free)."""
    try:
        check_limits(p)
    except ValueError as e:
        raise ValueError(f"structured_outputs: {p.kind}: {e}") from None
    try:
        text = grammar_text(p)
        error = validated(text)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"structured_outputs: invalid {p.kind}: {e}") from None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # NOTE: a panic of the grammar engine is this request's
        raise ValueError(
            f"structured_outputs: the grammar engine failed on this {p.kind}: "
            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None
    if error:
        raise ValueError(f"structured_outputs: invalid {p.kind}: {error}")


@lru_cache(maxsize=256)
def validated(text: str) -> str:
    """llguidance's complaint about the grammar `text` ("" when it compiles)."""
    return LLMatcher.validate_grammar(text, limits=parser_limits()).strip()


@lru_cache(maxsize=256)
def _json_grammar(schema: str, options: str) -> str:
    return LLMatcher.grammar_from_json_schema(schema, defaults=json.loads(options))


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


def _json_options(p: Constraint) -> JsonCompileOptions:
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
