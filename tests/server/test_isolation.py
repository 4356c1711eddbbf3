"""One request can never hurt another, against a real `laneserve serve`:
mistyped fields are 400s naming the field while innocent streams run on; deep
grammars (2x the depth that overflowed llguidance's stack) and oversized
constraints are 4xx and the server lives; slow request preparation stays off
the event loop (`/health` answers while it runs); chat-template failures are 400s."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.conftest import MAX_NUM_SEQS, VLLM_STYLE, Server, wait_for

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
INNOCENT = {"prompt": "The old lighthouse", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
# /health must answer within this while a slow request is prepared. The issue's
# requirement is 1 s; the freeze it guards against lasted 29 s. 1 s holds here
# because preparation runs on other threads: the event loop only waits on them.
HEALTH_BOUND_S = 1.0


@pytest.fixture(scope="module")
def srv(shared_server: Callable[..., Server]) -> Server:
    return shared_server("llama", *VLLM_STYLE)  # a request's own chat template trusted


def _stream_text(server: Server, body: dict) -> str:
    """An innocent stream, read to its end: its text (an error event fails it)."""
    text = ""
    with httpx.stream(
        "POST", f"{server.url}{CMPL}", json={**body, "stream": True}, timeout=300
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text += chunk["choices"][0]["text"]
    return text


def _while_streams(server: Server, job, n: int = 4) -> object:
    """`job()` while `n` innocent streams run; each stream must give its usual text."""
    reference = _stream_text(server, INNOCENT)
    with ThreadPoolExecutor(n) as pool:
        streams = [pool.submit(_stream_text, server, INNOCENT) for _ in range(n)]
        result = job()
        assert [s.result() for s in streams] == [reference] * n
    return result


MISTYPED = [
    ({"structured_outputs": {"json_object": v}}, "structured_outputs")
    for v in ("x", 1, None, [1], {})
] + [
    ({"structured_outputs": {"regex": "a+", "disable_any_whitespace": v}}, "structured_outputs")
    for v in ("x", 1, [1], {}, None)
] + [
    ({"temperature": True}, "temperature"),
    ({"top_p": "0.5"}, "top_p"),
    ({"response_format": {"type": "json_object", "extra": 1}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": "x"}}}, "response_format"),
    ({"guided_choice": [1, 2]}, "guided_choice"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options"),
    ({"logit_bias": {"5": True}}, "logit_bias"),
]  # fmt: skip


def test_mistyped_fields_are_400_naming_them_and_hurt_no_one(srv: Server) -> None:
    def send_all() -> list[httpx.Response]:
        return [
            srv.post(CHAT, {"messages": USER, "max_tokens": 4, **extra}) for extra, _ in MISTYPED
        ]

    responses = _while_streams(srv, send_all)
    for (extra, param), r in zip(MISTYPED, responses, strict=True):
        assert r.status_code == 400, (extra, r.text)
        got = r.json()["error"]["param"]
        assert got and got.split(".")[0] == param, (extra, r.json())


def test_unknown_chat_template_kwargs_are_400(srv: Server) -> None:
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ tail }}"
    body = {"messages": USER, "max_tokens": 1, "chat_template": template}
    ok = srv.post(CHAT, {**body, "chat_template_kwargs": {"tail": "."}})
    assert ok.status_code == 200, ok.text
    r = srv.post(CHAT, {**body, "chat_template_kwargs": {"tial": "."}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    assert "tial" in r.json()["error"]["message"]


def _defs_chain(n: int) -> dict:
    defs = {
        f"D{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/D{i + 1}"}}}
        for i in range(n)
    }
    defs[f"D{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/D0", "$defs": defs}


def _lark_chain(n: int) -> str:
    rules = [f"r{i}: r{i + 1}" for i in range(n)]
    return "start: r0\n" + "\n".join(rules) + f'\nr{n}: "a"\n'


DEEP = 2 * 929  # llguidance overflowed the main thread's stack from 929 objects
DEEP_RULES = 2 * 2687  # ... and from 2687 chained Lark rules


@pytest.mark.parametrize(
    "extra",
    [
        {"structured_outputs": {"json": _defs_chain(DEEP)}},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "d", "schema": _defs_chain(DEEP)},
            }
        },
        {"structured_outputs": {"grammar": _lark_chain(DEEP_RULES)}},
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": _defs_chain(DEEP)}}
            ],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        },
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": _defs_chain(DEEP)}}
            ],
            "tool_choice": "required",
        },
    ],
    ids=["defs", "response_format", "lark", "named_tool", "required_tool"],
)
def test_deep_grammars_are_4xx_and_the_server_lives(srv: Server, extra: dict) -> None:
    r = srv.post(CHAT, {"messages": USER, "max_tokens": 4, **extra})
    assert 400 <= r.status_code < 500, r.text
    assert re.search(r"MAX_\w+", r.json()["error"]["message"]), r.text  # names the limit
    assert srv.proc.poll() is None
    assert httpx.get(f"{srv.url}/health").status_code == 200
    srv.greedy()


def _unconstrained_or_4xx(r: httpx.Response, valid) -> None:
    """A 4xx, or a 200 whose text matches the constraint: never unconstrained text."""
    if r.status_code == 200:
        text = r.json()["choices"][0]["message"]["content"]
        assert valid(text), text
    else:
        assert 400 <= r.status_code < 500, r.text


PROPS = {f"p{i}": {"type": "integer"} for i in range(10_000)}
BOMBS = [
    ({"regex": "a{1000000}"}, lambda t: re.fullmatch("a*", t)),
    ({"regex": "(a{1000}){1000}"}, lambda t: re.fullmatch("a*", t)),
    ({"regex": "b" * 1_000_000}, lambda t: re.fullmatch("b*", t)),
    ({"choice": ["z" * 1_000_000]}, lambda t: re.fullmatch("z*", t)),
    ({"json": {"type": "object", "properties": PROPS, "required": list(PROPS)}}, lambda t: t.startswith("{")),
    ({"grammar": 'start: "a"~1000000'}, lambda t: re.fullmatch("a*", t)),
    ({"grammar": "start: /a{1000000}/"}, lambda t: re.fullmatch("a*", t)),
    ({"grammar": "start: x~1000\nx: /a{1000}/"}, lambda t: re.fullmatch("a*", t)),
]  # fmt: skip


@pytest.mark.parametrize(("so", "valid"), BOMBS, ids=[f"bomb{i}" for i in range(len(BOMBS))])
def test_oversized_constraints_never_give_unconstrained_text(srv: Server, so: dict, valid) -> None:
    r = srv.post(
        CHAT, {"messages": USER, "max_tokens": 8, "temperature": 0, "structured_outputs": so}
    )
    _unconstrained_or_4xx(r, valid)
    assert srv.proc.poll() is None


def _probe_health(server: Server, stop: threading.Event, worst: list[float]) -> None:
    while not stop.is_set():
        start = time.monotonic()
        r = httpx.get(f"{server.url}/health", timeout=30)
        worst.append(time.monotonic() - start)
        assert r.status_code == 200
        stop.wait(0.2)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            CHAT,
            {"messages": USER, "structured_outputs": {"choice": [f"c{i}" for i in range(100_000)]}},
        ),
        (
            CHAT,
            {
                "messages": USER,
                "structured_outputs": {"choice": [f"item number {i}" for i in range(4000)]},
            },
        ),
        (CMPL, {"prompt": "lighthouse keeper " * 200_000}),
    ],
    ids=["choice_100k", "choice_4k", "prompt_3mb"],
)
def test_health_answers_while_a_slow_request_is_prepared(
    srv: Server, path: str, body: dict
) -> None:
    stop, worst = threading.Event(), []
    prober = threading.Thread(target=_probe_health, args=(srv, stop, worst))
    prober.start()
    try:
        r = srv.post(path, {**body, "max_tokens": 4})
    finally:
        stop.set()
        prober.join()
    assert r.status_code in (200, 400), r.text
    assert worst and max(worst) < HEALTH_BOUND_S, worst


@pytest.mark.parametrize(
    "template",
    [
        "{% for i in range(1000000000) %}x{% endfor %}",
        "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
        "{{ 'a' * 10000000 }}",
        "{{ messages[0]['content'] | int / 0 }}",
    ],
    ids=["range", "recursive_macro", "huge_output", "zero_division"],
)
def test_chat_template_failures_are_400(srv: Server, template: str) -> None:
    r = srv.post(CHAT, {"messages": USER, "max_tokens": 1, "chat_template": template})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "chat_template"
    srv.greedy()


def _gauges(server: Server) -> tuple[float, float, float]:
    m = server.metrics()
    return (
        m["vllm:num_requests_running"],
        m["vllm:num_requests_waiting"],
        m["vllm:kv_cache_usage_perc"],
    )


@pytest.mark.slow  # hundreds of aborted streams
def test_an_abort_storm_drains_to_nothing(srv: Server) -> None:
    """200 streaming clients leave at once (most still queued or not yet admitted):
    running, waiting and KV usage all return to 0. The wait is bounded generously
    (10 s; the drain itself takes a few engine steps) so a busy machine cannot flake it."""
    import asyncio

    body = {"prompt": "The old lighthouse", "max_tokens": 200, "ignore_eos": True, "stream": True}
    started = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal started
        async with http.stream("POST", f"{srv.url}{CMPL}", json=body) as r:
            async for _ in r.aiter_lines():
                started += 1
                await asyncio.sleep(3600)  # a client that stays until it leaves

    async def storm() -> None:
        limits = httpx.Limits(max_connections=300)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            tasks = [asyncio.create_task(client(http)) for _ in range(200)]
            deadline = time.monotonic() + 60
            while started < MAX_NUM_SEQS and time.monotonic() < deadline:  # the running set is full
                await asyncio.sleep(0.05)
            for t in tasks:  # all at once
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    assert _gauges(srv) == (0, 0, 0)
    asyncio.run(storm())
    wait_for(lambda: _gauges(srv) == (0, 0, 0), "running / waiting / KV back to 0", 10.0)
    srv.greedy()
