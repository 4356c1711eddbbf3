"""DeepSeek V3.2 / V4 chat formats: byte-for-byte equal to the reference encoders'
outputs (tests/chat_formats/data/README.md says where each vector comes from), chosen by
architecture or `tokenizer_mode`, thinking on / off through chat_template_kwargs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from laneserve.chat_formats import deepseek_v4, deepseek_v32, render_chat, resolve_chat_format

DATA = Path(__file__).parent / "data"


def _gold_v4() -> list[tuple[str, list[dict], bool, str]]:
    d = DATA / "deepseek_v4"
    first = json.loads((d / "test_input_1.json").read_text())
    first["messages"][0]["tools"] = first["tools"]
    inputs = [first["messages"]] + [
        json.loads((d / f"test_input_{i}.json").read_text()) for i in (2, 3, 4)
    ]
    thinking = [True, True, True, False]
    return [
        (f"gold_{i + 1}", m, t, (d / f"test_output_{i + 1}.txt").read_text())
        for i, (m, t) in enumerate(zip(inputs, thinking, strict=True))
    ]


def _cases(family: str) -> list[dict]:
    return json.loads((DATA / family / "reference_cases.json").read_text())


@pytest.mark.parametrize(("name", "messages", "thinking", "expected"), _gold_v4())
def test_v4_equals_deepseek_test_vectors(name: str, messages, thinking: bool, expected: str):
    assert deepseek_v4.encode(messages, thinking) == expected


@pytest.mark.parametrize("case", _cases("deepseek_v4"), ids=lambda c: c["name"])
def test_v4_equals_reference_encoder(case: dict) -> None:
    got = deepseek_v4.encode(
        case["messages"], case["thinking_mode"] == "thinking", **case["kwargs"]
    )
    assert got == case["expected"]


@pytest.mark.parametrize("case", _cases("deepseek_v32"), ids=lambda c: c["name"])
def test_v32_equals_reference_encoder(case: dict) -> None:
    got = deepseek_v32.encode(
        case["messages"], case["thinking_mode"] == "thinking", **case["kwargs"]
    )
    assert got == case["expected"]


def test_encoders_do_not_change_their_input() -> None:
    case = next(c for c in _cases("deepseek_v4") if c["name"] == "thinking_tools_results_reordered")
    before = json.dumps(case["messages"])
    deepseek_v4.encode(case["messages"], True)
    assert json.dumps(case["messages"]) == before


def test_render_chat_puts_tools_on_the_system_message_and_reads_thinking() -> None:
    case = next(c for c in _cases("deepseek_v4") if c["name"] == "thinking_tools_results_reordered")
    messages = [dict(m) for m in case["messages"]]
    tools = messages[0].pop("tools")
    for flag in ("thinking", "enable_thinking"):  # vLLM accepts either
        got = render_chat("deepseek_v4", messages, tools=tools, chat_template_kwargs={flag: True},
                          add_generation_prompt=True, continue_final_message=False)  # fmt: skip
        assert got == case["expected"]
    off = render_chat("deepseek_v4", messages, tools=tools, chat_template_kwargs=None,
                      add_generation_prompt=True, continue_final_message=False)  # fmt: skip
    chat = next(c for c in _cases("deepseek_v4") if c["name"] == "chat_tools_results_reordered")
    assert off == chat["expected"]


def test_render_chat_without_a_system_message_adds_one_for_tools() -> None:
    case = next(c for c in _cases("deepseek_v32") if c["name"] == "tools_without_system_text")
    tools = case["messages"][0]["tools"]
    got = render_chat("deepseek_v32", case["messages"][1:], tools=tools,
                      chat_template_kwargs={"thinking": True},
                      add_generation_prompt=True, continue_final_message=False)  # fmt: skip
    assert got == case["expected"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"enable_thinkin": True}, "not read by the deepseek_v4"),
        ({"thinking": "yes"}, "must be a boolean"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
    ],
)
def test_bad_chat_template_kwargs_are_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        render_chat("deepseek_v4", [{"role": "user", "content": "x"}], tools=None,
                    chat_template_kwargs=kwargs, add_generation_prompt=True,
                    continue_final_message=False)  # fmt: skip


def test_v32_has_no_reasoning_effort_and_no_open_final_turn() -> None:
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(ValueError, match="not read by the deepseek_v32"):
        render_chat("deepseek_v32", msgs, tools=None, chat_template_kwargs={"reasoning_effort": "max"},
                    add_generation_prompt=True, continue_final_message=False)  # fmt: skip
    with pytest.raises(ValueError, match="always opens the assistant's turn"):
        render_chat("deepseek_v32", msgs, tools=None, chat_template_kwargs=None,
                    add_generation_prompt=False, continue_final_message=False)  # fmt: skip


def test_malformed_conversations_are_errors() -> None:
    with pytest.raises(ValueError, match="tool result without"):
        deepseek_v32.encode(
            [{"role": "user", "content": "x"}, {"role": "tool", "content": "1"}], False
        )
    bad_args = {"function": {"name": "f", "arguments": "{not json"}}
    with pytest.raises(ValueError, match="not JSON"):
        deepseek_v4.encode([{"role": "assistant", "content": "", "tool_calls": [bad_args]}], False)


def test_format_chosen_by_architecture_or_mode() -> None:
    assert resolve_chat_format("auto", ["DeepseekV4ForCausalLM"]) == "deepseek_v4"
    assert resolve_chat_format("auto", ["DeepseekV32ForCausalLM"]) == "deepseek_v32"
    assert resolve_chat_format("auto", ["LlamaForCausalLM"]) is None
    assert resolve_chat_format("hf", ["DeepseekV4ForCausalLM"]) is None
    assert resolve_chat_format("deepseek_v4", ["Qwen3ForCausalLM"]) == "deepseek_v4"
    with pytest.raises(ValueError, match="tokenizer_mode"):
        resolve_chat_format("deepseek_v5", [])


def test_tokenizer_applies_the_format(tmp_path: Path) -> None:
    from laneserve.frontend.tokenizer import Tokenizer
    from tests.tiny_models import build_tokenizer

    build_tokenizer(tmp_path, 320)
    tok = Tokenizer(tmp_path, chat_format="deepseek_v4")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    ids = tok.apply_chat_template(msgs, chat_template_kwargs={"thinking": True})
    assert ids == tok.encode(deepseek_v4.encode(msgs, True), add_special_tokens=False)
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert tok.apply_chat_template(msgs, chat_template=template) == tok.encode(
        "Be brief.hi", add_special_tokens=False
    )  # a request's own Jinja template still wins


def test_llm_chat_with_tokenizer_mode_for_a_fine_tune(tiny_models: dict[str, Path]) -> None:
    """`tokenizer_mode="deepseek_v4"` on a checkpoint of another architecture: LLM.chat
    prompts with the V4 format (the engine wiring)."""
    from laneserve import LLM, SamplingParams

    msgs = [{"role": "user", "content": "hi"}]
    one = SamplingParams(max_tokens=1, temperature=0)
    with LLM(str(tiny_models["llama"]), dtype="float32", tokenizer_mode="deepseek_v4") as llm:
        out = llm.chat(msgs, one, use_tqdm=False, chat_template_kwargs={"thinking": True})
        want = llm.engine.tokenizer.encode(deepseek_v4.encode(msgs, True), add_special_tokens=False)
    assert out[0].prompt_token_ids == want
