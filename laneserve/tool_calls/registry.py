"""`--tool-call-parser` names (vLLM's) -> parser classes (parsers.py, parsers_more.py,
dsml_parser.py)."""

from __future__ import annotations

from laneserve.tool_calls.dsml_parser import DeepSeekV4DsmlParser, DeepSeekV32DsmlParser
from laneserve.tool_calls.parsers import (
    DeepSeekV3Parser,
    DeepSeekV31Parser,
    HermesParser,
    Llama3JsonParser,
    ToolParser,
)
from laneserve.tool_calls.parsers_more import MistralParser, PythonicParser, Qwen3CoderParser

PARSERS: dict[str, type] = {
    p.name: p
    for p in (
        HermesParser,
        Llama3JsonParser,
        DeepSeekV3Parser,
        DeepSeekV31Parser,
        DeepSeekV32DsmlParser,
        DeepSeekV4DsmlParser,
        MistralParser,
        PythonicParser,
        Qwen3CoderParser,
    )
}
# parsers that type the values they read by the tools' parameter schemas
_WITH_TOOLS = (Qwen3CoderParser,)


def get_parser(name: str, tools: list[dict] | None = None) -> ToolParser:
    """`tools`: the request's functions ({"name", "parameters"}), for the parsers that
    need their schemas."""
    cls = PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {sorted(PARSERS)}")
    parser: ToolParser = cls(tools) if cls in _WITH_TOOLS else cls()
    return parser
