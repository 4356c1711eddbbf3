"""One Responses API answer: its text so far, its output items (a `message` with
one `output_text` part, a `function_call` item per tool call) and the response
object in OpenAI's shape."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from laneserve.entrypoints.responses_protocol import ResponsesRequest
from laneserve.frontend.output_processor import Delta
from laneserve.tool_calls.choice import ToolPlan
from laneserve.tool_calls.stream import extract


@dataclass
class Run:
    """One response being generated."""

    body: ResponsesRequest
    tools: ToolPlan | None
    num_prompt: int
    rid: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    text: str = ""
    num_output: int = 0
    finish_reason: str | None = None
    error: str | None = None
    msg_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")

    def add(self, d: Delta) -> None:
        self.text += d.text
        self.num_output += len(d.token_ids)
        if d.finished:
            self.finish_reason = d.state.finish_reason
            self.error = d.state.error

    def items(self) -> list[dict]:
        """The output items of the whole answer."""
        content, calls = self.text, []
        if self.tools is not None:
            found = extract(self.tools.stream(), self.text)
            content, calls = found.content or "", found.calls
        out = []
        if content or not calls:
            out.append(message_item(self.msg_id, content, "completed"))
        for c in calls:
            out.append(call_item(c["id"], c["function"]["name"], c["function"]["arguments"]))
        return out

    def status(self) -> str:
        if self.error:
            return "failed"
        return "incomplete" if self.finish_reason == "length" else "completed"

    def response(self, status: str, output: list[dict]) -> dict:
        b = self.body
        fmt = b.format().body()
        done = status not in ("in_progress", "queued")
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": b.model or "",
            "output": output,
            "error": {"code": "server_error", "message": self.error} if self.error else None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "metadata": b.metadata or {},
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": b.temperature,
            "top_p": b.top_p,
            "text": {"format": fmt},
            "tool_choice": _tool_choice(b),
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or []],
            "truncation": "disabled",
            "user": b.user,
            "usage": self.usage() if done else None,
        }

    def usage(self) -> dict:
        return {
            "input_tokens": self.num_prompt,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": self.num_output,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.num_prompt + self.num_output,
        }


def message_item(item_id: str, text: str, status: str) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [part] if status == "completed" else [],
    }


def call_item(call_id: str, name: str, arguments: str) -> dict:
    return {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def _tool_choice(b: ResponsesRequest) -> object:
    c = b.tool_choice
    if c is None:
        return "auto"
    return c if isinstance(c, str) else c.model_dump()


def sse_event(body: dict) -> bytes:
    return f"event: {body['type']}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n".encode()
