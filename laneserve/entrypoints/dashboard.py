"""`/dashboard`: the live page, its data, and its history (docs/dashboard.md).

The dashboard is its own small ASGI app in front of the API app: `DashboardRouter`
sends every path under /dashboard here and everything else (lifespan included) to
the API app unchanged, so the API's middleware and routes know nothing about it.
A sampler task reads the server's metrics registry once a second (`LiveFeed`) and
writes a point to the history file every `--dashboard-sample-s` seconds, from a
worker thread. The page polls `/dashboard/data` for the live view and pages through
`/dashboard/history` for the last hour or day; it loads nothing from elsewhere (the
charting library is vendored under laneserve/static, and the page's
Content-Security-Policy allows only this origin).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route, Router
from starlette.staticfiles import StaticFiles

from laneserve.entrypoints.dashboard_auth import DashboardAuth
from laneserve.entrypoints.dashboard_flags import DashboardOptions
from laneserve.entrypoints.middleware import ASGIApp, Receive, Scope, Send, error_json
from laneserve.obs.history import MAX_PAGE, HistoryStore
from laneserve.obs.lane_metrics import LaneMetrics
from laneserve.obs.live_feed import RATE_WINDOW_S, STATS_WINDOW_S, LiveFeed, timeline

if TYPE_CHECKING:
    from laneserve.entrypoints.api_server import ServerState

log = logging.getLogger(__name__)

STATIC = Path(__file__).resolve().parent.parent / "static" / "dashboard"
PREFIX = "/dashboard"
TICK_S = 1.0
LANE_LOG_READ = 2048  # steps read from the engine's lane log per tick (all it keeps)
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; form-action 'self'; base-uri 'none'"
)


class Dashboard:
    def __init__(
        self, state: ServerState, opts: DashboardOptions, flags: dict[str, Any], address: str
    ) -> None:
        self.state = state
        self.opts = opts
        self.flags = flags
        self.started = time.time()
        self.feed = LiveFeed(state.metrics.registry, opts.sample_s)
        self.lane_metrics = LaneMetrics(state.metrics.registry, state.model_name)
        self.store = HistoryStore(opts.history, address, opts.retention_s)
        self.auth = DashboardAuth(state.api_key)
        self._task: asyncio.Task | None = None

    # -- sampling ------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.to_thread(self.store.close)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                lanes = self._lanes(LANE_LOG_READ)
                self.lane_metrics.observe(lanes)
                point = self.feed.tick(time.time(), lanes)
                if point is not None:
                    await asyncio.to_thread(self.store.add, point)
            except asyncio.CancelledError:
                raise
            except Exception:  # NOTE: the dashboard never takes the server down
                log.exception("dashboard sampler")

    def _lanes(self, n: int) -> list:
        engine = self.state.llm.engine
        return engine.core.lane_log.recent(n) if engine is not None else []

    # -- answers -------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.state.model_name,
            "aliases": self.state.aliases,
            "uptime_s": time.time() - self.started,
            "flags": self.flags,
            "sample_s": self.opts.sample_s,
            "retention_s": self.opts.retention_s,
            "rate_window_s": RATE_WINDOW_S,
            "stats_window_s": STATS_WINDOW_S,
            "ready": False,
        }
        engine = self.state.llm.engine
        if engine is None:
            return out
        ready = engine.core.ready
        out.update(
            ready=True,
            device=ready.device,
            weight_dtype=ready.weight_dtype,
            kernels=ready.kernels,
            max_model_len=ready.max_model_len,
            block_size=ready.block_size,
            cache_groups=[
                {
                    "name": g.name,
                    "kind": g.kind,
                    "num_blocks": g.num_blocks,
                    "block_size": g.block_size or ready.block_size,
                    "window": g.window,
                }
                for g in ready.cache_groups
            ],
            worker_restarts=engine.core.num_worker_restarts,
            async_scheduling=engine.config.scheduler.async_scheduling,
        )
        return out

    async def page(self, request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers={"content-security-policy": CSP})

    async def data(self, request: Request) -> Response:
        since = _number(request, "since", 0.0)
        points = self.feed.recent(since)
        lanes = timeline(self._lanes(self.opts.steps))
        return JSONResponse(
            {"now": time.time(), "info": self.info(), "points": points, "lanes": lanes}
        )

    async def history(self, request: Request) -> Response:
        since = _number(request, "since", time.time() - 3600)
        until = _number(request, "until", None)
        limit = float(_number(request, "limit", 1000))
        if not (limit.is_integer() and 1 <= limit <= MAX_PAGE):
            raise _BadParam(f"limit must be in [1, {MAX_PAGE}], got {limit}")
        points, nxt = await asyncio.to_thread(self.store.page, since, int(limit), until)
        return JSONResponse({"points": points, "next": nxt, "sample_s": self.opts.sample_s})

    def app(self) -> ASGIApp:
        router = Router(
            routes=[
                Route(PREFIX, self.page, methods=["GET"]),
                Route(f"{PREFIX}/", self.page, methods=["GET"]),
                Route(f"{PREFIX}/data", self.data, methods=["GET"]),
                Route(f"{PREFIX}/history", self.history, methods=["GET"]),
                Route(f"{PREFIX}/login", self.auth.login, methods=["POST"]),
                Mount(f"{PREFIX}/static", StaticFiles(directory=STATIC)),
            ]
        )

        async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
            request = Request(scope, receive)
            if scope["path"] != f"{PREFIX}/login" and not self.auth.allowed(request):
                await self.auth.refuse(request)(scope, receive, send)
                return
            try:
                await router(scope, receive, send)
            except _BadParam as e:
                body = error_json(str(e), "BadRequestError", 400)
                await Response(body, 400, media_type="application/json")(scope, receive, send)

        return guarded


class _BadParam(ValueError):
    pass


def _number(request: Request, name: str, default: Any) -> Any:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise _BadParam(f"{name} must be a number, got {raw!r}") from None
    if not math.isfinite(value):
        raise _BadParam(f"{name} must be finite, got {raw!r}")
    return value


class DashboardRouter:
    """/dashboard and below to the dashboard; every other scope to the API app."""

    def __init__(self, api: ASGIApp, dashboard: ASGIApp) -> None:
        self.api = api
        self.dashboard = dashboard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == PREFIX or path.startswith(PREFIX + "/")):
            await self.dashboard(scope, receive, send)
            return
        await self.api(scope, receive, send)
