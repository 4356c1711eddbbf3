"""The fields of a request's constraint that the grammar code reads.

A Protocol, so `grammar.py` and `limits.py` need not import `params.py` (which
imports them)."""

from __future__ import annotations

from typing import Any, Protocol


class Constraint(Protocol):
    """The fields of a constraint this module reads (`params.StructuredOutputsParams`)."""

    json: str | dict[str, Any] | None
    regex: str | None
    choice: list[str] | None
    grammar: str | None
    json_object: bool | None
    disable_any_whitespace: bool | None
    whitespace_pattern: str | None

    @property
    def kind(self) -> str: ...
