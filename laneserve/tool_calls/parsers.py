"""The text formats models write tool calls in, one parser each (`--tool-call-parser`).

```
 hermes        <tool_call>{"name": ..., "arguments": {...}}</tool_call>   Hermes, Qwen 2.5 / 3
 llama3_json   {"name": ..., "parameters": {...}}  (optionally after <|python_tag|>;
               several separated by ";")                                Llama 3.1 / 3.2 / 3.3
 deepseek_v3   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
               ```json\n{...}\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>   DeepSeek V3 / R1
 deepseek_v31  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}
               <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>                      DeepSeek V3.1
 deepseek_v32  <｜DSML｜function_calls><｜DSML｜invoke name=..>..  (dsml_parser.py)  DeepSeek V3.2
 deepseek_v4   <｜DSML｜tool_calls><｜DSML｜invoke name=..>..      (dsml_parser.py)  DeepSeek V4
```
`registry.py` maps the `--tool-call-parser` names to the classes.
A parser answers three questions about the text generated so far: where the
tool-call section starts (`start`), how many trailing characters might be the
beginning of its marker and must not be streamed as content yet (`hold`), and
which calls the section holds (`calls`; `final` also accepts a last call the
model did not close). `laneserve.tool_calls.stream` builds streaming and whole
extraction on these three. `registry.py` maps the flag's names to the parsers
(these and parsers_more.py's).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (what the OpenAI API carries)


class ToolParser(Protocol):
    name: str
    # the markers are special tokens: the text must keep them (skip_special_tokens off)
    special_markers: bool

    def start(self, text: str) -> int | None: ...

    def hold(self, text: str) -> int: ...

    def calls(self, section: str, final: bool) -> list[ToolCall]: ...


def _prefix_hold(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _call_from_json(obj: object, keys: tuple[str, ...]) -> ToolCall | None:
    """{"name": str, <one of keys>: object} as a call; anything else is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: object = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):  # NOTE: some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


class MarkedParser:
    """A section that starts at a fixed marker."""

    name = ""
    marker = ""
    special_markers = False

    def start(self, text: str) -> int | None:
        i = text.find(self.marker)
        return None if i < 0 else i

    def hold(self, text: str) -> int:
        return _prefix_hold(text, self.marker)

    def calls(self, section: str, final: bool) -> list[ToolCall]:
        raise NotImplementedError


class HermesParser(MarkedParser):
    name = "hermes"
    marker = "<tool_call>"
    _closed = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def calls(self, section: str, final: bool) -> list[ToolCall]:
        bodies = self._closed.findall(section)
        if final:  # NOTE: a model may stop (EOS) right after the JSON, without the tag
            end = section.rfind("</tool_call>")
            tail = section[end + len("</tool_call>") :] if end >= 0 else section
            open_at = tail.find("<tool_call>")
            if open_at >= 0:
                bodies.append(tail[open_at + len("<tool_call>") :])
        out = (_call_from_json(_loads(b.strip()), ("arguments", "parameters")) for b in bodies)
        return [c for c in out if c is not None]


class Llama3JsonParser:
    """The whole answer is the call(s); it must start with `{` or the python tag."""

    name = "llama3_json"
    special_markers = True  # <|python_tag|> is a special token
    tag = "<|python_tag|>"

    def start(self, text: str) -> int | None:
        body = text.lstrip()
        if body.startswith("{") or body.startswith(self.tag):
            return len(text) - len(body)
        return None

    def hold(self, text: str) -> int:
        body = text.lstrip()
        if not body or self.tag.startswith(body):
            return len(text)  # NOTE: undecided until the first visible characters
        return 0

    def calls(self, section: str, final: bool) -> list[ToolCall]:
        text = section.strip().removeprefix(self.tag)
        decoder, pos = json.JSONDecoder(), 0
        out: list[ToolCall] = []
        while True:
            while pos < len(text) and text[pos] in " \t\r\n;":
                pos += 1
            if pos >= len(text):
                return out
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except json.JSONDecodeError:
                return out  # an object still being written (or not JSON): stop here
            call = _call_from_json(obj, ("parameters", "arguments"))
            if call is None:
                return out
            out.append(call)


class DeepSeekV3Parser(MarkedParser):
    name = "deepseek_v3"
    marker = "<｜tool▁calls▁begin｜>"
    special_markers = True
    _call = re.compile(
        r"<｜tool▁call▁begin｜>(?P<kind>.*?)<｜tool▁sep｜>(?P<name>.*?)\n```json\n"
        r"(?P<args>.*?)\n```<｜tool▁call▁end｜>",
        re.DOTALL,
    )

    def calls(self, section: str, final: bool) -> list[ToolCall]:
        out = []
        for m in self._call.finditer(section):
            call = _call_from_json(
                {"name": m["name"].strip(), "arguments": m["args"]}, ("arguments",)
            )
            if call is not None:
                out.append(call)
        return out


class DeepSeekV31Parser(DeepSeekV3Parser):
    name = "deepseek_v31"
    _call = re.compile(
        r"<｜tool▁call▁begin｜>(?P<name>.*?)<｜tool▁sep｜>(?P<args>.*?)<｜tool▁call▁end｜>",
        re.DOTALL,
    )
