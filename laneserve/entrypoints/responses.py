"""OpenAI response bodies: completion / chat objects, stream chunks, usage, errors."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Protocol

from laneserve.entrypoints.chat_parsing import ChoiceParser, delta_of, message_of
from laneserve.entrypoints.logprob_body import (
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_body,
)
from laneserve.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
from laneserve.frontend.output_processor import Delta
from laneserve.frontend.token_bytes import CharOffsets
from laneserve.outputs import Logprob
from laneserve.reasoning import ReasoningPlan
from laneserve.tool_calls.choice import ToolPlan


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
    reasoning: ReasoningPlan | None = None  # chat with a reasoning parser: thinking split off

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
    token_ids: list[int] = field(default_factory=list)
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
        self.token_ids = bool(getattr(ctx.body, "return_token_ids", False))
        self.ids_sent: set[int] = set()  # streamed choices that had their prompt ids
        parsed = ctx.chat and (ctx.tools is not None or ctx.reasoning is not None)
        self.parsers = (
            {i: ChoiceParser(ctx.reasoning, ctx.tools) for i in self.choices} if parsed else {}
        )
        self.prompt_logprobs_asked = getattr(ctx.body, "prompt_logprobs", None) is not None

    def _choice(self, prompt_index: int, d: Delta) -> Choice:
        return self.choices[prompt_index * self.ctx.n + d.state.index]

    def add(self, prompt_index: int, d: Delta) -> Choice:
        c = self._choice(prompt_index, d)
        if c.prompt_logprobs is None:
            c.prompt_logprobs = d.state.prompt_logprobs
        if not self.prompt_only:  # NOTE: its one step's token is not part of the answer
            c.text += d.text
            c.num_tokens += len(d.token_ids)
            c.token_ids += d.token_ids
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
        out = {
            "id": ctx.request_id,
            "object": ctx.object_name,
            "created": ctx.created,
            "model": ctx.model,
            "choices": choices,
            "usage": self.usage(),
        }
        if self.token_ids and ctx.chat:  # NOTE: one prompt per chat request
            out["prompt_token_ids"] = ctx.prompts[0][0]
        if self.token_ids:
            for body, c in zip(choices, self.choices.values(), strict=True):
                body["token_ids"] = c.token_ids
                if not ctx.chat:
                    body["prompt_token_ids"] = ctx.prompts[c.index // ctx.n][0]
        if ctx.chat and self.prompt_logprobs_asked:  # NOTE: vLLM's: one list, top level
            out["prompt_logprobs"] = prompt_logprobs_body(self.choices[0].prompt_logprobs)
        return out

    def _choice_body(self, c: Choice) -> dict:
        entries: list[dict[int, Logprob] | None] = list(c.logprobs)
        if self.echo and c.prompt_logprobs is not None:
            entries = c.prompt_logprobs + entries
        lp = self._logprobs(entries, c.index) if self.num_logprobs is not None else None
        if self.ctx.chat:
            message: dict = {"role": "assistant", "content": c.text}
            reason = _reason(c.finish_reason)
            if self.parsers:
                parser = ChoiceParser(self.ctx.reasoning, self.ctx.tools)
                message = message_of(parser.feed(c.text, True), self.ctx.reasoning is not None)
            if self.ctx.tools is not None:
                reason = self.ctx.tools.finish_reason(reason, "tool_calls" in message)
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
        return self._with_ids(c.index, self._step_chunks(c, d), d)

    def _step_chunks(self, c: Choice, d: Delta) -> list[dict]:
        if not (d.text or d.finished or (d.token_ids and self.token_ids) or
                (self.num_logprobs is not None and d.logprobs)):  # fmt: skip
            return []
        lp = None
        if self.num_logprobs is not None:
            if c.offsets is None:  # NOTE: a streamed echo sends the prompt text first
                c.offsets = CharOffsets(len(self._prompt_text(c.index)) if self.echo else 0)
            lp = self._logprobs(list(d.logprobs), c.index, c.offsets)
        reason = _reason(c.finish_reason) if d.finished else None
        stop = c.stop_reason if d.finished else None
        if c.index in self.parsers:
            return self._parsed_chunks(c.index, d, lp, reason)
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

    def _parsed_chunks(
        self, index: int, d: Delta, lp: dict | None, reason: str | None
    ) -> list[dict]:
        """Reasoning, content and tool-call pieces as the choice's parser reads them;
        the logprobs ride on the first chunk, the finish reason on the last."""
        parser = self.parsers[index]
        deltas = [delta_of(e) for e in parser.feed(d.text, d.finished)]
        if not deltas and (d.finished or lp is not None or (self.token_ids and d.token_ids)):
            deltas.append({})
        if reason is not None and self.ctx.tools is not None:
            reason = self.ctx.tools.finish_reason(reason, parser.called)
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

    def _with_ids(self, index: int, chunks: list[dict], d: Delta) -> list[dict]:
        """return_token_ids: the new token ids ride on a choice's first chunk of the
        step, the prompt's ids on its first chunk of all."""
        if not self.token_ids or not chunks:
            return chunks
        choice = chunks[0]["choices"][0]
        choice["token_ids"] = list(d.token_ids)
        if index not in self.ids_sent:
            self.ids_sent.add(index)
            choice["prompt_token_ids"] = self.ctx.prompts[index // self.ctx.n][0]
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
