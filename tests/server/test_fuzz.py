"""Property-based fuzzing of the request bodies (hypothesis): whatever JSON a
client sends, the answer is never a 5xx (nor a 5xx error event inside a
stream), and the server still gives the same greedy text afterwards.

Bounded: a fixed number of examples per test (50 in the default suite; the `slow`
variants 500, or LANESERVE_FUZZ_EXAMPLES), derandomized (the same bodies every run),
and small token counts where a body is valid."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import LIMITED, MAX_N, Server

pytestmark = pytest.mark.slow  # fuzzers: many generated requests each (CI runs them)

# integers near every boundary a field has: 0, vocab (320), max_model_len (256),
# 32 / 64 bits, and far beyond them
edge_ints = st.sampled_from(
    [0, -1, 1, 2, 255, 256, 257, 319, 320, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, 2**70]
)
ints = st.one_of(st.integers(-3, 5), edge_ints, st.integers(-(2**80), 2**80))
small = st.one_of(st.integers(-1, 3), edge_ints)  # token counts: valid ones stay cheap
# lone surrogates included (hypothesis leaves out category Cs by default)
texts = st.text(st.characters(exclude_categories=()), max_size=12)
floats = st.floats(allow_nan=False, width=64)
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts)
anything = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=6,
)


def _maybe(*strategies: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(*strategies, anything)


COMMON = {
    "model": _maybe(st.just("tiny"), texts),
    "n": _maybe(st.integers(1, MAX_N + 1), ints),
    "temperature": _maybe(floats, st.just(0)),
    "top_p": _maybe(floats),
    "top_k": _maybe(ints),
    "min_p": _maybe(floats),
    "seed": _maybe(ints),
    "stop": _maybe(texts, st.lists(texts, max_size=3)),
    "stop_token_ids": _maybe(st.lists(ints, max_size=3)),
    "presence_penalty": _maybe(floats),
    "repetition_penalty": _maybe(floats),
    "ignore_eos": _maybe(st.booleans()),
    "min_tokens": _maybe(small),
    "stream": st.booleans(),
    "stream_options": _maybe(st.just({"include_usage": True})),
}
COMPLETION = st.fixed_dictionaries(
    {"max_tokens": small},
    optional={
        **COMMON,
        "prompt": _maybe(texts, st.lists(ints, max_size=4), st.lists(texts, max_size=3)),
        "logprobs": _maybe(small),
        "echo": _maybe(st.booleans()),
    },
)
MESSAGE = st.fixed_dictionaries(
    {"role": _maybe(st.sampled_from(["system", "user", "assistant", "developer"]))},
    optional={
        "content": _maybe(
            texts,
            st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=2),
        )
    },
)
CHAT = st.fixed_dictionaries(
    {"max_tokens": small, "messages": _maybe(st.lists(MESSAGE, max_size=3))},
    optional={**COMMON, "logprobs": _maybe(st.booleans()), "top_logprobs": _maybe(small)},
)


def fuzz_settings(examples: int) -> settings:
    """`examples` derandomized bodies (the same every run), no deadline (a server answers)."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


FUZZ = fuzz_settings(50)  # the default suite's
FUZZ_LONG = fuzz_settings(int(os.environ.get("LANESERVE_FUZZ_EXAMPLES", "500")))  # the slow run's


@pytest.fixture(scope="module")
def server(shared_server: Callable[..., Server]) -> Server:
    return shared_server("llama", *LIMITED)  # shared with test_hardening


@pytest.fixture(scope="module")
def reference(server: Server) -> str:
    return server.greedy()


def _check(server: Server, path: str, body: object) -> None:
    data = json.dumps(body).encode()  # NOTE: escapes lone surrogates, as JSON may
    r = httpx.post(
        f"{server.url}{path}",
        content=data,
        headers={"content-type": "application/json"},
        timeout=120,
    )
    assert r.status_code < 500, (r.status_code, r.text, body)
    if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
        for line in r.text.splitlines():
            if line.startswith('data: {"error"'):
                assert json.loads(line[6:])["error"]["code"] < 500, (line, body)
    else:
        r.json()  # every answer, error or not, is clean JSON


@FUZZ
@given(body=st.one_of(COMPLETION, anything))
def test_fuzz_completions(server: Server, reference: str, body: object) -> None:
    # NOTE: `reference` is asked for here so that it is taken before any fuzzing
    _check(server, "/v1/completions", body)


@FUZZ
@given(body=st.one_of(CHAT, anything))
def test_fuzz_chat(server: Server, reference: str, body: object) -> None:
    _check(server, "/v1/chat/completions", body)


@pytest.mark.slow
@FUZZ_LONG
@given(body=st.one_of(COMPLETION, anything))
def test_fuzz_completions_long(server: Server, reference: str, body: object) -> None:
    _check(server, "/v1/completions", body)


@pytest.mark.slow
@FUZZ_LONG
@given(body=st.one_of(CHAT, anything))
def test_fuzz_chat_long(server: Server, reference: str, body: object) -> None:
    _check(server, "/v1/chat/completions", body)


def test_still_serving_after_the_fuzz(server: Server, reference: str) -> None:
    """Runs after the fuzz tests (file order); the reference was taken before them."""
    assert reference
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert server.greedy() == reference
