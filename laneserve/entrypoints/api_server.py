"""The OpenAI-compatible HTTP server (FastAPI): routes, auth, limits, errors.

Completions and chat share one path: prepare (tokenize, render the chat
template, compile the grammar: `prepare.py`, on the `Offload` threads, never on
the event loop) -> check the served model's limits -> AsyncLLM.submit per prompt (admitted or refused before any byte of
the response: a full queue is a 503 for streams too) -> either collect (JSON)
or stream (SSE, `data: [DONE]` at the end; a request that fails mid-stream
gets an error event). A client that leaves aborts its requests: streams notice
it when starlette cancels them, collected requests by watching the ASGI
channel for `http.disconnect`. Response bodies are built in `responses.py`, errors in
`api_errors.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.middleware.cors import CORSMiddleware

import laneserve
from laneserve.config import DEFAULT_MAX_N, DEFAULT_MAX_REQUEST_BYTES
from laneserve.entrypoints import prepare
from laneserve.entrypoints import responses as R
from laneserve.entrypoints.api_errors import (
    APIError,
    error_for,
    install_error_handlers,
    request_failure,
)
from laneserve.entrypoints.middleware import GuardMiddleware
from laneserve.entrypoints.offload import Offload, call
from laneserve.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
from laneserve.entrypoints.responses_api import Hooks, add_responses_route
from laneserve.entrypoints.streams import SSEResponse, client_left, close_all, merged
from laneserve.entrypoints.token_routes import add_token_routes
from laneserve.frontend.async_llm import AsyncLLM
from laneserve.frontend.output_processor import Delta, RequestState
from laneserve.obs.metrics import RequestTimes, ServerMetrics
from laneserve.reasoning import ReasoningPlan, reasoning_plan
from laneserve.sampling_params import SamplingParams
from laneserve.tool_calls.choice import ToolPlan

log = logging.getLogger(__name__)

DEFAULT_HEALTH_STALL_S = 60.0


@dataclass
class ServerState:
    llm: AsyncLLM
    model_name: str
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_n: int = DEFAULT_MAX_N  # choices per request (prompts x n)
    protect_metrics: bool = False  # /metrics needs the API key too
    allowed_origins: list[str] = field(default_factory=list)  # CORS; none by default
    draining: bool = False  # shutting down: health is 503, new requests too
    aliases: list[str] = field(default_factory=list)  # more served names of the model
    trust_request_chat_template: bool = False  # a request may bring its own template
    tool_parser: str | None = None  # --tool-call-parser, with --enable-auto-tool-choice
    reasoning_parser: str | None = None  # --reasoning-parser
    # /health is 503 once one engine step has run this long (a stopped or hung worker)
    health_stall_s: float = DEFAULT_HEALTH_STALL_S
    metrics: ServerMetrics = field(init=False)
    offload: Offload = field(default_factory=Offload)  # request preparation, off the loop
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.model_name, self.llm.config.parallel.data_parallel_size)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="laneserve", version=laneserve.__version__)
    app.state.s = state
    _install_middleware(app, state)
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        problem = _unavailable(state)
        if problem is not None:
            return JSONResponse({"status": problem}, status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": laneserve.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        return R.model_list([state.model_name, *state.aliases], state.created)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_fields(body)
        _check_model(state, body.model)
        engine = _engine(state)
        ready = await _prepared(state, call(prepare.completion, engine, body))
        return await _serve(state, request, "cmpl", body, ready.prompts, ready.params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        _check_fields(body)
        _check_model(state, body.model)
        ready = await prepare_chat(state, body)
        reasoning = reasoning_plan(state.reasoning_parser, body.chat_template_kwargs)
        prompts, params, tools = ready.prompts, ready.params, ready.tools
        return await _serve(
            state, request, "chatcmpl", body, prompts, params, chat=True, tools=tools,
            reasoning=reasoning,
        )  # fmt: skip

    add_token_routes(
        app,
        lambda: _engine(state),
        lambda model: _check_model(state, model),
        health,
        state.trust_request_chat_template,
    )
    add_responses_route(
        app,
        Hooks(
            state.model_name,
            lambda model: _check_model(state, model),
            lambda body: prepare_chat(state, body),
            lambda prompts, params: start(state, "resp", prompts, params, True),
            lambda d, clock: _record(state, d, clock),
        ),
    )
    return app


# -- request handling ------------------------------------------------------------
async def prepare_chat(state: ServerState, body: ChatCompletionRequest) -> prepare.Prepared:
    """The prompt (chat template applied), the sampling parameters and the tool plan
    of a chat request, made off the event loop (APIError: a 400 / 503)."""
    if body.chat_template is not None and not state.trust_request_chat_template:
        raise APIError(
            400,
            "chat_template: a request's own template needs --trust-request-chat-template",
            param="chat_template",
        )
    engine = _engine(state)
    return await _prepared(state, call(prepare.chat, engine, body, state.tool_parser))


def _unavailable(state: ServerState) -> str | None:
    """Why the server cannot take requests now, or None."""
    llm = state.llm
    if not llm.ready:
        return "loading"
    if not llm.running:
        return "the engine loop stopped"
    if state.draining:
        return "shutting down"
    if llm.restarting:
        return "the worker is restarting"
    if not llm.healthy:
        return "the worker died and was not restarted"
    stalled = llm.stalled_s
    if stalled > state.health_stall_s:
        return (
            f"the worker has made no progress for {stalled:.0f} s "
            f"(the limit is {state.health_stall_s:g} s, --health-stall-timeout-s)"
        )
    return None


def _engine(state: ServerState):
    problem = _unavailable(state)
    if problem is not None:
        raise APIError(503, f"unavailable: {problem}", "ServiceUnavailableError")
    return state.llm.engine


def _check_fields(body: CompletionRequest | ChatCompletionRequest) -> None:
    bad = body.unsupported_field()
    if bad is not None:
        raise APIError(400, bad[1], param=bad[0])


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name and model not in state.aliases:
        raise APIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")


async def _prepared(state: ServerState, job: Callable[[], prepare.Prepared]) -> prepare.Prepared:
    """The request's tokens and params, made on the offload threads (see prepare.py)."""
    try:
        return await state.offload.run(job, "preparing the request")
    except APIError:
        raise
    except ValueError as e:
        raise APIError(400, str(e)) from None
    except (KeyboardInterrupt, SystemExit, asyncio.CancelledError):
        raise
    except BaseException as e:  # NOTE: a panic of a native library included
        first = str(e).splitlines()[0] if str(e) else ""
        raise APIError(
            500, f"internal error: {type(e).__name__}: {first}", "InternalServerError"
        ) from None


