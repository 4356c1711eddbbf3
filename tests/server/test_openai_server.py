"""The OpenAI-compatible server with the official `openai` client, on loopback."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import openai
import pytest

from tests.server.conftest import Server, wait_for

PROMPT = "The old lighthouse stood at the end"


def test_models_health_version(server: Server) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_completion_stream_equals_non_stream(server: Server) -> None:
    c = server.client()
    kw = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 20,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    full = c.completions.create(**kw)
    chunks = list(c.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    content = [ch for ch in chunks if ch.choices]
    assert "".join(ch.choices[0].text for ch in content) == full.choices[0].text
    reasons = [ch.choices[0].finish_reason for ch in content]
    assert reasons[-1] == full.choices[0].finish_reason == "length"
    assert all(r is None for r in reasons[:-1]), "only the last content chunk carries finish_reason"
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == full.usage.completion_tokens == 20
    assert usage.prompt_tokens == full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + 20


def test_chat_stream_equals_non_stream(server: Server) -> None:
    c = server.client()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    kw = {
        "model": "tiny",
        "messages": msgs,
        "max_tokens": 16,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    full = c.chat.completions.create(**kw)
    chunks = list(c.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    assert [ch.choices[0].finish_reason for ch in chunks][-1] == full.choices[0].finish_reason
    assert sum(ch.choices[0].finish_reason is not None for ch in chunks) == 1
    assert full.usage.completion_tokens == 16


def test_n_with_seed_and_multiple_prompts(server: Server) -> None:
    c = server.client()
    kw = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "n": 3, "seed": 7, "temperature": 1.0}
    out = c.completions.create(**kw, extra_body={"ignore_eos": True})
    assert sorted(ch.index for ch in out.choices) == [0, 1, 2]
    again = c.completions.create(**kw, extra_body={"ignore_eos": True})
    assert [ch.text for ch in out.choices] == [ch.text for ch in again.choices]
    assert out.usage.completion_tokens == 24
    multi = c.completions.create(
        model="tiny", prompt=[PROMPT, "Cooking offers"], max_tokens=4, temperature=0, n=2
    )
    assert sorted(ch.index for ch in multi.choices) == [0, 1, 2, 3]
    ids = c.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=4, temperature=0)
    assert ids.usage.prompt_tokens == 4


def test_stop_strings_logprobs_and_echo(server: Server) -> None:
    c = server.client()
    kw = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    base = c.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
    # a 2-character piece from the middle of the greedy text, as a stop string
    stop = next((base[i : i + 2] for i in range(4, len(base) - 2) if base[i : i + 2].strip()), None)
    assert stop is not None, f"no stop string candidate in {base!r}"
    cut = c.completions.create(**kw, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == base[: base.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    lp = (
        c.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=5,
            temperature=0,
            logprobs=3,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .logprobs
    )
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(t) == 3 for t in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(
        max(t.values()) == pytest.approx(v)
        for t, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )
    echo = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    assert echo.choices[0].text.startswith(PROMPT)
    chat = c.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ({"prompt": "x", "temperature": 9000}, 400, "temperature"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"prompt": "x", "model": "gpt-9"}, 404, "does not exist"),
        ({"prompt": "word " * 400}, 400, "max_model_len"),
        ({"prompt": [1, 2, 99999]}, 400, "vocabulary"),
        ({}, 400, "prompt"),
    ],
)
def test_bad_completion_requests(server: Server, body: dict, status: int, fragment: str) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json=body)
    assert r.status_code == status
    err = r.json()["error"]
    assert fragment in err["message"] and err["type"] and err["code"] == status


def test_invalid_json_oversized_body_and_bad_chat(server: Server) -> None:
    r = httpx.post(
        f"{server.url}/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    big = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a" * (5 * 2**20)})
    assert big.status_code == 413
    bad = httpx.post(
        f"{server.url}/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]}
    )
    assert bad.status_code == 400
    with pytest.raises(openai.BadRequestError):
        server.client().chat.completions.create(model="tiny", messages=[], max_tokens=3)
    # and the server keeps serving
    ok = server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert 1 <= ok.usage.completion_tokens <= 2


# n samples x max_tokens, ignore_eos: far more tokens than the few steps that run
# between the client leaving and the abort, so only an abort ends it early
ABANDON_N, ABANDON_TOKENS = 50, 200  # prompt + 200 fit max_model_len 256
GEN = "vllm:generation_tokens_total"


def _open_raw(server: Server, body: dict) -> socket.socket:
    """POST over a bare socket, so that the test decides when the client leaves."""
    host, port = server.url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def _aborted(server: Server) -> float:
    """vllm:request_success_total{finished_reason="abort"}."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text):
        for s in family.samples:
            if s.name == "vllm:request_success_total" and s.labels["finished_reason"] == "abort":
                return s.value
    return 0.0


def _idle(server: Server) -> bool:
    m = server.metrics()
    return m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_client_that_leaves_is_aborted(server: Server, stream: bool) -> None:
    reference = server.greedy()
    wait_for(lambda: _idle(server), "an idle engine")
    before, aborted = server.metrics()[GEN], _aborted(server)
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": ABANDON_TOKENS,
        "n": ABANDON_N,
        "ignore_eos": True,
        "stream": stream,
    }
    sock = _open_raw(server, body)
    # a whole step of it (n tokens), not the last request's late counter update
    wait_for(lambda: server.metrics()[GEN] >= before + ABANDON_N, "generation to start")
    sock.close()  # the client leaves
    wait_for(lambda: _idle(server), "no request running or waiting")
    stopped_at = server.metrics()[GEN]
    assert stopped_at - before < ABANDON_N * ABANDON_TOKENS, "the request ran to its end"
    # every sample is counted as finished by abort
    wait_for(lambda: _aborted(server) == aborted + ABANDON_N, "the aborts to be counted")
    # the counter stopped: all that moves it now is one normal request's 12 tokens
    assert server.greedy() == reference
    wait_for(lambda: server.metrics()[GEN] >= stopped_at + 12, "the counter to update")
    assert server.metrics()[GEN] == stopped_at + 12
    assert server.metrics()["vllm:kv_cache_usage_perc"] == 0


def test_metrics_parse_and_move(server: Server) -> None:
    before = server.metrics()
    server.client().completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    after = server.metrics()
    assert (
        after["vllm:generation_tokens_total"] >= before.get("vllm:generation_tokens_total", 0) + 6
    )
    assert after["vllm:prompt_tokens_total"] > before.get("vllm:prompt_tokens_total", 0)
    assert after["vllm:e2e_request_latency_seconds_count"] > before.get(
        "vllm:e2e_request_latency_seconds_count", 0
    )
    assert "vllm:time_to_first_token_seconds_count" in after
    assert "vllm:prefix_cache_queries_total" in after


def test_concurrent_requests_all_succeed(server: Server) -> None:
    c = server.client()
    results: list[int] = []

    def one(i: int) -> None:
        r = c.completions.create(
            model="tiny",
            prompt=f"{PROMPT} {i}",
            max_tokens=10,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        results.append(r.usage.completion_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [10] * 12
