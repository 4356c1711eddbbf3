"""Tool calls read from generated text as it arrives.

Each stream turns text deltas into events: content text, or a piece of a tool
call (`CallDelta`: the first piece of a call carries its id and name). The
whole-answer form (`extract`) runs the same stream over the full text, so a
streamed answer and a collected one always agree.

```
 ParsedCalls   tool_choice "auto": content streams until a parser's marker; each call
               is sent once the parser sees it complete (arguments in one piece)
 NamedCall     a named tool_choice: the output is the arguments (the grammar forces
               the function's parameter schema); they stream as they are generated
 CallArray     tool_choice "required": the output is a JSON array of
               {"name", "parameters"}; the calls are sent when it is complete
```
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Protocol

from laneserve.tool_calls.parsers import ToolCall, ToolParser


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class CallDelta:
    index: int  # which call of the answer
    arguments: str  # more argument text (a whole call's arguments in one piece, or a part)
    id: str | None = None  # the first piece of a call only
    name: str | None = None


Event = str | CallDelta


class ToolStream(Protocol):
    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


class ParsedCalls:
    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser, self.max_calls = parser, max_calls
        self.text = ""
        self.sent = 0  # characters of content sent
        self.section: int | None = None  # where the tool-call section starts
        self.calls = 0

    def feed(self, text: str) -> list[Event]:
        self.text += text
        if self.section is None:
            self.section = self.parser.start(self.text)
            if self.section is None:
                return self._content(len(self.text) - self.parser.hold(self.text))
            events = self._content(self.section)
        else:
            events = []
        return events + self._new_calls(final=False)

    def finish(self) -> list[Event]:
        if self.section is None:
            return self._content(len(self.text))
        events = self._new_calls(final=True)
        if self.calls == 0:  # NOTE: a marker but no valid call: the text was content
            events += self._content(len(self.text))
        return events

    def _content(self, end: int) -> list[Event]:
        piece, self.sent = self.text[self.sent : end], max(self.sent, end)
        return [piece] if piece else []

    def _new_calls(self, final: bool) -> list[Event]:
        assert self.section is not None
        found = self.parser.calls(self.text[self.section :], final)
        if self.max_calls is not None:
            found = found[: self.max_calls]
        events: list[Event] = [_whole(self.calls + i, c) for i, c in enumerate(found[self.calls :])]
        self.calls = max(self.calls, len(found))
        return events


class NamedCall:
    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False

    def feed(self, text: str) -> list[Event]:
        if not text and self.started:
            return []
        first = not self.started
        self.started = True
        return [CallDelta(0, text, call_id() if first else None, self.name if first else None)]

    def finish(self) -> list[Event]:
        return self.feed("")


class CallArray:
    def __init__(self) -> None:
        self.text = ""

    def feed(self, text: str) -> list[Event]:
        self.text += text
        return []

    def finish(self) -> list[Event]:
        try:
            items = json.loads(self.text)
        except json.JSONDecodeError:  # NOTE: cut short (max_tokens): not a call
            return [self.text] if self.text else []
        calls = [_item_call(x) for x in items] if isinstance(items, list) else []
        return [_whole(i, c) for i, c in enumerate(calls)]


def _item_call(item: object) -> ToolCall:
    assert isinstance(item, dict)  # NOTE: the grammar wrote it from the array schema
    return ToolCall(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False))


def _whole(index: int, call: ToolCall) -> CallDelta:
    return CallDelta(index, call.arguments, call_id(), call.name)


@dataclass
class Extracted:
    content: str | None
    calls: list[dict]  # OpenAI message `tool_calls` entries


def extract(stream: ToolStream, text: str) -> Extracted:
    """The whole answer's content and tool calls, from the same stream."""
    events = stream.feed(text) + stream.finish()
    content = "".join(e for e in events if isinstance(e, str))
    calls = merge_calls([e for e in events if isinstance(e, CallDelta)])
    return Extracted(content if content or not calls else None, calls)


def merge_calls(deltas: list[CallDelta]) -> list[dict]:
    calls: dict[int, dict] = {}
    for d in deltas:
        if d.index not in calls:
            calls[d.index] = {
                "id": d.id,
                "type": "function",
                "function": {"name": d.name, "arguments": ""},
            }
        calls[d.index]["function"]["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]


def delta_body(d: CallDelta) -> dict:
    """One streamed `tool_calls` entry (the id, type and name on a call's first piece)."""
    body: dict = {"index": d.index, "function": {"arguments": d.arguments}}
    if d.id is not None:
        body.update(id=d.id, type="function")
        body["function"]["name"] = d.name
    return body
