"""vLLM's utility endpoints: `/tokenize`, `/detokenize`, `/ping`, and
`/v1/embeddings` (a 400: the served models generate text, they do not embed).

Shapes as vLLM serves them: `/tokenize` takes a `prompt` (completions style) or
`messages` (chat style, rendered with the chat template) and answers `count`,
`max_model_len`, `tokens` and `token_strs` (with `return_token_strs`);
`/detokenize` takes `tokens` and answers `prompt`. `/ping` answers as `/health`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from laneserve.entrypoints.api_errors import APIError
from laneserve.entrypoints.openai_protocol import ChatMessage, Text, ToolDef


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenizeCompletionRequest(_Strict):
    model: Text | None = None
    prompt: Text
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChatRequest(_Strict):
    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    return_token_strs: StrictBool = False
    chat_template: Text | None = None
    chat_template_kwargs: dict | None = None
    tools: list[ToolDef] | None = None


class DetokenizeRequest(_Strict):
    model: Text | None = None
    tokens: list[StrictInt]


def add_token_routes(
    app: FastAPI,
    engine: Callable[[], Any],
    check_model: Callable[[str | None], None],
    health: Callable[[], Any],
    trust_template: bool,
) -> None:
    """`engine()`: the engine or a 503; `check_model(name)`: a 404 for another model;
    `health()`: the /health handler; `trust_template`: --trust-request-chat-template."""

    @app.post("/tokenize")
    async def tokenize(body: TokenizeChatRequest | TokenizeCompletionRequest) -> dict:
        check_model(body.model)
        eng = engine()
        tok = eng.tokenizer
        try:
            if isinstance(body, TokenizeChatRequest):
                ids = _chat_ids(tok, body, trust_template)
            else:
                ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e)) from None
        strs = [tok.token_text(i) for i in ids] if body.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": eng.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        check_model(body.model)
        tok = engine().tokenizer
        bad = next((t for t in body.tokens if not 0 <= t < tok.vocab_size), None)
        if bad is not None:
            raise APIError(
                400, f"token id {bad} is outside the vocabulary (0..{tok.vocab_size - 1})", "tokens"
            )
        return {"prompt": tok.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/ping")
    async def ping_get() -> Response:
        return await health()

    @app.post("/ping")
    async def ping_post() -> Response:
        return await health()

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        raise APIError(
            400,
            "this model does not embed: laneserve serves generative models only "
            "(use /v1/completions or /v1/chat/completions)",
            "BadRequestError",
            "model",
        )


def _chat_ids(tok, body: TokenizeChatRequest, trust_template: bool) -> list[int]:
    if body.chat_template is not None and not trust_template:
        raise ValueError(
            "chat_template: a request's own template needs --trust-request-chat-template"
        )
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    ids = tok.apply_chat_template(
        [m.for_template() for m in body.messages],
        body.add_generation_prompt and not body.continue_final_message,
        chat_template=body.chat_template,
        chat_template_kwargs=body.chat_template_kwargs,
        continue_final_message=body.continue_final_message,
        tools=tools,
    )
    if body.add_special_tokens and tok.hf.bos_token_id is not None:
        ids = [tok.hf.bos_token_id, *ids]
    return list(ids)