def _check_limits(state: ServerState, engine, params: SamplingParams, num_prompts: int) -> None:
    """The served model's and the server's limits (SamplingParams checked the rest)."""
    choices = num_prompts * params.n
    if choices > state.max_n:
        raise APIError(
            400,
            f"the request asks for {choices} choices ({num_prompts} prompts x n={params.n}); "
            f"the limit is {state.max_n} (--max-n)",
            param="n",
        )
    if params.max_tokens is not None and params.max_tokens > engine.max_model_len:
        raise APIError(
            400,
            f"max_tokens must be <= max_model_len ({engine.max_model_len}), "
            f"got {params.max_tokens}",
            param="max_tokens",
        )


def _check_context(engine, ids: list[int], params: SamplingParams, chat: bool) -> None:
    """Prompt + max_tokens must fit the context (a 400, as vLLM does, not a cut-off)."""
    limit, n = engine.max_model_len, len(ids)
    if params.max_tokens is None or n >= limit or n + params.max_tokens <= limit:
        return  # NOTE: a prompt alone too long is check_request's error
    field = "max_completion_tokens" if chat else "max_tokens"
    raise APIError(
        400,
        f"'{field}' is too large: {params.max_tokens}. This model's maximum context length "
        f"(max_model_len) is {limit} tokens and your request has {n} input tokens "
        f"({params.max_tokens} > {limit} - {n}).",
        param=field,
    )


async def _serve(
    state: ServerState,
    request: Request,
    prefix: str,
    body: CompletionRequest | ChatCompletionRequest,
    prompts: list[tuple[list[int], str | None]],
    params: SamplingParams,
    chat: bool,
    tools: ToolPlan | None = None,
    reasoning: ReasoningPlan | None = None,
) -> Response:
    if await request.is_disconnected():  # NOTE: gone while it was prepared: not admitted
        return Response(status_code=499)
    rid, streams = await start(state, prefix, prompts, params, chat)
    ctx = R.Context(
        rid,
        state.model_name,
        int(time.time()),
        chat,
        body,
        prompts,
        params.n,
        _engine(state).tokenizer,
        tools,
        reasoning,
    )
    if body.stream:
        return SSEResponse(_sse(state, ctx, streams), streams)
    return await _collect(state, request, ctx, streams)


async def start(
    state: ServerState,
    prefix: str,
    prompts: list[tuple[list[int], str | None]],
    params: SamplingParams,
    chat: bool,
) -> tuple[str, list]:
    """Check the prompts against the limits and admit them: (request id, streams)."""
    engine = _engine(state)
    _check_limits(state, engine, params, len(prompts))
    for ids, _ in prompts:
        try:
            engine.check_request(ids, params)
        except ValueError as e:
            raise APIError(400, str(e), param="messages" if chat else "prompt") from None
        _check_context(engine, ids, params, chat)
    rid = f"{prefix}-{uuid.uuid4().hex}"
    return rid, await _admit(state, rid, prompts, params)


