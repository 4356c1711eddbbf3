"""Request fields laneserve does not implement are a 400 naming the field, never
ignored silently; bookkeeping fields the `openai` client sends are accepted; a
prompt + max_tokens beyond the context is a 400 (as vLLM), not a cut-off."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import VLLM_STYLE, Server

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def server(shared_server: Callable[..., Server]) -> Server:
    # vLLM's flags: several served names, accepted no-ops, uvicorn's log level
    return shared_server("llama", *VLLM_STYLE)


def _rejected(r: httpx.Response, field: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["message"].startswith(f"{field}:"), err


@pytest.mark.parametrize(
    ("path", "extra", "field"),
    [
        (CMPL, {"best_of": 3}, "best_of"),
        (CMPL, {"best_of": 0}, "best_of"),
        (CMPL, {"suffix": "tail"}, "suffix"),
        (CMPL, {"prompt_logprobs": "1"}, "prompt_logprobs"),  # a number, as vLLM
        (CMPL, {"temprature": 0}, "temprature"),  # a typo is not a setting
        (CHAT, {"tools": [TOOL]}, "tool_choice"),  # "auto" needs a parser on the server
        (CHAT, {"tools": [TOOL], "tool_choice": "auto"}, "tool_choice"),
        (CHAT, {"tool_choice": "required"}, "tool_choice"),
        (CHAT, {"unknown_knob": 1}, "unknown_knob"),
    ],
)
def test_unsupported_field_is_400_naming_it(
    server: Server, path: str, extra: dict, field: str
) -> None:
    base = {"prompt": "hi"} if path == CMPL else {"messages": USER}
    _rejected(server.post(path, {**base, "max_tokens": 2, **extra}), field)


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        (CMPL, {"best_of": 1, "suffix": None, "user": "u", "metadata": {"k": "v"}}),
        (CMPL, {"guided_json": None, "prompt_logprobs": None, "logit_bias": {}}),
        (CMPL, {"structured_outputs": None, "guided_decoding_backend": None}),
        (CHAT, {"response_format": {"type": "text"}, "store": False, "service_tier": "auto"}),
        (CHAT, {"tools": [TOOL], "tool_choice": "none", "parallel_tool_calls": True}),
    ],
)
def test_neutral_and_bookkeeping_fields_are_accepted(
    server: Server, path: str, extra: dict
) -> None:
    base = {"prompt": "hi"} if path == CMPL else {"messages": USER}
    plain = server.post(path, {**base, "max_tokens": 3, "temperature": 0})
    r = server.post(path, {**base, "max_tokens": 3, "temperature": 0, **extra})
    assert plain.status_code == r.status_code == 200, r.text
    key = "text" if path == CMPL else "message"
    assert r.json()["choices"][0][key] == plain.json()["choices"][0][key]


def test_logit_bias_through_the_api(server: Server, tiny_models: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    forced = AutoTokenizer.from_pretrained(tiny_models["llama"]).decode([123] * 4)
    c = server.client()
    kw = {"model": "tiny", "max_tokens": 4, "temperature": 0, "extra_body": {"ignore_eos": True}}
    plain = c.completions.create(prompt=[5, 6, 7], **kw).choices[0].text
    out = c.completions.create(prompt=[5, 6, 7], logit_bias={"123": 100}, **kw)
    assert out.choices[0].text == forced != plain
    chat = c.chat.completions.create(messages=USER, logit_bias={"123": 100}, **kw)
    assert chat.choices[0].message.content == forced
    for bad, fragment in [({"320": 1}, "outside the vocabulary"), ({"x": 1}, "token ids"),
                          ({"5": 101}, "[-100, 100]")]:  # fmt: skip
        r = server.post(CMPL, {"prompt": "hi", "logit_bias": bad})
        assert r.status_code == 400 and "logit_bias" in r.json()["error"]["message"], r.text
        assert fragment in r.json()["error"]["message"]


def test_prompt_plus_max_tokens_beyond_context_is_400(server: Server) -> None:
    ids = [5] * 250  # max_model_len is 256
    fits = server.post(CMPL, {"prompt": ids, "max_tokens": 6, "ignore_eos": True})
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 6
    r = server.post(CMPL, {"prompt": ids, "max_tokens": 7})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    msg = r.json()["error"]["message"]
    assert "maximum context length" in msg and "250 input tokens" in msg and "7 > 256 - 250" in msg
    chat = server.post(CHAT, {"messages": [{"role": "user", "content": "word " * 20}],
                              "max_completion_tokens": 255})  # fmt: skip
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "max_completion_tokens"


def test_every_served_name_is_listed_and_answers(server: Server) -> None:
    ids = [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]]
    assert ids == ["tiny", "alias-b"]
    body = {"prompt": "hi", "max_tokens": 2}
    r = server.post(CMPL, {**body, "model": "alias-b"})
    assert r.status_code == 200 and r.json()["model"] == "tiny"
    assert server.post(CMPL, {**body, "model": "alias-c"}).status_code == 404


def test_chat_template_and_kwargs_in_a_request(
    server: Server, tiny_models: dict[str, Path]
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models["llama"])
    template = "{% for m in messages %}{{ m['content'] }}|{% endfor %}{{ tail }}"
    body = {"messages": USER, "max_tokens": 1, "chat_template": template,
            "chat_template_kwargs": {"tail": "end"}}  # fmt: skip
    r = server.post(CHAT, body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(tok.encode("hi|end", add_special_tokens=False))
    bad = server.post(CHAT, {**body, "chat_template": "{% for %}"})
    assert bad.status_code == 400 and "chat template failed" in bad.json()["error"]["message"]
