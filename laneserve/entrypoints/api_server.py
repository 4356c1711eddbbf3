"""The OpenAI-compatible HTTP server (FastAPI): routes, auth, limits, errors.

Completions and chat share one path: tokenize -> AsyncLLM.generate per prompt
-> either collect (JSON) or stream (SSE, `data: [DONE]` at the end). Response
bodies are built in `responses.py`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

import laneserve
from laneserve.config import DEFAULT_MAX_REQUEST_BYTES
from laneserve.core.engine_core import EngineDeadError, QueueFullError
from laneserve.entrypoints import responses as R
from laneserve.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
from laneserve.frontend.async_llm import AsyncLLM
from laneserve.frontend.output_processor import Delta
from laneserve.obs.metrics import ServerMetrics
from laneserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(
        self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


@dataclass
class ServerState:
    llm: AsyncLLM
    model_name: str
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    metrics: ServerMetrics = field(init=False)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.model_name)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="laneserve", version=laneserve.__version__)
    app.state.s = state
    _install_middleware(app, state)
    _install_errors(app)

    @app.get("/health")
    async def health() -> Response:
        if not state.llm.healthy:
            detail = "loading" if not state.llm.ready else "the worker is dead"
            return JSONResponse({"status": detail}, status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": laneserve.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        return R.model_list(state.model_name, state.created)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(state, body.model)
        prompts = [_tokenize(state, p) for p in body.prompts()]
        params = _params(lambda: body.sampling_params(body.max_tokens, body.logprobs))
        return await _serve(state, request, "cmpl", body, prompts, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        _check_model(state, body.model)
        engine = _engine(state)
        try:
            ids = engine.tokenizer.apply_chat_template(
                body.chat_messages(), body.add_generation_prompt
            )
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        prompts = [(ids, None)]
        params = _params(lambda: body.sampling_params(body.max_new_tokens(), body.num_logprobs()))
        return await _serve(state, request, "chatcmpl", body, prompts, params, chat=True)

    return app


# -- request handling ------------------------------------------------------------
def _engine(state: ServerState):
    if not state.llm.ready:
        raise APIError(503, "the model is still loading", "ServiceUnavailableError")
    if not state.llm.healthy:
        raise APIError(503, "the worker died and was not restarted", "ServiceUnavailableError")
    return state.llm.engine


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")


def _params(build) -> SamplingParams:
    try:
        return build()
    except ValueError as e:
        raise APIError(400, str(e)) from None


def _tokenize(state: ServerState, prompt: str | list[int]) -> tuple[list[int], str | None]:
    engine = _engine(state)
    ids, text = engine.tokenize(prompt)
    return ids, text


async def _serve(
    state: ServerState,
    request: Request,
    prefix: str,
    body: CompletionRequest | ChatCompletionRequest,
    prompts: list[tuple[list[int], str | None]],
    params: SamplingParams,
    chat: bool,
) -> Response:
    engine = _engine(state)
    for ids, _ in prompts:
        try:
            engine.core.check_prompt(ids)
        except ValueError as e:
            raise APIError(400, str(e), param="messages" if chat else "prompt") from None
    limit = engine.config.scheduler.max_queued_requests
    if limit is not None and len(engine.core.scheduler.waiting) + len(prompts) > limit:
        raise APIError(
            503, f"too many queued requests (limit {limit}); retry later", "ServiceUnavailableError"
        )
    rid = f"{prefix}-{uuid.uuid4().hex}"
    ctx = R.Context(rid, state.model_name, int(time.time()), chat, body, prompts, params.n)
    streams = [state.llm.generate(f"{rid}-{i}", ids, params) for i, (ids, _) in enumerate(prompts)]
    if body.stream:
        return StreamingResponse(_sse(state, ctx, streams), media_type="text/event-stream")
    return await _collect(state, request, ctx, streams)


async def _merged(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    """Interleave the per-prompt streams as their deltas arrive."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: AsyncIterator[Delta]) -> None:
        try:
            async for d in s:
                await q.put((i, d))
            await q.put((i, None))
        except BaseException as e:
            await q.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    live = len(tasks)
    try:
        while live:
            i, item = await q.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            await s.aclose()


def _error_for(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFullError):
        return APIError(503, str(e), "ServiceUnavailableError")
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), "ServiceUnavailableError")
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    return APIError(500, f"internal error: {e}", "InternalServerError")


async def _collect(state: ServerState, request: Request, ctx: R.Context, streams: list) -> Response:
    acc = R.Accumulator(ctx)
    clock: dict[int, float] = {}

    async def run() -> None:
        async for i, d in _merged(streams):
            acc.add(i, d)
            _record(state, d, clock)

    task = asyncio.create_task(run())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()  # NOTE: closing the streams aborts the requests
                return Response(status_code=499)
        task.result()
    except Exception as e:
        raise _error_for(e) from None
    if acc.error is not None:
        raise APIError(500, acc.error, "InternalServerError")
    return JSONResponse(acc.response())


async def _sse(state: ServerState, ctx: R.Context, streams: list) -> AsyncIterator[bytes]:
    acc = R.Accumulator(ctx)
    clock: dict[int, float] = {}
    opened = False
    try:
        async for i, d in _merged(streams):
            if not opened:  # NOTE: the role / echo chunks come with the first token
                opened = True
                for chunk in acc.opening_chunks():
                    yield R.sse(chunk)
            for chunk in acc.stream_chunks(i, d):
                yield R.sse(chunk)
            _record(state, d, clock)
        if ctx.body.include_usage:
            yield R.sse(acc.usage_chunk())
    except Exception as e:
        err = _error_for(e)
        yield R.sse(R.error_body(err.message, err.kind, err.status))
    yield b"data: [DONE]\n\n"


def _record(state: ServerState, d: Delta, clock: dict[int, float]) -> None:
    """Latency metrics; `clock` keeps each request's last token time (ITL)."""
    st, now = d.state, time.monotonic()
    key = st.request.handle
    if d.token_ids:
        if key in clock:
            state.metrics.observe_itl(now - clock[key])
        clock[key] = now
    if d.finished:
        clock.pop(key, None)
        ttft = (st.first_token_time - st.request.arrival_time) if st.first_token_time else None
        state.metrics.observe_request(ttft, now - st.request.arrival_time)


# -- middleware and errors ---------------------------------------------------------
def _install_middleware(app: FastAPI, state: ServerState) -> None:
    open_paths = {"/health", "/metrics", "/version"}

    @app.middleware("http")
    async def guard(request: Request, call_next):
        needs_key = state.api_key is not None and request.url.path not in open_paths
        if needs_key and request.headers.get("authorization", "") != f"Bearer {state.api_key}":
            return _error_response(
                APIError(401, "invalid or missing API key", "AuthenticationError")
            )
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > state.max_request_bytes:
            msg = f"request body of {size} bytes exceeds the limit of {state.max_request_bytes}"
            return _error_response(APIError(413, msg, "RequestTooLargeError"))
        return await call_next(request)


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(R.error_body(e.message, e.kind, e.status, e.param), status_code=e.status)


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        if first.get("type") == "json_invalid":
            return _error_response(APIError(400, "the request body is not valid JSON"))
        return _error_response(
            APIError(
                400, f"{loc or 'body'}: {first.get('msg', 'invalid request')}", param=loc or None
            )
        )

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:
        return _error_response(APIError(e.status_code, str(e.detail), "HTTPError"))
