"""The bounds of structured/limits.py: each one refuses what is over it with a
ValueError naming it, and real-world constraints (Pydantic models with nested
and recursive types, usual regexes and grammars) stay well within them."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from pydantic import BaseModel

from laneserve.structured import limits
from laneserve.structured.limits import regex_expansion, schema_shape
from laneserve.structured.params import StructuredOutputsParams as S


def _defs_chain(n: int) -> dict:
    defs = {f"D{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/D{i + 1}"}}} for i in range(n)}  # fmt: skip
    defs[f"D{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/D0", "$defs": defs}


class Node(BaseModel):
    name: str
    children: list[Node] = []


class Address(BaseModel):
    city: str
    kind: Literal["home", "work"]


class Person(BaseModel):
    name: str
    addresses: list[Address]
    tree: Node | None = None


def test_schema_shape_follows_refs_and_stops_at_recursion() -> None:
    nodes, depth = schema_shape(_defs_chain(100))
    assert nodes >= 100 and depth > 100  # every $ref hop is a level
    nodes, depth = schema_shape(Node.model_json_schema())  # recursive: finite
    assert depth < 10
    deep: dict = {"type": "integer"}
    for _ in range(5000):  # deeper than Python's recursion limit: still measured
        deep = {"type": "array", "items": deep}
    assert schema_shape(deep)[1] > 5000


def test_regex_expansion_unrolls_bounded_repetitions() -> None:
    assert regex_expansion("a{1000000}") == 1_000_000
    assert regex_expansion("(a{100}){100}") == 10_000
    assert regex_expansion("[a-z]+@x\\.com") < 20
    assert regex_expansion("(a|bc){3}") == 9
    assert regex_expansion("\\p{L}+") == len("\\p{L}+")  # Python cannot parse it: its length


@pytest.mark.parametrize(
    ("kw", "limit"),
    [
        ({"json": _defs_chain(500)}, "MAX_SCHEMA_DEPTH"),
        ({"json": json.dumps(_defs_chain(500))}, "MAX_SCHEMA_DEPTH"),
        (
            {
                "json": {
                    "type": "object",
                    "properties": {f"p{i}": {"type": "integer"} for i in range(5000)},
                }
            },
            "MAX_SCHEMA_NODES",
        ),
        ({"json": {"type": "string", "pattern": "a{1000000}"}}, "MAX_REPEAT"),
        ({"regex": "a{1000000}"}, "MAX_REPEAT"),
        ({"regex": "(a{1000}){1000}"}, "MAX_REGEX_EXPANSION"),
        ({"regex": "b" * 1_000_000}, "MAX_SOURCE_BYTES"),
        ({"regex": "(" * 200 + "a" + ")" * 200}, "MAX_NESTING"),
        ({"choice": ["z" * 1_000_000]}, "MAX_CHOICE_CHARS"),
        ({"choice": [f"c{i}" for i in range(70_000)]}, "MAX_CHOICES"),
        (
            {
                "grammar": "start: r0\n"
                + "\n".join(f"r{i}: r{i + 1}" for i in range(2000))
                + '\nr2000: "a"'
            },
            "MAX_GRAMMAR_RULES",
        ),
        ({"grammar": 'start: "a"~1000000'}, "MAX_REPEAT"),
        ({"grammar": "start: /(a{1000}){1000}/"}, "MAX_REGEX_EXPANSION"),
        ({"json_object": True, "whitespace_pattern": "[ ]{100000}"}, "MAX_REPEAT"),
    ],
)
def test_each_limit_is_a_value_error_naming_it(kw: dict, limit: str) -> None:
    with pytest.raises(ValueError, match=limit) as e:
        S(**kw)
    assert str(e.value).startswith("structured_outputs:")
    assert str(getattr(limits, limit)) in str(e.value).replace(",", "")


def test_real_constraints_are_within_the_limits() -> None:
    for kw in [
        {"json": Person.model_json_schema()},
        {"json": Node.model_json_schema()},
        {"regex": r"(\d{3}-){2}\d{4}"},
        {"regex": r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}"},
        {"choice": [f"option {i}" for i in range(1000)]},
        {"grammar": 'start: expr\nexpr: term ("+" term)*\nterm: NUMBER\n%import common.NUMBER'},
    ]:
        S(**kw)


def test_wrong_types_are_value_errors() -> None:
    for kw in [
        {"json_object": "x"},
        {"json_object": 1},
        {"regex": "a", "disable_any_whitespace": "x"},
    ]:
        with pytest.raises(ValueError, match="must be a boolean"):
            S(**kw)
