"""`--reasoning-parser` through the real `openai` client against `laneserve serve`:
the thinking lands in `reasoning_content` (vLLM's field), streamed and not. Random
weights never write `</think>` on their own, so a regex constraint makes the tiny
model write an answer with thinking, for real through generation and detokenizing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.conftest import Server, start_server, stop_server

ANSWER = {"structured_outputs": {"choice": ["Two and two.</think>It is 4."]}}
USER = [{"role": "user", "content": "2+2?"}]


@pytest.fixture(scope="module")
def r1(tiny_models: dict[str, Path]) -> Iterator[Server]:
    s = start_server(tiny_models["qwen2"], "--reasoning-parser", "deepseek_r1")
    yield s
    stop_server(s)


def _streamed(server: Server, **kw: object) -> tuple[str, str]:
    thought, content = "", ""
    for chunk in server.client().chat.completions.create(model="tiny", stream=True, **kw):
        for c in chunk.choices:
            thought += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
    return thought, content


@pytest.mark.slow
def test_reasoning_content_collected_and_streamed(r1: Server) -> None:
    kw = dict(messages=USER, max_tokens=40, extra_body=ANSWER)
    out = r1.client().chat.completions.create(model="tiny", **kw).choices[0].message
    assert getattr(out, "reasoning_content", None) == "Two and two."
    assert out.content == "It is 4."
    assert _streamed(r1, **kw) == ("Two and two.", "It is 4.")


@pytest.mark.slow
def test_answer_without_the_end_tag_is_all_reasoning(r1: Server) -> None:
    """deepseek_r1 reads thinking whatever the request says: an answer that never
    writes </think> is all reasoning, as vLLM reads it."""
    kw = dict(messages=USER, max_tokens=40, extra_body={"structured_outputs": {"choice": ["Hi."]}})
    out = r1.client().chat.completions.create(model="tiny", **kw).choices[0].message
    assert getattr(out, "reasoning_content", None) == "Hi." and out.content is None
