"""Tool calling: the formats models write tool calls in (`parsers`), reading them
from a stream of text (`stream`), and what a request's `tool_choice` asks of the
output (`choice`)."""

from laneserve.tool_calls.parsers import ToolCall, ToolParser
from laneserve.tool_calls.registry import PARSERS, get_parser

__all__ = ["PARSERS", "ToolCall", "ToolParser", "get_parser"]
