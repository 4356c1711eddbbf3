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
            _parse_schema(schema)
            text = schema
        else:
            text = json.dumps(schema)
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
