"""`laneserve chat`: an interactive terminal chat that streams the reply.

The conversation is kept and sent again with each turn (the prefix cache makes the
repeated part cheap). `/reset` starts over, `/exit` (or Ctrl-D) leaves, and Ctrl-C
during a reply stops that reply and keeps the chat open.
"""

from __future__ import annotations

import argparse
import signal
import sys
from types import FrameType
from typing import TextIO

from laneserve.engine_args import EngineArgs
from laneserve.entrypoints.sampling_flags import add_sampling_flags, sampling_params_from

HELP = "commands: /reset (forget the conversation), /exit (or Ctrl-D); Ctrl-C stops a reply"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="interactive chat in the terminal, streaming the replies")
    p.add_argument("--system", default=None, help="a system message that opens the conversation")
    add_sampling_flags(p, max_tokens=512, temperature=0.7, top_p=0.9)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run_chat)


class StopFlag:
    """Set by SIGINT while a reply streams, so the reply ends between engine steps
    (a KeyboardInterrupt in the middle of a step could leave a step half sent)."""

    def __init__(self) -> None:
        self.set = False

    def handler(self, signum: int, frame: FrameType | None) -> None:
        self.set = True


def run_chat(ns: argparse.Namespace) -> int:
    from laneserve import LLM

    args = EngineArgs.from_cli(ns)
    params = sampling_params_from(ns)
    llm = LLM(**vars(args))
    try:
        return chat_loop(llm, params, ns.system, sys.stdin, sys.stdout)
    finally:
        llm.shutdown()


def chat_loop(llm, params, system: str | None, stdin: TextIO, stdout: TextIO) -> int:
    """Read a line, stream the reply, repeat. Returns the exit code."""
    opening = [{"role": "system", "content": system}] if system else []
    history = list(opening)
    print(f"laneserve chat — {HELP}", file=stdout, flush=True)
    while True:
        print("\n>>> ", end="", file=stdout, flush=True)
        try:
            line = stdin.readline()
        except KeyboardInterrupt:
            print(file=stdout)
            continue
        if not line:  # Ctrl-D
            print(file=stdout)
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history = list(opening)
            print("(conversation cleared)", file=stdout, flush=True)
            continue
        if text.startswith("/"):
            print(f"unknown command {text!r}; {HELP}", file=stdout, flush=True)
            continue
        history.append({"role": "user", "content": text})
        reply, ending = _stream_reply(llm, history, params, stdout)
        history.append({"role": "assistant", "content": reply})
        if ending:
            print(f"\n{ending}", file=stdout, flush=True)


def _stream_reply(llm, history: list[dict], params, stdout: TextIO) -> tuple[str, str]:
    """Stream one reply; (its text, a note on how it ended unless it ended normally)."""
    flag = StopFlag()
    previous = signal.signal(signal.SIGINT, flag.handler)
    parts: list[str] = []
    try:
        with llm.stream(llm.chat_prompt(history), params) as stream:
            for piece in stream:
                parts.append(piece)
                print(piece, end="", file=stdout, flush=True)
                if flag.set:
                    break  # leaving the with block aborts the request
    finally:
        signal.signal(signal.SIGINT, previous)
    print(file=stdout, flush=True)
    return "".join(parts), _ending(stream, flag.set, params.max_tokens)


def _ending(stream, stopped: bool, max_tokens: int | None) -> str:
    """The note printed after a reply that Ctrl-C stopped, the token limit cut or an
    error ended; nothing after one that ended at the model's end of turn."""
    if stopped or stream.output is None:
        return "(stopped)"
    out = stream.output
    if out.error:
        return f"(error: {out.error})"
    completion = out.outputs[0]
    if completion.finish_reason != "length":
        return ""
    if max_tokens is not None and len(completion.token_ids) >= max_tokens:
        return f"(cut at the {max_tokens}-token limit; --max-tokens sets it)"
    return "(cut: the conversation fills the context; /reset starts over)"
