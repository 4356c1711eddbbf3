"""Logprobs of characters split over byte-level BPE tokens (emoji, CJK, accents)
through the server: `bytes` are the tokens' real bytes (joined, they rebuild the
text byte for byte), `token` is the text or `bytes:\\xHH...`, and completions'
`text_offset` indexes the returned text; chat and completions, echo, streaming.
The reference is the tokenizer's own decoding."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import Server

PROMPT = "Stars: 🌟🌟 Zürich 東京 naïve 🙂"
SPECIAL = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}


@pytest.fixture(scope="module")
def hf(tiny_models: dict[str, Path]):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_models["llama"]))


def shown(raw: bytes) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def check_completion(text: str, lp: dict, ids: list[int], hf) -> None:
    """`ids`: the tokens the logprobs describe, in order."""
    assert len(lp["tokens"]) == len(ids) == len(lp["text_offset"])
    raw = [hf_bytes(hf, i) for i in ids]
    assert lp["tokens"] == [shown(r) for r in raw]
    assert b"".join(raw).decode(errors="replace") == hf.decode(ids, skip_special_tokens=True)
    assert lp["text_offset"] == sorted(lp["text_offset"])
    for tok, off in zip(lp["tokens"], lp["text_offset"], strict=True):
        assert 0 <= off <= len(text)
        if not tok.startswith("bytes:") and tok not in SPECIAL:
            assert text[off : off + len(tok)] == tok


def hf_bytes(hf, token_id: int) -> bytes:
    """The tokenizer's own bytes of one token: its byte-level symbols mapped back."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    piece = hf.convert_ids_to_tokens(token_id)
    if piece in SPECIAL:
        return piece.encode()
    inv = {c: b for b, c in bytes_to_unicode().items()}
    return bytes(inv[c] for c in piece)


def test_completions_echo(server: Server, hf) -> None:
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 8, "echo": True, "logprobs": 2}
    r = server.post("/v1/completions", {**body, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"].startswith(PROMPT)
    prompt_ids = hf.encode(PROMPT)
    lp = choice["logprobs"]
    assert any(t.startswith("bytes:") for t in lp["tokens"][: len(prompt_ids)])
    # the prompt part rebuilds byte for byte; the whole list indexes the whole text
    tokens = lp["tokens"]
    n_out = len(tokens) - len(prompt_ids)
    out_ids = [hf.convert_tokens_to_ids(t) for t in _pieces(hf, tokens[len(prompt_ids) :])]
    assert len(out_ids) == n_out
    check_completion(choice["text"], lp, prompt_ids + out_ids, hf)
    assert max(lp["text_offset"]) <= len(choice["text"])


def _pieces(hf, shown_tokens: list[str]) -> list[str]:
    """Vocabulary entries for displayed tokens (unique in this vocabulary)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()
    out = []
    for t in shown_tokens:
        if t in SPECIAL:
            out.append(t)
            continue
        if t.startswith("bytes:"):
            raw = bytes(int(h, 16) for h in t[len("bytes:") :].split("\\x")[1:])
        else:
            raw = t.encode()
        out.append("".join(table[b] for b in raw))
    return out


def test_chat_bytes_rebuild_the_answer(server: Server, hf) -> None:
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 24,
        "logprobs": True,
        "top_logprobs": 3,
        "temperature": 1.0,
        "seed": 7,
    }
    r = server.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    entries = [e for e in choice["logprobs"]["content"] if e["token"] not in SPECIAL]
    joined = b"".join(bytes(e["bytes"]) for e in entries)
    assert joined.decode(errors="replace") == choice["message"]["content"]
    for e in choice["logprobs"]["content"]:
        assert e["token"] == shown(bytes(e["bytes"]))
        for t in e["top_logprobs"]:
            assert t["token"] == shown(bytes(t["bytes"]))
            tid = hf.convert_tokens_to_ids(_pieces(hf, [t["token"]])[0])
            assert bytes(t["bytes"]) == hf_bytes(hf, tid)


def sse(server: Server, path: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
    return events


def test_streamed_chat_matches_collected(server: Server) -> None:
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 24,
        "logprobs": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    whole = server.post("/v1/chat/completions", body).json()["choices"][0]
    chunks = sse(server, "/v1/chat/completions", {**body, "stream": True})
    streamed = [
        e for c in chunks for e in ((c["choices"][0].get("logprobs") or {}).get("content") or [])
    ]
    assert [e["bytes"] for e in streamed] == [e["bytes"] for e in whole["logprobs"]["content"]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == whole["message"]["content"]


def test_streamed_completion_offsets(server: Server, hf) -> None:
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 16, "logprobs": 0}
    body |= {"temperature": 0, "ignore_eos": True}
    whole = server.post("/v1/completions", body).json()["choices"][0]
    for echo in (False, True):
        chunks = sse(server, "/v1/completions", {**body, "stream": True, "echo": echo})
        text = "".join(c["choices"][0]["text"] for c in chunks)
        lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
        tokens = [t for lp in lps for t in lp["tokens"]]
        offsets = [o for lp in lps for o in lp["text_offset"]]
        base = len(PROMPT) if echo else 0
        assert text == (PROMPT if echo else "") + whole["text"]
        assert tokens == whole["logprobs"]["tokens"]
        assert offsets == [base + o for o in whole["logprobs"]["text_offset"]]
        for tok, off in zip(tokens, offsets, strict=True):
            assert off <= len(text)
            if not tok.startswith("bytes:") and tok not in SPECIAL:
                assert text[off : off + len(tok)] == tok
