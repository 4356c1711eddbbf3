"""`LLM.stream` and the interactive `laneserve chat` (driven under a pseudo-terminal)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pexpect
import pytest

from laneserve import LLM, SamplingParams

PROMPT = [5, 17, 33, 41, 8]


@pytest.fixture(autouse=True)
def _terminal_sigint() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt, as in a terminal, even when the suite was started
    as a background job (a non-interactive shell starts those with SIGINT ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


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


def _interrupt_in_step(monkeypatch: pytest.MonkeyPatch, llm: LLM, at: int) -> list[int]:
    """Send this process SIGINT (a Ctrl-C) from inside engine step `at`; returns the list
    of steps that ran to their end."""
    engine, done = llm.engine, []
    step = engine.step

    def stepping():
        if len(done) == at:
            os.kill(os.getpid(), signal.SIGINT)
        out = step()
        done.append(len(done))
        return out

    monkeypatch.setattr(engine, "step", stepping)
    return done


def test_ctrl_c_in_generate_aborts_after_the_step(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C during `generate` lets the step finish, aborts the requests and raises a
    plain KeyboardInterrupt; the engine then answers the next call as usual."""
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    before = llm.get_stats()["num_generation_tokens"]
    done = _interrupt_in_step(monkeypatch, llm, at=3)
    with pytest.raises(KeyboardInterrupt, match="the requests were aborted"):
        llm.generate([{"prompt_token_ids": PROMPT}] * 2, params, use_tqdm=False)
    assert done[:4] == [0, 1, 2, 3]  # the interrupted step ran to its end
    assert not llm.engine.has_unfinished
    assert llm.get_stats()["num_generation_tokens"] - before < 50
    monkeypatch.undo()
    want = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    again = llm.generate({"prompt_token_ids": PROMPT}, want, use_tqdm=False)[0].outputs[0]
    assert again.finish_reason == "length" and len(again.token_ids) == 8


def test_ctrl_c_in_a_stream_aborts_its_request(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    _interrupt_in_step(monkeypatch, llm, at=3)
    pieces = []
    with pytest.raises(KeyboardInterrupt):
        for piece in llm.stream({"prompt_token_ids": PROMPT}, params):
            pieces.append(piece)
    assert pieces and len(pieces) < 50
    assert not llm.engine.has_unfinished


def _spawn_chat(model: Path, *extra: str) -> pexpect.spawn:
    args = ["-m", "laneserve.entrypoints.cli", "--log-level", "warning", "chat", "--model"]
    args += [str(model), "--dtype", "float32", "--max-model-len", "512", "--temperature", "0"]
    return pexpect.spawn(
        sys.executable,
        args + list(extra),
        encoding="utf-8",
        timeout=240,
        preexec_fn=_default_sigint,  # as from a terminal, also when the suite runs in the background
    )


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _reply(child: pexpect.spawn, line: str, end: str = ">>> ") -> str:
    """Send a line; the text the chat printed after the terminal's echo, up to `end`."""
    child.sendline(line)
    child.expect_exact(line + "\r\n")
    child.expect_exact(end)
    return child.before.replace("\r", "")


def _in_order(part: str, whole: str) -> bool:
    """Every character of `part` occurs in `whole`, in the same order."""
    rest = iter(whole)
    return all(ch in rest for ch in part)


def _worker_pid(chat_pid: int) -> int:
    """The PID of the chat's worker process (its child running laneserve.ipc)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == chat_pid and b"laneserve.ipc" in cmdline:
            return int(stat.parent.name)
    raise AssertionError(f"process {chat_pid} has no worker process")


@pytest.mark.slow
def test_chat_streams_resets_and_exits(tiny_models: dict[str, Path]) -> None:
    child = _spawn_chat(tiny_models["llama"], "--max-tokens", "6", "--ignore-eos")
    child.expect(">>> ")
    reply = _reply(child, "hello there")
    assert "Traceback" not in reply
    # the reply streamed text, and the chat says that the 6-token limit cut it
    text, note = reply.rsplit("\n(cut at the 6-token limit; --max-tokens sets it)", 1)
    assert text.strip()
    assert note.strip() == ""
    child.sendline("/nonsense")
    child.expect("unknown command")
    child.sendline("/reset")
    child.expect(r"\(conversation cleared\)")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


@pytest.fixture(scope="module")
def long_reply(llm: LLM) -> str:
    """What the chat below writes for its question when nothing interrupts it."""
    params = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)
    prompt = llm.chat_prompt([{"role": "user", "content": "tell me a long story"}])
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) > 400  # the context's end
    return out.text.replace("\r", "")


@pytest.mark.slow  # a chat process with its own worker, a 480-token reply
def test_ctrl_c_stops_only_the_reply(tiny_models: dict[str, Path], long_reply: str) -> None:
    """Ctrl-C at the prompt and during a long reply: the reply stops early, the worker
    process lives on (the terminal's SIGINT never reaches it) and the chat goes on."""
    child = _spawn_chat(
        tiny_models["llama"], "--max-tokens", "480", "--ignore-eos", "--worker-mode", "process"
    )
    child.expect(">>> ")
    worker = _worker_pid(child.pid)

    child.sendintr()  # at an empty prompt
    child.expect_exact(">>> ")
    assert _worker_pid(child.pid) == worker

    child.sendline("tell me a long story")
    child.expect_exact("tell me a long story\r\n")  # the terminal's echo of the line
    child.expect(r"\S")  # the reply has started
    first = child.after
    child.sendintr()
    child.expect_exact("(stopped)")
    written = (first + child.before).replace("\r", "").replace("^C", "").strip()  # ^C: echo
    child.expect_exact(">>> ")
    # the reply written so far is from the uninterrupted one (in order; the terminal
    # drops the output it still held when Ctrl-C came), and far shorter
    assert _in_order(written, long_reply), (written, long_reply[: len(written) + 20])
    assert len(written) < len(long_reply) / 2, (len(written), len(long_reply))
    assert _worker_pid(child.pid) == worker

    second = _reply(child, "and then?")
    assert "Traceback" not in second and "died" not in second and "restart" not in second
    assert second.strip()  # answered, by the same worker
    assert _worker_pid(child.pid) == worker
    child.sendeof()  # Ctrl-D leaves
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
