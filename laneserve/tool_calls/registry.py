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
from laneserve.tool_calls.parsers_more import MistralParser, PythonicParser

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
    )
}


def get_parser(name: str) -> ToolParser:
    cls = PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {sorted(PARSERS)}")
    parser: ToolParser = cls()
    return parser
