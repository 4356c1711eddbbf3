"""A vLLM-style launch line (flags from vLLM's docs and scripts) starts the server
unchanged; `--max-logprobs` is enforced; `prompt_logprobs` (vLLM's extra field)
and `stop_reason` come back in vLLM's shapes."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.server.conftest import MAX_LOGPROBS, VLLM_STYLE, Server


@pytest.fixture(scope="module")
def srv(shared_server: Callable[..., Server]) -> Server:
    return shared_server("llama", *VLLM_STYLE)  # the launch line


def test_max_logprobs_is_enforced(srv: Server) -> None:
    body = {"model": srv.model, "prompt": "The old", "max_tokens": 2}
    assert srv.post("/v1/completions", {**body, "logprobs": MAX_LOGPROBS}).status_code == 200
    r = srv.post("/v1/completions", {**body, "logprobs": MAX_LOGPROBS + 1})
    assert r.status_code == 400 and "--max-logprobs" in r.json()["error"]["message"]
    r = srv.post("/v1/completions", {**body, "prompt_logprobs": 5})
    assert r.status_code == 400 and "prompt_logprobs" in r.json()["error"]["message"]


def test_prompt_logprobs_completions_and_chat(srv: Server, tiny_models: dict[str, Path]) -> None:
    from tests.server.test_echo_logprobs import hf_logprobs, prompt_ids

    text = "The old lighthouse stood"
    ids = prompt_ids(tiny_models["llama"], text)
    r = srv.post(
        "/v1/completions",
        {"model": srv.model, "prompt": text, "max_tokens": 1, "prompt_logprobs": 2},
    )
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    ref = hf_logprobs(tiny_models["llama"], ids)
    assert len(plp) == len(ids) and plp[0] is None
    for pos in range(1, len(ids)):
        entry = plp[pos]
        chosen = entry[str(ids[pos])]
        assert math.isclose(chosen["logprob"], ref[pos - 1, ids[pos]].item(), abs_tol=1e-4)
        assert {1, 2} <= {v["rank"] for v in entry.values()}  # the top 2, and the chosen
    chat = srv.post(
        "/v1/chat/completions",
        {"model": srv.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
         "prompt_logprobs": 1},
    )  # fmt: skip
    assert chat.status_code == 200, chat.text
    top = chat.json()["prompt_logprobs"]
    assert top[0] is None and all(isinstance(e, dict) for e in top[1:])
    streamed = srv.post(
        "/v1/completions",
        {"model": srv.model, "prompt": "x", "prompt_logprobs": 1, "stream": True},
    )
    assert streamed.status_code == 400


def test_stop_reason_in_choices(srv: Server) -> None:
    body = {"model": srv.model, "prompt": "The old lighthouse", "max_tokens": 30, "temperature": 0}
    full = srv.post("/v1/completions", {**body, "ignore_eos": True}).json()["choices"][0]["text"]
    stop = full[3:5]
    r = srv.post("/v1/completions", {**body, "ignore_eos": True, "stop": [stop]}).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    length = srv.post("/v1/completions", {**body, "max_tokens": 2, "ignore_eos": True}).json()
    assert length["choices"][0]["stop_reason"] is None
