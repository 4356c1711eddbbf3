"""`laneserve serve`: the OpenAI-compatible server on the async engine.

The socket opens first and the model loads in the background (`/health` says
503 until it is ready). SIGTERM / Ctrl-C: the server stops accepting (health
and new requests on open connections get 503), lets open requests finish for
`--graceful-shutdown-s`, then ends the rest with an error (an SSE error event,
or a 503 body) rather than cutting them, and stops the worker process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from laneserve.config import DEFAULT_MAX_N, DEFAULT_MAX_REQUEST_BYTES
from laneserve.engine_args import EngineArgs
from laneserve.tool_calls.registry import PARSERS

if TYPE_CHECKING:
    from laneserve.entrypoints.api_server import ServerState
    from laneserve.frontend.async_llm import AsyncLLM

log = logging.getLogger("laneserve.serve")

_DRAIN_MARGIN_S = 5.0  # after the grace period: time for the error events to go out


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument(
        "model_tag", nargs="?", default=None, help="the model, as --model (vLLM's positional form)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model ids in the API, the first in responses (default: from --model)",
    )
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument(
        "--protect-metrics",
        action="store_true",
        help="/metrics needs the API key too (by default it is open, as /health is)",
    )
    p.add_argument(
        "--allowed-origins",
        nargs="*",
        default=[],
        help="CORS: origins that browsers may call from ('*' for any; none: no CORS)",
    )
    p.add_argument(
        "--max-n",
        type=int,
        default=DEFAULT_MAX_N,
        help="most choices in one request (prompts x n); more is a 400",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="larger request bodies are refused",
    )
    p.add_argument(
        "--graceful-shutdown-s",
        type=float,
        default=10.0,
        help="seconds open requests may finish in on shutdown",
    )
    p.add_argument(
        "--uvicorn-log-level",
        default="warning",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="uvicorn's own log level (access lines at info)",
    )
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests bring their own chat_template (rendered in a sandbox; costs CPU)",
    )
    p.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="accepted for vLLM compatibility: laneserve never logs request contents",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto" (and tools without tool_choice): read calls with --tool-call-parser',
    )
    p.add_argument(
        "--tool-call-parser",
        choices=sorted(PARSERS),
        default=None,
        help="the format the model writes tool calls in (with --enable-auto-tool-choice)",
    )
    EngineArgs.add_cli_args(p, default_worker_mode="process")
    p.set_defaults(func=run)


def served_name(model: str | None, override: list[str] | str | None) -> str:
    if isinstance(override, list):
        override = override[0] if override else None
    if override:
        return override
    if not model:
        from laneserve.model.loader import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME
    return Path(model).name.removesuffix(".gguf") or model


def run(ns: argparse.Namespace) -> int:
    # NOTE: imported here, not at the top: building the parser (`--help`) stays light
    import uvicorn

    from laneserve.entrypoints.api_server import ServerState, build_app, record_aborted
    from laneserve.frontend.async_llm import AsyncLLM

    if ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            print(f"error: two models given: {ns.model_tag!r} and --model {ns.model!r}")
            return 2
        ns.model = ns.model_tag
    args = EngineArgs.from_cli(ns)
    try:
        config = args.create_config()  # invalid flags fail here, before anything starts
    except ValueError as e:
        print(f"error: {e}")
        return 2
    if ns.max_n < 1:
        print(f"error: --max-n must be >= 1, got {ns.max_n}")
        return 2
    if ns.enable_auto_tool_choice and ns.tool_call_parser is None:
        print("error: --enable-auto-tool-choice needs --tool-call-parser")
        return 2
    llm = AsyncLLM(config, on_step=None)
    state = ServerState(
        llm,
        served_name(ns.model, ns.served_model_name),
        ns.api_key,
        ns.max_request_bytes,
        max_n=ns.max_n,
        protect_metrics=ns.protect_metrics,
        allowed_origins=list(ns.allowed_origins),
        aliases=list(ns.served_model_name or [])[1:],
        trust_request_chat_template=ns.trust_request_chat_template,
        tool_parser=ns.tool_call_parser if ns.enable_auto_tool_choice else None,
    )
    llm.on_step = lambda engine, deltas: state.metrics.refresh(engine)
    llm.on_abort = lambda dropped: record_aborted(state, dropped)
    app = build_app(state)
    server = _draining_server(
        uvicorn.Config(
            app,
            host=ns.host,
            port=ns.port,
            log_level=ns.uvicorn_log_level,
            timeout_graceful_shutdown=ns.graceful_shutdown_s + _DRAIN_MARGIN_S,
            lifespan="on",
        ),
        state,
        ns.graceful_shutdown_s,
    )
    failed: list[BaseException] = []

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        llm.start()
        watcher = asyncio.create_task(_announce(llm, server, state, ns, failed))
        try:
            yield
        finally:
            watcher.cancel()
            log.info("shutting down: aborting in-flight requests, stopping the worker")
            await asyncio.to_thread(llm.shutdown)

    app.router.lifespan_context = lifespan
    log.info("starting laneserve on http://%s:%d (loading %s)", ns.host, ns.port, state.model_name)
    server.run()
    if failed:
        print(f"error: {failed[0]}")
        return 2
    return 0


def _draining_server(config, state: ServerState, grace_s: float):
    """uvicorn's server, plus: on shutdown, mark the state draining and, once the
    grace period is over, end every request still running with an error."""
    import uvicorn

    from laneserve.frontend.async_llm import EngineStoppedError

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            state.draining = True
            error = EngineStoppedError(
                f"the server is shutting down (grace period of {grace_s:g} s over)"
            )
            timer = asyncio.get_running_loop().call_later(grace_s, state.llm.fail_all, error)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    return Server(config)


async def _announce(
    llm: AsyncLLM, server, state: ServerState, ns: argparse.Namespace, failed: list
) -> None:
    await asyncio.to_thread(llm.wait_ready)
    if llm.load_error is not None:
        failed.append(llm.load_error)
        server.should_exit = True
        return
    eng = llm.engine
    assert eng is not None  # ready without a load error: the engine exists
    state.metrics.describe(eng)
    log.info(
        "ready: serving %s at http://%s:%d/v1 (max_model_len %d, %s worker, %s)",
        state.model_name,
        ns.host,
        ns.port,
        eng.max_model_len,
        eng.config.worker.mode,
        "async scheduling" if eng.config.scheduler.async_scheduling else "sync scheduling",
    )
