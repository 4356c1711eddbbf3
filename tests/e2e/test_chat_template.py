"""Chat templates as vLLM takes them: the served one from a file or text
(`chat_template=` / --chat-template), one per call, template variables
(`chat_template_kwargs`), and `continue_final_message`."""

from __future__ import annotations

from pathlib import Path

import pytest

from laneserve import LLM, SamplingParams

TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}|{% endfor %}{% if tail %}{{ tail }}{% endif %}"
)
ONE = SamplingParams(temperature=0, max_tokens=1)
USER = [{"role": "user", "content": "hello there"}]


def prompt_ids(llm: LLM, messages: list[dict], **kw: object) -> list[int]:
    return llm.chat(messages, ONE, use_tqdm=False, **kw)[0].prompt_token_ids


def test_chat_template_per_call_kwargs_and_continue(tiny_models: dict[str, Path]) -> None:
    with LLM(str(tiny_models["llama"]), dtype="float32") as llm:
        tok = llm.engine.tokenizer
        got = prompt_ids(llm, USER, chat_template=TEMPLATE, chat_template_kwargs={"tail": "ok"})
        assert got == tok.encode("hello there|ok", add_special_tokens=False)
        assert prompt_ids(llm, USER, chat_template=TEMPLATE) == tok.encode(
            "hello there|", add_special_tokens=False
        )
        # the model's own template: an open assistant turn is continued, not closed
        partial = [*USER, {"role": "assistant", "content": "The answer is"}]
        text = tok.decode(prompt_ids(llm, partial, continue_final_message=True), False)
        closed = tok.decode(prompt_ids(llm, partial), False)
        assert text.endswith("The answer is") and not closed.endswith("The answer is")
        with pytest.raises(ValueError, match="chat template failed"):
            prompt_ids(llm, USER, chat_template="{% for %}")
        with pytest.raises(ValueError, match=r"may not set \['tools'\]"):
            prompt_ids(llm, USER, chat_template=TEMPLATE, chat_template_kwargs={"tools": []})
        # tools reach the template as `tools`
        listing = "{% for t in tools %}{{ t.function.name }};{% endfor %}"
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
        got = prompt_ids(llm, USER, chat_template=listing, tools=[tool, tool])
        assert got == tok.encode("get_weather;get_weather;", add_special_tokens=False)


def test_served_chat_template_from_a_file(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    f = tmp_path / "template.jinja"
    f.write_text(TEMPLATE)
    with LLM(str(tiny_models["llama"]), dtype="float32", chat_template=str(f)) as llm:
        tok = llm.engine.tokenizer
        assert prompt_ids(llm, USER) == tok.encode("hello there|", add_special_tokens=False)
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        LLM(str(tiny_models["llama"]), dtype="float32", chat_template=str(tmp_path / "nope"))
