"""How fast `laneserve serve` reacts to clients that leave and to a dead worker (not CI).

Starts a server (or attaches to one with `--url`) and times two things, each over
`--repeats` rounds on an otherwise idle server:

* **abort after a client leaves**: a raw TCP client sends a long request (streaming,
  or not streaming with n > 1), waits until the engine runs it (and, streaming, until
  the first event arrives), closes its socket; the time is from the close to the
  engine having no running or waiting request, read from /metrics every 10 ms. The
  request asks for 1 000 tokens per choice; fewer than that must have been generated
  (it was aborted, not finished).
* **worker death**: `--streams` streaming requests run; the worker process gets
  SIGKILL; the times are from the kill to each stream's error event, to /health first
  answering 503, and to /health answering 200 again (the restart, with no request
  sent). A greedy request afterwards must give the text it gave before.

    python benchmarks/fault_timing.py --repeats 10
    python benchmarks/fault_timing.py --url http://127.0.0.1:8000 --pid 1234

Exit status 1 if any round saw no abort, no error event, or a different text after
recovery.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlparse

import httpx
from prometheus_client.parser import text_string_to_metric_families
from soak import add_server_args, children, server_for

PROMPT = "The old lighthouse stood at the end"
POLL_S = 0.01


async def metrics(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            reason = s.labels.get("finished_reason")
            out[f"{s.name}:{reason}" if reason else s.name] = s.value
    return out


async def until(check: Callable[[], Awaitable[bool]], limit_s: float, what: str) -> float:
    """Polls `check` every POLL_S; the monotonic time it first held."""
    deadline = time.monotonic() + limit_s
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(POLL_S)
    return time.monotonic()


def raw_request(url: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    host = urlparse(url).netloc
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + data


async def abort_round(client: httpx.AsyncClient, url: str, model: str, stream: bool) -> float:
    n = 1 if stream else 4
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "n": n}
    body["stream"] = stream
    tokens = "vllm:generation_tokens_total"
    before = (await metrics(client)).get(tokens, 0.0)
    parsed = urlparse(url)
    reader, writer = await asyncio.open_connection(parsed.hostname, parsed.port)
    writer.write(raw_request(url, body))
    await writer.drain()

    async def running() -> bool:
        return (await metrics(client)).get("vllm:num_requests_running", 0) >= n

    await until(running, 120, "the request never ran")
    if stream:
        while b"data: " not in await reader.readline():
            pass
    writer.close()
    await writer.wait_closed()
    left = time.monotonic()

    async def idle() -> bool:
        m = await metrics(client)
        return (
            m.get("vllm:num_requests_running", 1) == 0
            and m.get("vllm:num_requests_waiting", 1) == 0
        )

    done = await until(idle, 60, "the request was not aborted")
    made = (await metrics(client)).get(tokens, 0.0) - before
    if not 0 < made < n * body["max_tokens"]:
        raise RuntimeError(f"{made:.0f} tokens generated: the request was not cut short")
    return done - left


async def stream_until_error(
    client: httpx.AsyncClient, model: str, started: asyncio.Event
) -> float:
    """Runs one stream; the monotonic time its error event arrived."""
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 1000,
        "ignore_eos": True,
        "stream": True,
    }
    async with client.stream("POST", "/v1/completions", json=body, timeout=120) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            started.set()
            if '"error"' in line:
                return time.monotonic()
    raise RuntimeError("the stream ended without an error event")


@dataclass
class DeathRound:
    """Seconds from the SIGKILL to each event."""

    errors: list[float]  # each stream's error event
    health_503: float
    recovered: float  # /health 200 again


async def death_round(
    client: httpx.AsyncClient, server_pid: int, model: str, streams: int, reference: str
) -> DeathRound:
    starts = [asyncio.Event() for _ in range(streams)]
    tasks = [asyncio.create_task(stream_until_error(client, model, e)) for e in starts]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in starts)), 120)
    (worker,) = children(server_pid)
    os.kill(worker, signal.SIGKILL)
    killed = time.monotonic()

    async def health(code: int) -> bool:
        try:
            return (await client.get("/health", timeout=5)).status_code == code
        except httpx.HTTPError:
            return False

    unhealthy = await until(lambda: health(503), 30, "/health never answered 503")
    errors = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    healthy = await until(lambda: health(200), 600, "the worker did not come back")
    if children(server_pid) == [worker]:
        raise RuntimeError("the same worker pid after recovery")
    if await greedy(client, model) != reference:
        raise RuntimeError("a different greedy text after recovery")
    return DeathRound([e - killed for e in errors], unhealthy - killed, healthy - killed)


async def greedy(client: httpx.AsyncClient, model: str) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    r = await client.post("/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def summary(name: str, values: list[float]) -> None:
    ms = sorted(v * 1000 for v in values)
    print(
        f"{name:<36} n={len(ms):<3} median {statistics.median(ms):8.1f} ms   max {ms[-1]:8.1f} ms"
    )


async def run(url: str, server_pid: int, model: str, repeats: int, streams: int) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        reference = await greedy(client, model)
        for stream in (True, False):
            times = []
            for _ in range(repeats):
                times.append(await abort_round(client, url, model, stream))
            summary(f"abort, {'streaming' if stream else 'non-streaming n=4'}", times)
        rounds = []
        for i in range(repeats):
            rounds.append(await death_round(client, server_pid, model, streams, reference))
            print(f"worker death round {i + 1}: recovered in {rounds[-1].recovered:.1f} s")
        errors = [e for r in rounds for e in r.errors]
        summary(f"worker death -> error event ({streams} streams)", errors)
        summary("worker death -> /health 503", [r.health_503 for r in rounds])
        summary("worker death -> /health 200 again", [r.recovered for r in rounds])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_args(p, "faults", 8766)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--streams", type=int, default=4)
    ns = p.parse_args()
    if ns.url is not None and ns.pid is None:
        p.error("--url needs --pid (the worker is found among its children)")
    proc, url, pid = server_for(ns)
    assert pid is not None
    try:
        asyncio.run(run(url, pid, ns.model_name, ns.repeats, ns.streams))
    except (RuntimeError, TimeoutError) as e:
        print(f"FAILED: {e}")
        return 1
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
