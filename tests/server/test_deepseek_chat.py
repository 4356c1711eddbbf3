"""DeepSeek V4's chat format, DSML tool calls and reasoning together through the real
`openai` client against `laneserve serve` (a tiny random Qwen2 checkpoint served with
`--tokenizer-mode deepseek_v4`, as a fine-tune would be). The prompt is the V4
encoder's text; a choice constraint makes the model write thinking, content and a DSML
call, which come back split into reasoning_content, content and tool_calls, streamed
and collected alike."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from laneserve.chat_formats import deepseek_v4
from laneserve.frontend.tokenizer import Tokenizer
from tests.server.conftest import Server, start_server, stop_server
from tests.tiny_models import build_tiny_model

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
SYSTEM = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "Weather in Paris?"}
ANSWER = (
    "Need weather.</think>Checking.\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("dsv4"), "qwen2", seed=2, max_positions=4096)


@pytest.fixture(scope="module")
def v4(model: Path) -> Iterator[Server]:
    s = start_server(
        model, "--max-model-len", "4096", "--tokenizer-mode", "deepseek_v4",
        "--enable-auto-tool-choice", "--tool-call-parser", "deepseek_v4",
        "--reasoning-parser", "deepseek_v4",
    )  # fmt: skip
    yield s
    stop_server(s)


def _request(**extra: object) -> dict:
    return dict(
        model="tiny", messages=[SYSTEM, USER], tools=[WEATHER], max_tokens=400,
        extra_body={"chat_template_kwargs": {"thinking": True}, "return_token_ids": True,
                    "structured_outputs": {"choice": [ANSWER]}},
        **extra,
    )  # fmt: skip


@pytest.mark.slow
def test_format_calls_and_reasoning(v4: Server, model: Path) -> None:
    out = v4.client().chat.completions.create(**_request())
    want = deepseek_v4.encode([{**SYSTEM, "tools": [WEATHER]}, USER], True)
    assert want.endswith("<｜Assistant｜><think>")
    assert out.model_extra["prompt_token_ids"] == Tokenizer(model).encode(
        want, add_special_tokens=False
    )
    msg, choice = out.choices[0].message, out.choices[0]
    assert msg.model_extra["reasoning_content"] == "Need weather."
    assert msg.content == "Checking." and choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    thought, content, args = "", "", ""
    for chunk in v4.client().chat.completions.create(stream=True, **_request()):
        for c in chunk.choices:
            thought += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
            args += "".join(t.function.arguments or "" for t in c.delta.tool_calls or [])
    assert (thought, content, json.loads(args)) == ("Need weather.", "Checking.", {"city": "Paris"})


@pytest.mark.slow
def test_thinking_off_and_unknown_kwargs(v4: Server) -> None:
    r = v4.post("/v1/chat/completions", {"model": "tiny", "messages": [USER], "max_tokens": 2,
                                          "chat_template_kwargs": {"thinkin": True}})  # fmt: skip
    assert r.status_code == 400 and "thinkin" in r.json()["error"]["message"]
    body = {"model": "tiny", "messages": [USER], "max_tokens": 40, "return_token_ids": True,
            "structured_outputs": {"choice": ["Hi.</think>x"]}}  # fmt: skip
    out = v4.post("/v1/chat/completions", body).json()
    assert "reasoning_content" not in out["choices"][0]["message"]  # thinking is off
    assert out["choices"][0]["message"]["content"] == "Hi.</think>x"
