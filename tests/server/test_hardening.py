"""No single request may stop the engine: out-of-range integers, invalid strings,
empty prompts, oversized (also chunked) bodies, too many choices. Each case
asserts the clean error AND that a normal greedy request still gives the text
it gave before."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.server.conftest import LIMIT_BYTES, LIMITED, MAX_N, Server

BIG = 2**70  # fits no 64-bit integer: used to kill the step encoder
SURROGATE = "\ud800"  # a lone surrogate: valid JSON (escaped), not valid UTF-8


@pytest.fixture(scope="module")
def server(shared_server: Callable[..., Server]) -> Server:
    return shared_server("llama", *LIMITED)  # shared with test_fuzz


@pytest.fixture(scope="module")
def reference(server: Server) -> str:
    return server.greedy()


def raw_post(server: Server, path: str, body: object) -> httpx.Response:
    # NOTE: json.dumps escapes the surrogate as \\ud800, which JSON allows
    data = json.dumps(body).encode()
    return httpx.post(
        f"{server.url}{path}", content=data, headers={"content-type": "application/json"}
    )


def assert_error(r: httpx.Response, status: int, fragment: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]  # a clean body: parses, names the problem
    assert fragment in err["message"], err
    assert err["code"] == status and err["type"]


CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "body", "status", "fragment"),
    [
        # integers beyond any wire type: used to kill the engine thread
        (CMPL, {"prompt": "hi", "max_tokens": BIG}, 400, "max_tokens"),
        (CMPL, {"prompt": "hi", "seed": BIG}, 400, "seed"),
        (CMPL, {"prompt": "hi", "seed": -(2**64)}, 400, "seed"),
        (CMPL, {"prompt": "hi", "top_k": BIG}, 400, "top_k"),
        (CMPL, {"prompt": "hi", "stop_token_ids": [BIG]}, 400, "stop_token_ids"),
        (CMPL, {"prompt": "hi", "min_tokens": BIG}, 400, "min_tokens"),
        (CMPL, {"prompt": "hi", "n": BIG}, 400, "n"),
        (CMPL, {"prompt": "hi", "logprobs": BIG}, 400, "logprobs"),
        (CMPL, {"prompt": [BIG]}, 400, "vocabulary"),
        (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": BIG}, 400, "logprobs"),
        (CHAT, {"messages": USER, "max_completion_tokens": BIG}, 400, "max_tokens"),
        # within 64 bits, but beyond what this model serves
        (CMPL, {"prompt": "hi", "max_tokens": 257}, 400, "max_model_len"),
        (CMPL, {"prompt": "hi", "stop_token_ids": [320]}, 400, "vocabulary"),
        (CMPL, {"prompt": "hi", "n": MAX_N + 1}, 400, "--max-n"),
        (CMPL, {"prompt": ["a", "b", "c"], "n": 3}, 400, "--max-n"),
        # lone surrogates wherever a string goes
        (CMPL, {"prompt": "hi", "stop": SURROGATE}, 400, "surrogate"),
        (CMPL, {"prompt": "hi", "stop": ["ok", SURROGATE]}, 400, "surrogate"),
        (CMPL, {"prompt": SURROGATE}, 400, "surrogate"),
        (CMPL, {"prompt": ["ok", SURROGATE]}, 400, "surrogate"),
        (CMPL, {"prompt": "hi", "model": SURROGATE}, 400, "surrogate"),
        (CHAT, {"messages": [{"role": "user", "content": SURROGATE}]}, 400, "surrogate"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]},
            400,
            "surrogate",
        ),
        (CHAT, {"messages": USER, "stop": SURROGATE}, 400, "surrogate"),
        # empty prompts
        (CMPL, {"prompt": []}, 400, "empty"),
        (CMPL, {"prompt": [[1, 2], []]}, 400, "empty"),
        (CMPL, {"prompt": ""}, 400, "empty"),
        # a request's own chat template needs the server's consent
        (
            CHAT,
            {"messages": USER, "chat_template": "{{ 1 }}"},
            400,
            "--trust-request-chat-template",
        ),
        # a non-ASCII model name: 404, with a body that still encodes
        (CMPL, {"prompt": "hi", "model": "gpt-\u00e9"}, 404, "does not exist"),
    ],
)
def test_bad_request_fails_alone(
    server: Server, reference: str, path: str, body: dict, status: int, fragment: str
) -> None:
    assert_error(raw_post(server, path, body), status, fragment)
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert server.greedy() == reference


def _chunks(num_kb: int) -> Iterator[bytes]:
    """A JSON body sent chunked (no Content-Length)."""
    yield b'{"prompt": "'
    for _ in range(num_kb):
        yield b"a" * 1000
    yield b'", "max_tokens": 1}'


@pytest.mark.parametrize("num_kb", [30, 10_000])
def test_chunked_body_over_the_limit_is_413(server: Server, reference: str, num_kb: int) -> None:
    r = httpx.post(
        f"{server.url}{CMPL}", content=_chunks(num_kb), headers={"content-type": "application/json"}
    )
    assert r.request.headers.get("transfer-encoding") == "chunked"
    assert "content-length" not in r.request.headers
    assert_error(r, 413, "exceeds the limit")
    assert server.greedy() == reference


def test_chunked_body_within_the_limit_is_read(server: Server, reference: str) -> None:
    def body() -> Iterator[bytes]:
        text = json.dumps({"prompt": "The old lighthouse stood at the end", "max_tokens": 12})
        yield text[:-1].encode()
        yield b', "temperature": 0, "ignore_eos": true}'

    r = httpx.post(
        f"{server.url}{CMPL}", content=body(), headers={"content-type": "application/json"}
    )
    assert r.request.headers.get("transfer-encoding") == "chunked"
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference


def test_declared_length_over_the_limit_is_413(server: Server, reference: str) -> None:
    r = httpx.post(f"{server.url}{CMPL}", json={"prompt": "a" * (LIMIT_BYTES + 10)})
    assert_error(r, 413, "exceeds the limit")
    assert server.greedy() == reference
