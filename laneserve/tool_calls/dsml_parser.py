"""DSML tool calls of DeepSeek V3.2 (`deepseek_v32`) and V4 (`deepseek_v4`), the names
vLLM gives these parsers. The format is described in `laneserve.chat_formats.dsml`;
the chat formats write earlier calls the same way, so a parsed answer replays
unchanged.

The section starts at the call block's opening tag (with the blank line the model
writes before it, which is not content); each `invoke` is a call once it is closed.
"""

from __future__ import annotations

import json
import re

from laneserve.chat_formats import dsml
from laneserve.tool_calls.parsers import ToolCall, _prefix_hold

_T = re.escape(dsml.TOKEN)
_INVOKE = re.compile(
    rf'<{_T}invoke name="(?P<name>[^"\n]*)">\n(?P<body>.*?)</{_T}invoke>', re.DOTALL
)
_PARAM = re.compile(
    rf'<{_T}parameter name="(?P<name>[^"\n]*)" string="(?P<str>true|false)">'
    rf"(?P<value>.*?)</{_T}parameter>",
    re.DOTALL,
)


class DsmlParser:
    name = ""
    block = ""
    special_markers = True  # NOTE: keep any special tokens of the markup in the text

    @property
    def marker(self) -> str:
        return f"<{dsml.TOKEN}{self.block}>"

    def start(self, text: str) -> int | None:
        i = text.find(self.marker)
        if i < 0:
            return None
        for _ in range(2):  # the "\n\n" before the block belongs to it
            if i > 0 and text[i - 1] == "\n":
                i -= 1
        return i

    def hold(self, text: str) -> int:
        return _prefix_hold(text, "\n\n" + self.marker)

    def calls(self, section: str, final: bool) -> list[ToolCall]:
        out = []
        for m in _INVOKE.finditer(section):
            call = _call(m["name"], m["body"])
            if call is None:
                break  # NOTE: a malformed call ends the section: what follows is not trusted
            out.append(call)
        return out


def _call(name: str, body: str) -> ToolCall | None:
    params = []
    rest = body
    for m in _PARAM.finditer(body):
        value, is_str = m["value"], m["str"] == "true"
        if not is_str:
            try:
                json.loads(value)
            except json.JSONDecodeError:
                return None
        params.append((m["name"], value, is_str))
        rest = rest.replace(m[0], "", 1)
    names = [p[0] for p in params]
    if not name or rest.strip() or len(set(names)) != len(names):
        return None
    arguments = json.loads(dsml.decode_arguments(params))
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


class DeepSeekV32DsmlParser(DsmlParser):
    name = "deepseek_v32"
    block = dsml.V32_BLOCK


class DeepSeekV4DsmlParser(DsmlParser):
    name = "deepseek_v4"
    block = dsml.V4_BLOCK
