"""`POST /v1/responses`: the OpenAI Responses API on top of the chat path.

The request becomes a chat request (responses_protocol.py); its answer becomes
output items: a `message` with one `output_text` part, and one `function_call`
item per tool call. Streaming sends OpenAI's events in order, each with a
`sequence_number`: `response.created`, `response.in_progress`, then per item
`response.output_item.added`, (`response.content_part.added`,
`response.output_text.delta`..., `response.output_text.done`,
`response.content_part.done`) or (`response.function_call_arguments.delta`,
`response.function_call_arguments.done`), `response.output_item.done`, and last
`response.completed` (or `response.incomplete` at the token limit,
`response.failed` on an error). With tools the answer is read whole first (a
call is known only once its text is complete), so its items come at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from laneserve.entrypoints.api_errors import APIError, error_for
from laneserve.entrypoints.openai_protocol import ChatCompletionRequest
from laneserve.entrypoints.prepare import Prepared
from laneserve.entrypoints.responses_events import events
from laneserve.entrypoints.responses_protocol import ResponsesRequest
from laneserve.entrypoints.responses_run import Run
from laneserve.entrypoints.streams import SSEResponse, client_left, close_all, merged
from laneserve.frontend.output_processor import Delta


@dataclass(frozen=True)
class Hooks:
    """What the route needs from the server (api_server.py passes them in)."""

    model_name: str
    check_model: Callable[[str | None], None]
    prepare: Callable[[ChatCompletionRequest], Awaitable[Prepared]]
    start: Callable[[list[tuple[list[int], str | None]], Any], Awaitable[tuple[str, list]]]
    record: Callable[[Delta, dict[int, float]], None]


def add_responses_route(app: FastAPI, hooks: Hooks) -> None:
    @app.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request) -> Response:
        hooks.check_model(body.model)
        refused = body.refused()
        if refused is not None:
            raise APIError(400, refused[1], param=refused[0])
        try:
            chat = body.to_chat()
        except (ValueError, ValidationError) as e:
            raise APIError(400, f"input: {_first_error(e)}", param="input") from None
        ready = await hooks.prepare(chat)
        prompts, params, tools = ready.prompts, ready.params, ready.tools
        _, streams = await hooks.start(prompts, params)
        run = Run(body, tools, len(prompts[0][0]))
        if body.model is None:
            run.body = body.model_copy(update={"model": hooks.model_name})
        if body.stream:
            return SSEResponse(events(run, streams, hooks.record), streams)
        return await _answer(request, run, streams, hooks.record)


async def _answer(request: Request, run: Run, streams: list, record) -> Response:
    """The whole response, unless the client leaves first (its request is aborted)."""
    task = asyncio.create_task(collect(run, streams, record))
    gone = asyncio.create_task(client_left(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return Response(status_code=499)
        return JSONResponse(task.result())
    finally:
        gone.cancel()
        await close_all(streams)


async def collect(run: Run, streams: list, record) -> dict:
    clock: dict[int, float] = {}
    try:
        async for _, d in merged(streams):
            run.add(d)
            record(d, clock)
    except Exception as e:
        raise error_for(e) from None
    if run.error:
        raise APIError(500, run.error, "InternalServerError")
    return run.response(run.status(), run.items())


def _first_error(e: Exception) -> str:
    if isinstance(e, ValidationError):
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err.get("loc", ()))
        return f"{loc}: {err.get('msg')}" if loc else str(err.get("msg"))
    return str(e)
