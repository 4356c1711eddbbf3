"""Soak test for `laneserve serve` (not run in CI).

Minutes of mixed traffic against one server: completions and chat, streaming
and not, n > 1, a share of clients that leave early (a short client timeout,
or a stream closed after a few events) and of malformed requests. Every
minute it prints the requests sent, the answers by HTTP status, p50 / p99
latency of the completed requests, and the RSS of the server and of its
worker process. When the traffic stops it waits for the engine to drain and
checks that running / waiting are 0 and the KV cache is empty (no leaked
blocks), and reports RSS growth after the warm-up minutes (`--warmup-minutes`).

    python benchmarks/soak.py --minutes 30 --concurrency 8            # starts a server
    python benchmarks/soak.py --server-arg=--num-kv-blocks=1024       # a smaller KV cache
    python benchmarks/soak.py --url http://127.0.0.1:8000 --pid 1234  # attaches to one

The KV cache is allocated untouched: the worker's RSS grows as blocks are first written,
until every block has been used once (with the default budget that takes many minutes;
with `--num-kv-blocks=1024` about four), so growth counts from the end of the warm-up. Exit status 1 if any
5xx was seen or the engine did not drain.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

PROMPTS = [
    "The old lighthouse stood at the end",
    "Cooking offers a way to",
    "In the spring of that year the river",
    "A short note on the history of",
]


@dataclass
class Minute:
    sent: int = 0
    statuses: Counter = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def make_body(rng: random.Random, model: str) -> tuple[str, dict]:
    kind = rng.random()
    common = {"model": model, "max_tokens": rng.choice([8, 32, 128]), "temperature": 0.7}
    common["stream"] = rng.random() < 0.5
    if kind < 0.05:  # malformed: must be a 4xx, never a 5xx
        return "/v1/completions", {"prompt": "\ud800", "max_tokens": 2**70}
    if kind < 0.4:
        msgs = [{"role": "user", "content": rng.choice(PROMPTS)}]
        return "/v1/chat/completions", {**common, "messages": msgs}
    return "/v1/completions", {**common, "prompt": rng.choice(PROMPTS), "n": rng.choice([1, 1, 4])}


async def one(client: httpx.AsyncClient, rng: random.Random, model: str, m: Minute) -> None:
    path, body = make_body(rng, model)
    leave = rng.random() < 0.15  # a client that goes away early
    m.sent += 1
    start = time.monotonic()
    # NOTE: json.dumps escapes lone surrogates (httpx's json= would fail on them)
    kw = {"content": json.dumps(body).encode(), "headers": {"content-type": "application/json"}}
    try:
        if body.get("stream"):
            async with client.stream("POST", path, **kw) as r:
                events = 0
                async for line in r.aiter_lines():
                    events += line.startswith("data: ")
                    if leave and events >= 3:
                        break
                status = r.status_code
        else:
            timeout = 0.2 if leave else 300
            r = await client.post(path, timeout=timeout, **kw)
            status = r.status_code
    except httpx.TimeoutException:
        status = "left"
    except httpx.HTTPError as e:
        status = type(e).__name__
    m.statuses[status] += 1
    if status == 200 and not leave:
        m.latencies.append(time.monotonic() - start)


async def traffic(
    url: str, model: str, minutes: float, concurrency: int, pids: list[int], warmup: int
) -> bool:
    rng = random.Random(0)
    limits = httpx.Limits(max_connections=concurrency * 2)
    ok = True
    rss_first: tuple[float, float] | None = None
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        end = time.monotonic() + minutes * 60
        minute_no = 0
        while time.monotonic() < end:
            m, until = Minute(), min(end, time.monotonic() + 60)
            while time.monotonic() < until:
                await asyncio.gather(*(one(client, rng, model, m) for _ in range(concurrency)))
            minute_no += 1
            server_rss, worker_rss = rss_mb(pids[0]), sum(rss_mb(p) for p in pids[1:])
            if minute_no == warmup:
                rss_first = (server_rss, worker_rss)
            lat = sorted(m.latencies)
            p50 = statistics.median(lat) if lat else float("nan")
            p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan")
            fives = sum(v for k, v in m.statuses.items() if isinstance(k, int) and k >= 500)
            ok &= fives == 0
            print(
                f"min {minute_no:3d}  sent {m.sent:5d}  status {dict(m.statuses)}  "
                f"p50 {p50:6.2f}s p99 {p99:6.2f}s  rss server {server_rss:7.1f} MB "
                f"worker {worker_rss:7.1f} MB",
                flush=True,
            )
    ok &= await drained(url)
    if rss_first is not None and len(pids) > 1:
        now = (rss_mb(pids[0]), sum(rss_mb(p) for p in pids[1:]))
        for name, a, b in (("server", rss_first[0], now[0]), ("worker", rss_first[1], now[1])):
            print(f"{name} RSS after warm-up: {a:.1f} -> {b:.1f} MB ({(b / a - 1) * 100:+.1f} %)")
    return ok


async def drained(url: str, limit_s: float = 60) -> bool:
    """Running, waiting and KV usage back to zero once traffic stops."""
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + limit_s
    async with httpx.AsyncClient(base_url=url) as client:
        while True:
            text = (await client.get("/metrics")).text
            values = {
                s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            }
            keys = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
            left = {k: values.get(f"vllm:{k}") for k in keys}
            if all(v == 0 for v in left.values()):
                print(f"drained: {left}")
                return True
            if time.monotonic() > deadline:
                print(f"NOT drained after {limit_s:.0f} s: {left}")
                return False
            await asyncio.sleep(0.5)


def start_server(ns: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    url = f"http://127.0.0.1:{ns.port}"
    cmd = [sys.executable, "-m", "laneserve.entrypoints.cli", "serve", "--port", str(ns.port)]
    cmd += ["--served-model-name", ns.model_name]
    if ns.model:
        cmd += ["--model", ns.model]
    cmd += ns.server_arg
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit("the server did not become healthy")


def add_server_args(p: argparse.ArgumentParser, model_name: str, port: int) -> None:
    """The options that attach to a server or start one (shared with fault_timing.py)."""
    p.add_argument("--url", default=None, help="attach to a running server (else start one)")
    p.add_argument("--pid", type=int, default=None, help="the attached server's pid")
    p.add_argument("--model", default=None, help="model for the started server")
    p.add_argument("--model-name", default=model_name)
    p.add_argument("--port", type=int, default=port)
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="a flag for the started server (repeatable), e.g. --server-arg=--num-kv-blocks=1024",
    )


def server_for(ns: argparse.Namespace) -> tuple[subprocess.Popen | None, str, int | None]:
    """(the started server or None, its URL, its pid) from add_server_args' options."""
    if ns.url is not None:
        return None, ns.url, ns.pid
    proc, url = start_server(ns)
    return proc, url, proc.pid


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_args(p, "soak", 8765)
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument(
        "--warmup-minutes",
        type=int,
        default=5,
        help="RSS growth is reported from the end of this minute (the KV cache fills first)",
    )
    p.add_argument("--concurrency", type=int, default=8)
    ns = p.parse_args()
    proc, url, pid = server_for(ns)
    try:
        pids = [pid, *children(pid)] if pid else []
        ok = asyncio.run(
            traffic(url, ns.model_name, ns.minutes, ns.concurrency, pids, ns.warmup_minutes)
        )
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    print("OK" if ok else "FAILED: 5xx answers or an engine that did not drain")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
