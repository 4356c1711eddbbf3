"""One chat choice's answer read as reasoning, content and tool calls: the reasoning
parser splits off the thinking, the tool-call stream reads the rest. Streamed chunks
and the collected message come from the same events, so they always agree."""

from __future__ import annotations

from laneserve.reasoning import ReasoningPlan, Thought
from laneserve.reasoning.parsers import ReasoningStream
from laneserve.tool_calls.choice import ToolPlan
from laneserve.tool_calls.stream import CallDelta, ToolStream, delta_body, merge_calls

Event = Thought | str | CallDelta


class ChoiceParser:
    def __init__(self, reasoning: ReasoningPlan | None, tools: ToolPlan | None) -> None:
        self.reasoning: ReasoningStream | None = reasoning.stream() if reasoning else None
        self.tools: ToolStream | None = tools.stream() if tools else None
        self.called = False  # a tool call was read

    def feed(self, text: str, finished: bool) -> list[Event]:
        if self.reasoning is None:
            parts: list[Thought | str] = [text]
        else:
            parts = self.reasoning.feed(text) + (self.reasoning.finish() if finished else [])
        events: list[Event] = []
        for p in parts:
            if isinstance(p, Thought) or self.tools is None:
                events += [p] if (isinstance(p, Thought) or p) else []
            else:
                events += self.tools.feed(p)
        if finished and self.tools is not None:
            events += self.tools.finish()
        self.called = self.called or any(isinstance(e, CallDelta) for e in events)
        return events


def delta_of(e: Event) -> dict:
    """A streamed chunk's `delta` for one event."""
    if isinstance(e, Thought):
        return {"reasoning_content": e.text}
    if isinstance(e, CallDelta):
        return {"tool_calls": [delta_body(e)]}
    return {"content": e}


def message_of(events: list[Event], reasoning: bool) -> dict:
    """The collected assistant message (content None when there is none, as with
    tool calls or an answer that was all reasoning)."""
    content = "".join(e for e in events if isinstance(e, str))
    calls = merge_calls([e for e in events if isinstance(e, CallDelta)])
    message: dict = {
        "role": "assistant",
        "content": content or (None if calls or reasoning else ""),
    }
    if reasoning:
        thought = "".join(e.text for e in events if isinstance(e, Thought))
        message["reasoning_content"] = thought or None
    if calls:
        message["tool_calls"] = calls
    return message
