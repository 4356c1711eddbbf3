"""Bounds on a request's constraint, checked before the grammar engine sees it.

llguidance compiles lazily and accepts grammars it later cannot follow (its
lexer runs out of fuel at the first token: `a{1000000}`) or that overflow a
thread's stack while it checks them (a `$ref` chain of ~1000 objects). These
checks are cheap scans of the request's own text, made on the host that takes
the request, so a constraint over a limit is a 400 naming that limit.

```
 MAX_SOURCE_BYTES     the constraint's text (schema as JSON, regex, grammar, choices)
 MAX_SCHEMA_NODES     objects in a JSON schema
 MAX_SCHEMA_DEPTH     nesting of a JSON schema, `$ref` hops included
 MAX_GRAMMAR_RULES    rule / terminal definitions of a Lark or GBNF grammar
 MAX_NESTING          bracket nesting of a regex or grammar
 MAX_REPEAT           the largest repetition count ({n,m}, ~ n)
 MAX_REGEX_EXPANSION  a regex unrolled: `(a{100}){100}` counts 10 000
 MAX_CHOICES / MAX_CHOICE_CHARS   items of `choice`, characters of one item
```
"""

from __future__ import annotations

import importlib
import json
import re
from typing import Any

from laneserve.structured.constraint import Constraint

MAX_SOURCE_BYTES = 256 * 1024
MAX_SCHEMA_NODES = 4096
MAX_SCHEMA_DEPTH = 64
MAX_GRAMMAR_RULES = 1000
MAX_NESTING = 128
MAX_REPEAT = 10_000
MAX_REGEX_EXPANSION = 10_000
MAX_CHOICES = 4096
MAX_CHOICE_CHARS = 10_000

_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_LARK_REPEAT = re.compile(r"~\s*(\d+)(?:\s*\.\.\s*(\d+))?")
_RULE = re.compile(r"^\s*[?!]?[A-Za-z_][\w.]*\s*(?::|::=)", re.MULTILINE)
_LARK_REGEX = re.compile(r"/((?:\\.|[^/\\\n])+)/[imslux]*")


class LimitError(ValueError):
    """A constraint over one of the limits above (the message names it)."""


def check_limits(p: Constraint) -> None:
    """LimitError when `p` is over a limit (the types are already checked)."""
    if p.json is not None:
        _check_schema(p.json)
    elif p.regex is not None:
        _check_source(p.regex)
        _check_regex(p.regex)
    elif p.choice is not None:
        _check_choice(p.choice)
    elif p.grammar is not None:
        _check_source(p.grammar)
        _check_grammar(p.grammar)
    if p.whitespace_pattern is not None:
        _check_regex(p.whitespace_pattern)


def _over(what: str, value: int, limit: int, name: str) -> LimitError:
    return LimitError(f"{what} ({value}) exceeds the limit of {limit} ({name})")


def _check_source(text: str) -> None:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_SOURCE_BYTES:
        raise _over("the constraint's size in bytes", size, MAX_SOURCE_BYTES, "MAX_SOURCE_BYTES")


def _check_choice(choice: list[str]) -> None:
    if len(choice) > MAX_CHOICES:
        raise _over("the number of choices", len(choice), MAX_CHOICES, "MAX_CHOICES")
    longest = max((len(c) for c in choice), default=0)
    if longest > MAX_CHOICE_CHARS:
        raise _over("the length of a choice", longest, MAX_CHOICE_CHARS, "MAX_CHOICE_CHARS")
    _check_source(json.dumps(choice))


def _check_schema(schema: str | dict[str, Any]) -> None:
    text = schema if isinstance(schema, str) else json.dumps(schema)
    _check_source(text)
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (json.JSONDecodeError, RecursionError):
            return  # NOTE: the compile step says what is wrong with it
    nodes, depth = schema_shape(schema)
    if nodes > MAX_SCHEMA_NODES:
        raise _over("the JSON schema's object count", nodes, MAX_SCHEMA_NODES, "MAX_SCHEMA_NODES")
    if depth > MAX_SCHEMA_DEPTH:
        raise _over(
            "the JSON schema's nesting depth ($ref hops included)",
            depth,
            MAX_SCHEMA_DEPTH,
            "MAX_SCHEMA_DEPTH",
        )
    for pattern in _patterns(schema):
        _check_regex(pattern)


