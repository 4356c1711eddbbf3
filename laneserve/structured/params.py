"""`StructuredOutputsParams`: what a request's output must match (vLLM's field names).

Exactly one of `json` (a JSON schema, as a dict or a string), `json_object` (any
JSON object), `regex`, `choice` (one of the strings) or `grammar` (Lark, or
GBNF / llama.cpp style EBNF) is set. Construction checks that the constraint
compiles (`grammar.check`), so a bad schema or regex is a ValueError at the
request, never a failure on the worker.
"""

from __future__ import annotations

from typing import Any

import msgspec

KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # JSON only (grammar.py): None (the default) and True write compact JSON, with
    # OpenAI's separators ("," and ":") and no whitespace between tokens; False lets
    # any JSON whitespace in (vLLM's default); a pattern allows that whitespace
    disable_any_whitespace: bool | None = None
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        from laneserve.structured.grammar import check

        _check_types(self)
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(
                "structured_outputs: set exactly one of json, json_object, regex, choice, "
                f"grammar (got {', '.join(set_) or 'none'})"
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError("structured_outputs: choice must be a non-empty list of strings")
        check(self)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))


def _check_types(p: StructuredOutputsParams) -> None:
    """msgspec checks types on decode only; a constructor call is checked here."""
    for name in ("regex", "grammar", "whitespace_pattern"):
        if getattr(p, name) is not None and not isinstance(getattr(p, name), str):
            raise ValueError(f"structured_outputs: {name} must be a string")
    if p.disable_any_whitespace is not None and not isinstance(p.disable_any_whitespace, bool):
        raise ValueError("structured_outputs: disable_any_whitespace must be a boolean")
    if p.json is not None and not isinstance(p.json, (str, dict)):
        raise ValueError("structured_outputs: json must be a JSON schema (object or string)")
    if p.choice is not None and not isinstance(p.choice, list):
        raise ValueError("structured_outputs: choice must be a list of strings")
    if p.json_object is not None and not isinstance(p.json_object, bool):
        raise ValueError("structured_outputs: json_object must be a boolean")
