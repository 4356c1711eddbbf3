"""Three more tool-call formats (`--tool-call-parser`), as vLLM's parsers read them:

```
 mistral   [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]        Mistral 7B v0.3 style
           [TOOL_CALLS]NAME[ARGS]{...}[TOOL_CALLS]NAME[ARGS]{...}     tokenizer v11+ (Small 3.1+)
 pythonic  [get_weather(city="Paris", days=2), other(flag=True)]       Llama 3.2 / 4 style
           (optionally inside <|python_start|> ... <|python_end|>)
 qwen3_coder <tool_call><function=NAME><parameter=KEY>VALUE</parameter>...
           </function></tool_call>   (values typed by the tool's schema)   Qwen3-Coder
```
Same three answers as the parsers in parsers.py: `start`, `hold`, `calls`.
"""

from __future__ import annotations

import ast
import json
import re

from laneserve.tool_calls.parsers import MarkedParser, ToolCall, _call_from_json


class MistralParser(MarkedParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    special_markers = True  # [TOOL_CALLS] and [ARGS] are special tokens

    def calls(self, section: str, final: bool) -> list[ToolCall]:
        out: list[ToolCall] = []
        for piece in section.split(self.marker)[1:]:
            body = piece.strip()
            found = _json_array(body) if body.startswith("[") else _named(body)
            if found is None:
                break  # NOTE: still being written (or not a call): nothing after it
            out += found
        return out


def _json_array(body: str) -> list[ToolCall] | None:
    try:
        items, _ = json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(items, list):
        return None
    calls = [_call_from_json(x, ("arguments", "parameters")) for x in items]
    return None if any(c is None for c in calls) else [c for c in calls if c is not None]


def _named(body: str) -> list[ToolCall] | None:
    """NAME[ARGS]{...} (also NAME{...}, and a [CALL_ID]... before [ARGS])."""
    brace = body.find("{")
    if brace <= 0:
        return None
    name = body[:brace].replace("[ARGS]", "").split("[CALL_ID]")[0].strip()
    try:
        args, _ = json.JSONDecoder().raw_decode(body, brace)
    except json.JSONDecodeError:
        return None
    call = _call_from_json({"name": name, "arguments": args}, ("arguments",))
    return None if call is None else [call]


class PythonicParser:
    """The whole answer is a Python list of calls with keyword arguments."""

    name = "pythonic"
    special_markers = True  # <|python_start|> / <|python_end|> are special tokens
    tags = ("<|python_start|>", "<|python_end|>")

    def start(self, text: str) -> int | None:
        body = text.lstrip()
        if body.startswith("[") or body.startswith(self.tags[0]):
            return len(text) - len(body)
        return None

    def hold(self, text: str) -> int:
        body = text.lstrip()
        if not body or self.tags[0].startswith(body):
            return len(text)  # NOTE: undecided until the first visible characters
        return 0

    def calls(self, section: str, final: bool) -> list[ToolCall]:
        text = section.strip().removeprefix(self.tags[0]).strip()
        text = text.removesuffix(self.tags[1]).strip()
        try:
            tree = ast.parse(text, mode="eval").body
        except SyntaxError:
            return []  # NOTE: the list is still being written
        if not isinstance(tree, ast.List):
            return []
        out: list[ToolCall] = []
        for node in tree.elts:
            call = _call(node)
            if call is None:
                return out
            out.append(call)
        return out


_NAMES = {"true": True, "false": False, "null": None}


def _value(node: ast.expr) -> object:
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]  # NOTE: some models write JSON's literals
    if isinstance(node, ast.Dict):
        return {_value(k): _value(v) for k, v in zip(node.keys, node.values, strict=True) if k}
    if isinstance(node, ast.List | ast.Tuple):
        return [_value(x) for x in node.elts]
    return ast.literal_eval(node)


def _call(node: ast.expr) -> ToolCall | None:
    if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, ast.Name):
        return None
    try:
        args = {kw.arg: _value(kw.value) for kw in node.keywords if kw.arg is not None}
    except (ValueError, TypeError, SyntaxError):
        return None
    return ToolCall(node.func.id, json.dumps(args, ensure_ascii=False))


class Qwen3CoderParser(MarkedParser):
    """<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>
    (Qwen3-Coder). Values are plain text, typed by the tool's parameter schema:
    strings stay text, integers / numbers / booleans / null are read as such, objects
    and arrays as JSON (or Python literals); a key without a schema type is read
    as JSON where it parses, else kept as text."""

    name = "qwen3_coder"
    marker = "<tool_call>"
    _function = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
    _param = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.schemas = {
            t.get("name"): (t.get("parameters") or {}).get("properties") or {}
            for t in tools or []
            if isinstance(t, dict)
        }

    def calls(self, section: str, final: bool) -> list[ToolCall]:
        out = []
        for m in self._function.finditer(section):
            name = m.group(1).strip()
            props = self.schemas.get(name, {})
            args = {
                k.strip(): _typed(v, props.get(k.strip())) for k, v in self._param.findall(m[2])
            }
            out.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        return out


def _typed(value: str, schema: object) -> object:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if value.strip() == "null" and kind != "string":
        return None
    if kind == "string":
        return value
    text = value.strip()
    if kind == "boolean" and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if kind in ("integer", "number"):
        try:
            number = float(text)
        except ValueError:
            return value
        return int(number) if kind == "integer" and number.is_integer() else number
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    if kind in ("object", "array"):
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError):
            pass
    return value
