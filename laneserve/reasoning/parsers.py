"""`<think>`-style reasoning read from generated text as it arrives.

```
 deepseek_r1   the answer opens inside the thinking (the prompt ends with <think>, or the
               model writes it): everything up to </think> is reasoning; an answer cut
               short before </think> is all reasoning (as vLLM reads it)
 deepseek_v3   the same when the request turns thinking on (chat_template_kwargs
               thinking / enable_thinking: DeepSeek V3.1 / V3.2), else no reasoning
 deepseek_v4   as deepseek_v3, for DeepSeek V4's chat format
```
A stream yields `Thought` pieces (reasoning) and plain strings (content); the whole
answer is split by the same stream, so streamed and collected answers agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from laneserve.tool_calls.parsers import _prefix_hold

START, END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "deepseek_v3", "deepseek_v4")
_BY_REQUEST = ("deepseek_v3", "deepseek_v4")  # thinking only when the request asks


@dataclass(frozen=True)
class Thought:
    text: str


class ReasoningStream:
    def __init__(self) -> None:
        self.text = ""
        self.sent = 0  # characters of the answer handed out
        self.done = False  # </think> seen: the rest is content

    def feed(self, text: str) -> list[Thought | str]:
        self.text += text
        if self.done:
            return self._content()
        end = self.text.find(END, self.sent)
        if end < 0:
            return self._thought(len(self.text) - _prefix_hold(self.text, END))
        out = self._thought(end)
        self.done, self.sent = True, end + len(END)
        return out + self._content()

    def finish(self) -> list[Thought | str]:
        return self._content() if self.done else self._thought(len(self.text))

    def _thought(self, stop: int) -> list[Thought | str]:
        if self.sent == 0 and self.text.startswith(START):
            self.sent = len(START)  # the opening tag, when the model writes it, is not thinking
        elif self.sent == 0 and START.startswith(self.text):
            return []  # could still become the opening tag
        piece, self.sent = self.text[self.sent : stop], max(self.sent, stop)
        return [Thought(piece)] if piece else []

    def _content(self) -> list[Thought | str]:
        piece, self.sent = self.text[self.sent :], len(self.text)
        return [piece] if piece else []


@dataclass(frozen=True)
class ReasoningPlan:
    parser: str

    def stream(self) -> ReasoningStream:
        return ReasoningStream()


def reasoning_plan(parser: str | None, chat_template_kwargs: dict | None) -> ReasoningPlan | None:
    """How one request's answer is split (None: no reasoning to read)."""
    if parser is None:
        return None
    if parser not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {parser!r}; one of {list(REASONING_PARSERS)}")
    kwargs = chat_template_kwargs or {}
    if parser in _BY_REQUEST and not (kwargs.get("thinking") or kwargs.get("enable_thinking")):
        return None
    return ReasoningPlan(parser)


def split(plan: ReasoningPlan, text: str) -> tuple[str | None, str]:
    """(reasoning, content) of a whole answer."""
    stream = plan.stream()
    events = stream.feed(text) + stream.finish()
    thought = "".join(e.text for e in events if isinstance(e, Thought))
    content = "".join(e for e in events if isinstance(e, str))
    return (thought if thought or stream.done else None), content
