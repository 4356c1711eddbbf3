"""OpenAI response bodies: completion / chat objects, stream chunks, usage, errors."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Protocol

from laneserve.entrypoints.logprob_body import (
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_body,
)
from laneserve.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
from laneserve.frontend.output_processor import Delta
from laneserve.frontend.token_bytes import CharOffsets
from laneserve.outputs import Logprob
from laneserve.tool_calls.choice import ToolPlan
from laneserve.tool_calls.stream import CallDelta, delta_body, extract


class TokenText(Protocol):
    def token_bytes(self, token_id: int) -> bytes: ...


@dataclass(frozen=True)
class Context:
    request_id: str
    model: str
    created: int
    chat: bool
    body: CompletionRequest | ChatCompletionRequest
    prompts: list[tuple[list[int], str | None]]
    n: int
    tokenizer: TokenText | None = None  # the tokens' real bytes (logprobs)
    tools: ToolPlan | None = None  # chat with tools: how tool calls are read back

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"


@dataclass
class Choice:
    index: int
    text: str = ""
    num_tokens: int = 0
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    offsets: CharOffsets | None = None  # streamed completions: text_offset so far


class Accumulator:
    """Collects deltas per choice (choice index = prompt index * n + sample index)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.choices = {i: Choice(i) for i in range(len(ctx.prompts) * ctx.n)}
        self.error: str | None = None
        self.echo = bool(getattr(ctx.body, "echo", False))
        self.num_logprobs = _requested_logprobs(ctx)
        self.prompt_only = bool(getattr(ctx.body, "prompt_only", False))
        self.prompt_logprobs_asked = getattr(ctx.body, "prompt_logprobs", None) is not None
        plan = ctx.tools
        self.tool_streams = {i: plan.stream() for i in self.choices} if plan else {}
        self.called: set[int] = set()  # choices that streamed a tool call

    def _choice(self, prompt_index: int, d: Delta) -> Choice:
        return self.choices[prompt_index * self.ctx.n + d.state.index]

    def add(self, prompt_index: int, d: Delta) -> Choice:
        c = self._choice(prompt_index, d)
        if c.prompt_logprobs is None:
            c.prompt_logprobs = d.state.prompt_logprobs
        if not self.prompt_only:  # NOTE: its one step's token is not part of the answer
            c.text += d.text
            c.num_tokens += len(d.token_ids)
            c.logprobs += d.logprobs
        if d.finished:
            c.finish_reason = "length" if self.prompt_only else d.state.finish_reason
            c.stop_reason = None if self.prompt_only else d.state.stop_reason
            if d.state.error:
                self.error = d.state.error
        return c

    # -- whole responses -----------------------------------------------------
    def response(self) -> dict:
        ctx = self.ctx
        choices = [self._choice_body(c) for c in self.choices.values()]
        body = {
            "id": ctx.request_id,
            "object": ctx.object_name,
            "created": ctx.created,
            "model": ctx.model,
            "choices": choices,
            "usage": self.usage(),
        }
        if ctx.chat and self.prompt_logprobs_asked:  # NOTE: vLLM's: one list, top level
            body["prompt_logprobs"] = prompt_logprobs_body(self.choices[0].prompt_logprobs)
        return body

    def _choice_body(self, c: Choice) -> dict:
        entries: list[dict[int, Logprob] | None] = list(c.logprobs)
        if self.echo and c.prompt_logprobs is not None:
            entries = c.prompt_logprobs + entries
        lp = self._logprobs(entries, c.index) if self.num_logprobs is not None else None
        if self.ctx.chat:
            message: dict = {"role": "assistant", "content": c.text}
            reason = _reason(c.finish_reason)
            if self.ctx.tools is not None:
                found = extract(self.ctx.tools.stream(), c.text)
                message["content"] = found.content
                if found.calls:
                    message["tool_calls"] = found.calls
                reason = self.ctx.tools.finish_reason(reason, bool(found.calls))
            return {
                "index": c.index,
                "message": message,
                "logprobs": lp,
                "finish_reason": reason,
                "stop_reason": c.stop_reason,
            }
        prompt_text = self._prompt_text(c.index) if self.echo else ""
        body = {
            "index": c.index,
            "text": prompt_text + c.text,
            "logprobs": lp,
            "finish_reason": _reason(c.finish_reason),
            "stop_reason": c.stop_reason,
        }
        if self.prompt_logprobs_asked:
            body["prompt_logprobs"] = prompt_logprobs_body(c.prompt_logprobs)
        return body

    def usage(self) -> dict:
        prompt = sum(len(ids) for ids, _ in self.ctx.prompts)
        completion = sum(c.num_tokens for c in self.choices.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def _prompt_text(self, index: int) -> str:
        _, text = self.ctx.prompts[index // self.ctx.n]
        return text if text is not None else ""

    # -- streaming -------------------------------------------------------------
    def opening_chunks(self) -> list[dict]:
        if self.ctx.chat:
            return [
                self._chunk(i, {"delta": {"role": "assistant", "content": ""}})
                for i in self.choices
            ]
        if self.echo:
            return [self._chunk(i, {"text": self._prompt_text(i)}) for i in self.choices]
        return []

    def stream_chunks(self, prompt_index: int, d: Delta) -> list[dict]:
        c = self.add(prompt_index, d)
        if not (d.text or d.finished or (self.num_logprobs is not None and d.logprobs)):
            return []
        lp = None
        if self.num_logprobs is not None:
            if c.offsets is None:  # NOTE: a streamed echo sends the prompt text first
                c.offsets = CharOffsets(len(self._prompt_text(c.index)) if self.echo else 0)
            lp = self._logprobs(list(d.logprobs), c.index, c.offsets)
        reason = _reason(c.finish_reason) if d.finished else None
        stop = c.stop_reason if d.finished else None
        if c.index in self.tool_streams:
            return self._tool_chunks(c.index, d, lp, reason)
        if self.ctx.chat:
            return [
                self._chunk(
                    c.index,
                    {
                        "delta": {"content": d.text},
                        "logprobs": lp,
                        "finish_reason": reason,
                        "stop_reason": stop,
                    },
                )
            ]
        body = {"text": d.text, "logprobs": lp, "finish_reason": reason, "stop_reason": stop}
        return [self._chunk(c.index, body)]

    def _tool_chunks(self, index: int, d: Delta, lp: dict | None, reason: str | None) -> list[dict]:
        """Content and tool-call pieces as the choice's stream reads them; the
        logprobs ride on the first chunk, the finish reason on the last."""
        ts = self.tool_streams[index]
        events = ts.feed(d.text) + (ts.finish() if d.finished else [])
        deltas: list[dict] = []
        for e in events:
            if isinstance(e, CallDelta):
                self.called.add(index)
                deltas.append({"tool_calls": [delta_body(e)]})
            else:
                deltas.append({"content": e})
        if not deltas and (d.finished or lp is not None):
            deltas.append({})
        plan = self.ctx.tools
        assert plan is not None
        if reason is not None:
            reason = plan.finish_reason(reason, index in self.called)
        chunks = []
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            body = {
                "delta": delta,
                "logprobs": lp if k == 0 else None,
                "finish_reason": reason if last else None,
            }
            chunks.append(self._chunk(index, body))
        return chunks

    def _chunk(self, index: int, body: dict) -> dict:
        ctx = self.ctx
        choice = {"index": index, "logprobs": None, "finish_reason": None, "stop_reason": None}
        choice.update(body)
        return {
            "id": ctx.request_id,
            "object": ctx.chunk_object,
            "created": ctx.created,
            "model": ctx.model,
            "choices": [choice],
        }

    def usage_chunk(self) -> dict:
        ctx = self.ctx
        return {
            "id": ctx.request_id,
            "object": ctx.chunk_object,
            "created": ctx.created,
            "model": ctx.model,
            "choices": [],
            "usage": self.usage(),
        }

    # -- logprobs ----------------------------------------------------------------
    def _logprobs(
        self,
        entries: list[dict[int, Logprob] | None],
        index: int,
        offsets: CharOffsets | None = None,
    ) -> dict:
        n, raw = self.num_logprobs or 0, self._raw_bytes
        if self.ctx.chat:
            return chat_logprobs(entries, n, raw)
        prompt_ids = self.ctx.prompts[index // self.ctx.n][0]
        return completion_logprobs(entries, n, raw, prompt_ids, offsets or CharOffsets())

    def _raw_bytes(self, token_id: int, lp: Logprob | None) -> bytes:
        tok = self.ctx.tokenizer
        if tok is not None:
            return tok.token_bytes(token_id)
        return ((lp.decoded_token if lp is not None else None) or "").encode()


def _requested_logprobs(ctx: Context) -> int | None:
    body = ctx.body
    if isinstance(body, ChatCompletionRequest):
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs


def _reason(reason: str | None) -> str | None:
    return None if reason in (None, "abort", "error") else reason


def error_body(message: str, kind: str, status: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def model_list(names: list[str], created: int) -> dict:
    """Every served name of the one model (`root`: the first, as vLLM)."""
    return {
        "object": "list",
        "data": [
            {
                "id": n,
                "object": "model",
                "created": created,
                "owned_by": "laneserve",
                "root": names[0],
            }
            for n in names
        ],
    }


def sse(obj: dict) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()
