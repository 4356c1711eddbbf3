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
import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from laneserve.config import DEFAULT_MAX_N, DEFAULT_MAX_REQUEST_BYTES, EngineConfig
from laneserve.engine_args import EngineArgs
from laneserve.entrypoints import dashboard_flags, listen
from laneserve.model_path import check_model_path
from laneserve.reasoning import REASONING_PARSERS
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
    dashboard_flags.add_cli_args(p)
    p.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="chat answers: the model's thinking goes to reasoning_content (deepseek_r1: "
        "always; deepseek_v3 / deepseek_v4: when chat_template_kwargs turn thinking on)",
    )
    p.add_argument(
        "--health-stall-timeout-s",
        type=float,
        default=60.0,
        help="/health answers 503 while one engine step has run longer than this "
        "(a stopped or hung worker with work pending)",
    )
    p.add_argument(
        "--headless",
        action="store_true",
        help="with --nnodes > 1 on nodes 1..: run this node's ranks only (no API server, "
        "no engine); they join node 0 at --master-addr:--master-port",
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

    from laneserve.entrypoints.api_server import (
        ServerState,
        build_app,
        record_aborted,
        record_failed,
    )
    from laneserve.entrypoints.slow_clients import HeaderTimeoutProtocol
    from laneserve.frontend.async_llm import AsyncLLM

    if ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            print(f"error: two models given: {ns.model_tag!r} and --model {ns.model!r}")
            return 2
        ns.model = ns.model_tag
    args = EngineArgs.from_cli(ns)
    try:
        check_model_path(args.model)  # a hub id or a typo, before anything starts
        config = args.create_config()  # invalid flags fail here, before anything starts
    except ValueError as e:
        print(f"error: {e}")
        return 2
    if (err := _node_role_error(ns.headless, config)) is not None:
        print(f"error: {err}")
        return 2
    if ns.headless:
        return _run_headless(config)
    if ns.max_n < 1:
        print(f"error: --max-n must be >= 1, got {ns.max_n}")
        return 2
    if ns.enable_auto_tool_choice and ns.tool_call_parser is None:
        print("error: --enable-auto-tool-choice needs --tool-call-parser")
        return 2
    try:
        dash_opts = dashboard_flags.DashboardOptions.from_cli(ns) if ns.dashboard else None
    except ValueError as e:
        print(f"error: {e}")
        return 2
    if dash_opts is not None:  # the worker sends each step's lane spans for the timeline
        config = msgspec.structs.replace(
            config, worker=msgspec.structs.replace(config.worker, lane_times=True)
        )
    try:  # NOTE: before the model loads, so a busy port costs no load
        sock = listen.bind(ns.host, ns.port)
    except listen.PortInUseError as e:
        print(f"error: {e}")
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
        reasoning_parser=ns.reasoning_parser,
        health_stall_s=ns.health_stall_timeout_s,
    )
    llm.on_step = lambda engine, deltas: state.metrics.refresh(engine)
    llm.on_abort = lambda dropped: record_aborted(state, dropped)
    llm.on_failed = lambda failed: record_failed(state, failed)
    app = build_app(state)
    dash = None
    if dash_opts is not None:
        from laneserve.entrypoints.dashboard import Dashboard, DashboardRouter

        try:
            flags = dashboard_flags.server_flags(ns)
            dash = Dashboard(state, dash_opts, flags, f"{ns.host}:{ns.port}")
        except (OSError, sqlite3.Error) as e:
            print(f"error: the dashboard history {dash_opts.history}: {e}")
            return 2
    server = _draining_server(
        uvicorn.Config(
            app if dash is None else DashboardRouter(app, dash.app()),
            host=ns.host,
            port=ns.port,
            log_level=ns.uvicorn_log_level,
            timeout_graceful_shutdown=ns.graceful_shutdown_s + _DRAIN_MARGIN_S,
            lifespan="on",
            http=HeaderTimeoutProtocol,  # slow clients' half-sent headers time out
        ),
        state,
        ns.graceful_shutdown_s,
    )
    failed: list[BaseException] = []

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        llm.start()
        watcher = asyncio.create_task(_announce(llm, server, state, ns, failed))
        if dash is not None:
            dash.start()
        try:
            yield
        finally:
            watcher.cancel()
            if dash is not None:
                await dash.stop()
            log.info("shutting down: aborting in-flight requests, stopping the worker")
            await asyncio.to_thread(llm.shutdown)

    app.router.lifespan_context = lifespan
    log.info("starting laneserve on http://%s:%d (loading %s)", ns.host, ns.port, state.model_name)
    with sock:
        server.run(sockets=[sock])
    if failed:
        print(f"error: {failed[0]}")
        return 2
    return 0


def _node_role_error(headless: bool, config: EngineConfig) -> str | None:
    """Node 0 serves; the other nodes of a multi-node model only run ranks."""
    p = config.parallel
    if headless and p.nnodes == 1:
        return "--headless runs the ranks of a model spread over machines: it needs --nnodes > 1"
    if headless and p.node_rank == 0:
        return "--headless is for nodes 1..nnodes-1: node 0 runs the engine and the API server"
    if not headless and p.node_rank > 0:
        return f"node {p.node_rank} runs ranks only: add --headless (node 0 serves the API)"
    return None


def _run_headless(config: EngineConfig) -> int:
    import signal
    import threading

    from laneserve.ipc import follower_main
    from laneserve.worker.headless import run_headless
    from laneserve.worker.remote_worker import remote_worker_main

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    p = config.parallel
    if p.data_parallel_over_nodes:  # this node's data-parallel ranks' workers
        return run_headless(config, p.node_dp_ranks(), remote_worker_main, stop)
    return run_headless(config, p.node_ranks(), follower_main, stop)


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
            loop = asyncio.get_running_loop()
            timer = loop.call_later(grace_s, state.llm.fail_all, error)
            try:
                # NOTE: the listening sockets stay open meanwhile: a new client gets a
                # 503 (draining), not a refused connection
                deadline = loop.time() + grace_s + _DRAIN_MARGIN_S
                while state.llm.has_work and loop.time() < deadline:
                    await asyncio.sleep(0.05)
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
