"""What a request's `tools` and `tool_choice` ask of the output.

```
 tool_choice   prompt            output constraint                     read back with
 none          tools rendered    none                                  (plain content)
 auto          tools rendered    none                                  --tool-call-parser
 required      tools rendered    JSON array of {"name", "parameters"}   CallArray
 named         tools rendered    that function's parameter schema       NamedCall
```
`tools` without `tool_choice` means "auto", as in the OpenAI API. The grammar
engine enforces "required" and named choices, so their calls always parse and
match the schemas; under "auto" the model decides and the parser reads what it
wrote. `parallel_tool_calls: false` allows at most one call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from laneserve.tool_calls.parsers import ToolParser
from laneserve.tool_calls.registry import get_parser
from laneserve.tool_calls.stream import CallArray, NamedCall, ParsedCalls, ToolStream

AUTO_NEEDS = (
    'tool_choice: "auto" (the default with tools) needs the server started with '
    "--enable-auto-tool-choice and --tool-call-parser"
)


@dataclass(frozen=True)
class ToolPlan:
    mode: Literal["auto", "named", "required"]
    parser: ToolParser | None = None
    name: str | None = None
    max_calls: int | None = None

    def stream(self) -> ToolStream:
        if self.mode == "named":
            assert self.name is not None
            return NamedCall(self.name)
        if self.mode == "required":
            return CallArray()
        assert self.parser is not None
        return ParsedCalls(self.parser, self.max_calls)

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """OpenAI reports "tool_calls" when the model chose to call; a named choice
        (forced) ends with "stop"."""
        if reason == "stop" and called and self.mode != "named":
            return "tool_calls"
        return reason


def effective_choice(tools: list[dict] | None, choice: Any) -> Any:
    """`tools` without `tool_choice` is "auto"; `tool_choice` without tools is an error."""
    if choice is None:
        return "auto" if tools else "none"
    if not tools and choice != "none":
        raise ValueError("tool_choice: only allowed when tools are given")
    return choice


def named(choice: Any) -> str | None:
    """The function a named `tool_choice` forces, or None."""
    return choice["function"]["name"] if isinstance(choice, dict) else None


def forced_schema(tools: list[dict], choice: Any, parallel: bool) -> dict | None:
    """The JSON schema the output must match ("required" or a named choice), or None.

    `tools`: {"name", "parameters"} per function."""
    params = {t["name"]: t.get("parameters") or {"type": "object"} for t in tools}
    name = named(choice)
    if name is not None:
        if name not in params:
            raise ValueError(f"tool_choice: no tool named {name!r} in tools")
        return params[name]
    if choice != "required":
        return None
    defs: dict[str, Any] = {}
    items = []
    for i, (n, p) in enumerate(params.items()):
        if _has_local_ref(p):
            # NOTE: its "#/..." pointers are relative to its own root: it moves into
            # the array schema's $defs, and they follow it there
            defs[f"fn{i}"] = _rebase_refs(p, f"#/$defs/fn{i}")
            p = {"$ref": f"#/$defs/fn{i}"}
        items.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [n]}, "parameters": p},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if defs:
        schema["$defs"] = defs
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _has_local_ref(node: Any) -> bool:
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            ref = n.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                return True
            stack.extend(n.values())
        elif isinstance(n, list):
            stack.extend(n)
    return False


def _rebase_refs(node: Any, base: str) -> Any:
    """A copy of `node` whose local `$ref`s ("#/...") point below `base` instead."""
    if isinstance(node, list):
        return [_rebase_refs(v, base) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _rebase_refs(v, base) for k, v in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = base + ref[1:]
    return out


def plan(
    tools: list[dict] | None, choice: Any, parallel: bool, parser: str | None
) -> ToolPlan | None:
    """How the answer is read back; None: as plain content. `parser`: the server's
    --tool-call-parser when --enable-auto-tool-choice is on."""
    choice = effective_choice(tools, choice)
    if choice == "none":
        return None
    name = named(choice)
    if name is not None:
        return ToolPlan("named", name=name)
    if choice == "required":
        return ToolPlan("required")
    if parser is None:
        raise ValueError(AUTO_NEEDS)
    return ToolPlan("auto", get_parser(parser, tools), max_calls=None if parallel else 1)
