"""`LLM.stream` and the interactive `laneserve chat` (driven under a pseudo-terminal)."""

from __future__ import annotations

import sys
from pathlib import Path

import pexpect
import pytest

from laneserve import LLM, SamplingParams

PROMPT = [5, 17, 33, 41, 8]


@pytest.fixture(scope="module")
def llm(tiny_models: dict[str, Path]):
    with LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=512) as engine:
        yield engine


def test_stream_yields_the_text_generate_returns(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
    stream = llm.stream({"prompt_token_ids": PROMPT}, params)
    pieces = list(stream)
    assert len(pieces) > 1  # text arrives in parts, not at the end
    assert "".join(pieces) == want.outputs[0].text
    assert stream.output is not None
    assert stream.output.outputs[0].token_ids == want.outputs[0].token_ids
    assert stream.output.outputs[0].finish_reason == "length"


def test_closing_a_stream_aborts_its_request(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    before = llm.get_stats()["num_generation_tokens"]
    with llm.stream({"prompt_token_ids": PROMPT}, params) as stream:
        next(iter(stream))
    assert not llm.engine.has_unfinished
    assert stream.output is None
    # far fewer than the 400 tokens asked for were generated: the request was aborted
    assert llm.get_stats()["num_generation_tokens"] - before < 50
    again = llm.generate(
        {"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False
    )
    assert again[0].outputs[0].finish_reason in ("length", "stop")


def _spawn_chat(model: Path, *extra: str) -> pexpect.spawn:
    args = ["-m", "laneserve.entrypoints.cli", "--log-level", "warning", "chat", "--model"]
    args += [str(model), "--dtype", "float32", "--max-model-len", "512", "--temperature", "0"]
    return pexpect.spawn(sys.executable, args + list(extra), encoding="utf-8", timeout=240)


def test_chat_streams_resets_and_exits(tiny_models: dict[str, Path]) -> None:
    child = _spawn_chat(tiny_models["llama"], "--max-tokens", "6")
    child.expect(">>> ")
    child.sendline("hello there")
    child.expect(">>> ")
    assert "Traceback" not in child.before
    child.sendline("/nonsense")
    child.expect("unknown command")
    child.sendline("/reset")
    child.expect(r"\(conversation cleared\)")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_ctrl_c_stops_a_reply_and_keeps_the_chat(tiny_models: dict[str, Path]) -> None:
    child = _spawn_chat(tiny_models["llama"], "--max-tokens", "480", "--ignore-eos")
    child.expect(">>> ")
    child.sendline("tell me a long story")
    child.expect("tell me a long story\r\n")  # the terminal's echo of the line
    child.expect(r"\S")  # the reply has started
    child.sendintr()
    child.expect(r"\(stopped\)")
    child.expect(">>> ")
    child.sendeof()  # Ctrl-D leaves
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