async def _admit(
    state: ServerState, rid: str, prompts: list[tuple[list[int], str | None]], params
) -> list:
    """Submit every prompt; all are admitted, or none stays (the error is raised)."""
    subs = [state.llm.submit(f"{rid}-{i}", ids, params) for i, (ids, _) in enumerate(prompts)]
    results = await asyncio.gather(*subs, return_exceptions=True)
    streams = [r for r in results if not isinstance(r, BaseException)]
    error = next((r for r in results if isinstance(r, BaseException)), None)
    if error is not None:
        await close_all(streams)
        raise error_for(error) from None
    return streams


async def _collect(state: ServerState, request: Request, ctx: R.Context, streams: list) -> Response:
    acc = R.Accumulator(ctx)
    clock: dict[int, float] = {}

    async def run() -> None:
        async for i, d in merged(streams):
            acc.add(i, d)
            _record(state, d, clock)

    task = asyncio.create_task(run())
    gone = asyncio.create_task(client_left(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():  # the client left: cancelling closes (aborts) the streams
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return Response(status_code=499)
        task.result()
    except Exception as e:
        raise error_for(e) from None
    finally:
        gone.cancel()
    if acc.error is not None:
        raise request_failure(acc.error)
    return JSONResponse(acc.response())


async def _sse(state: ServerState, ctx: R.Context, streams: list) -> AsyncIterator[bytes]:
    acc = R.Accumulator(ctx)
    clock: dict[int, float] = {}
    opened = False
    try:
        async for i, d in merged(streams):
            if not opened:  # NOTE: the role / echo chunks come with the first token
                opened = True
                for chunk in acc.opening_chunks():
                    yield R.sse(chunk)
            if d.finished and d.state.error:  # NOTE: an error event, not an empty chunk
                raise request_failure(d.state.error)
            for chunk in acc.stream_chunks(i, d):
                yield R.sse(chunk)
            _record(state, d, clock)
        if ctx.body.include_usage:
            yield R.sse(acc.usage_chunk())
    except Exception as e:
        err = error_for(e)
        yield R.sse(R.error_body(err.message, err.kind, err.status, err.param))
    yield b"data: [DONE]\n\n"


def _record(state: ServerState, d: Delta, clock: dict[int, float]) -> None:
    """Latency metrics; `clock` keeps each request's last token time (ITL)."""
    st, now = d.state, time.monotonic()
    key = st.request.handle
    if d.token_ids:
        if key in clock:
            state.metrics.observe_itl(now - clock[key], st.request.dp_rank)
        clock[key] = now
    if d.finished:
        clock.pop(key, None)
        if not st.error:  # NOTE: failures are counted by record_failed
            _finished(state, st, now, st.finish_reason)


def record_failed(state: ServerState, failed: list[RequestState]) -> None:
    """Samples that finished with an error (AsyncLLM.on_failed), counted on the engine
    thread: a stream that ends at its first failed sample never reads its siblings'."""
    now = time.monotonic()
    for st in failed:
        _finished(state, st, now, "error")


def record_aborted(state: ServerState, dropped: list[RequestState]) -> None:
    """Samples dropped because their client left (AsyncLLM.on_abort): no delta reports
    them, so they are counted here as finished with reason "abort"."""
    now = time.monotonic()
    for st in dropped:
        _finished(state, st, now, "abort")


def _finished(state: ServerState, st: RequestState, now: float, reason: str | None) -> None:
    req = st.request
    state.metrics.observe_request(
        RequestTimes(
            arrival=req.arrival_time,
            scheduled=req.scheduled_time,
            first_token=st.first_token_time,
            finished=now,
            num_prompt=len(req.prompt_token_ids),
            num_output=len(st.token_ids),
            reason=reason,
            group=st.group_id,
            n=req.sampling_params.n,
            engine=req.dp_rank,
        )
    )


# -- middleware and errors ---------------------------------------------------------
def _install_middleware(app: FastAPI, state: ServerState) -> None:
    open_paths = {"/health", "/ping", "/version"} | (
        set() if state.protect_metrics else {"/metrics"}
    )
    app.add_middleware(
        GuardMiddleware,
        api_key=state.api_key,
        max_request_bytes=state.max_request_bytes,
        open_paths=frozenset(open_paths),
    )
    if state.allowed_origins:  # NOTE: added last, so outermost: preflights need no key
        app.add_middleware(
            CORSMiddleware,
            allow_origins=state.allowed_origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["authorization", "content-type"],
        )