def schema_shape(schema: object) -> tuple[int, int]:
    """(objects in the schema, its deepest nesting following local `$ref`s).

    Iterative (a schema may nest deeper than Python's recursion limit); a `$ref`
    back to a schema being walked (a recursive type) adds no depth."""
    nodes = 0
    depth: dict[int, int] = {}  # id(node) -> nesting below it, once walked
    on_path: set[int] = set()
    stack: list[tuple[object, bool]] = [(schema, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        kids = _children(schema, node)
        if done:
            on_path.discard(key)
            depth[key] = 1 + max((depth.get(id(k), 0) for k in kids), default=0)
            continue
        if key in depth or key in on_path:
            continue
        if isinstance(node, dict):
            nodes += 1
        on_path.add(key)
        stack.append((node, True))
        stack.extend((k, False) for k in kids if id(k) not in on_path and id(k) not in depth)
    return nodes, depth.get(id(schema), 0)


def _children(root: object, node: object) -> list[object]:
    if isinstance(node, list):
        return [v for v in node if isinstance(v, (dict, list))]
    if not isinstance(node, dict):
        return []
    kids: list[object] = [v for v in node.values() if isinstance(v, (dict, list))]
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        target = _pointer(root, ref[1:])
        if isinstance(target, (dict, list)):
            kids.append(target)
    return kids


def _pointer(root: object, pointer: str) -> object:
    node = root
    for part in pointer.split("/")[1:] if pointer else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _patterns(schema: object) -> list[str]:
    out, stack = [], [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                out.append(node["pattern"])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return out


def _check_grammar(text: str) -> None:
    rules = len(_RULE.findall(text))
    if rules > MAX_GRAMMAR_RULES:
        raise _over("the grammar's rule count", rules, MAX_GRAMMAR_RULES, "MAX_GRAMMAR_RULES")
    _check_nesting(text)
    _check_counts(_LARK_REPEAT, text)
    for m in _LARK_REGEX.finditer(text):
        _check_regex(m.group(1))
    _check_counts(_QUANTIFIER, text)


def _check_regex(pattern: str) -> None:
    _check_nesting(pattern)
    _check_counts(_QUANTIFIER, pattern)
    size = regex_expansion(pattern)
    if size > MAX_REGEX_EXPANSION:
        raise _over("the regex's unrolled size", size, MAX_REGEX_EXPANSION, "MAX_REGEX_EXPANSION")


def _check_counts(pattern: re.Pattern[str], text: str) -> None:
    for m in pattern.finditer(text):
        count = max(int(g) for g in m.groups() if g)
        if count > MAX_REPEAT:
            raise _over("a repetition count", count, MAX_REPEAT, "MAX_REPEAT")


def _check_nesting(text: str) -> None:
    level = deepest = 0
    for ch in text:
        if ch in "([":
            level += 1
            deepest = max(deepest, level)
        elif ch in ")]":
            level = max(0, level - 1)
    if deepest > MAX_NESTING:
        raise _over("the bracket nesting depth", deepest, MAX_NESTING, "MAX_NESTING")


def regex_expansion(pattern: str) -> int:
    """The regex's size with every bounded repetition unrolled (an unbounded one
    counts its minimum); its length when Python's parser does not read it."""
    # NOTE: CPython's own regex parser (private modules, no type stubs)
    c: Any = importlib.import_module("re._constants")
    sre: Any = importlib.import_module("re._parser")
    try:
        tree = sre.parse(pattern)
    except (re.error, RecursionError, OverflowError):
        return len(pattern)

    def size(seq: Any) -> int:
        total = 0
        for op, arg in seq:
            if op in (c.MAX_REPEAT, c.MIN_REPEAT, c.POSSESSIVE_REPEAT):
                lo, hi, sub = arg
                times = hi if hi != c.MAXREPEAT else lo
                total += size(sub) * max(1, times)
            elif op is c.SUBPATTERN:
                total += size(arg[-1])
            elif op is c.BRANCH:
                total += sum(size(b) for b in arg[1])
            elif op in (c.ASSERT, c.ASSERT_NOT):
                total += size(arg[1])
            else:
                total += 1
        return total

    try:
        return size(tree)
    except RecursionError:
        return len(pattern)
