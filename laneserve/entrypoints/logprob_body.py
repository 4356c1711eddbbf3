"""Logprobs in OpenAI's shapes (chat `content` entries, completions' parallel
lists), with each token shown by its real bytes (frontend/token_bytes.py)."""

from __future__ import annotations

from collections.abc import Callable

from laneserve.frontend.token_bytes import CharOffsets, display_text
from laneserve.outputs import Logprob

# a token's bytes from its id (and its Logprob, when the tokenizer is not at hand)
RawBytes = Callable[[int, Logprob | None], bytes]
Entry = dict[int, Logprob]


def top(entry: Entry, n: int) -> list[tuple[int, Logprob]]:
    """The entry's top-n (rank 1..n), best first."""
    return sorted(
        ((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= n),
        key=lambda p: p[1].rank or 0,  # every rank here is set (filtered above)
    )


def chat_logprobs(entries: list[Entry | None], n: int, raw: RawBytes) -> dict:
    """`token` (text, or `bytes:\\xHH...` for part of a character), `bytes` (the
    token's real bytes: joined, they rebuild the text), `logprob`, `top_logprobs`."""

    def one(tid: int, lp: Logprob) -> dict:
        token = raw(tid, lp)
        return {"token": display_text(token), "logprob": lp.logprob, "bytes": list(token)}

    content = []
    for e in entries:
        if e is None:
            continue
        chosen_id, chosen = next(iter(e.items()))
        content.append(
            {**one(chosen_id, chosen), "top_logprobs": [one(t, lp) for t, lp in top(e, n)]}
        )
    return {"content": content}


def completion_logprobs(
    entries: list[Entry | None],
    n: int,
    raw: RawBytes,
    prompt_ids: list[int],
    offsets: CharOffsets,
) -> dict:
    """`entries` may start with echoed prompt tokens; a None entry (the first prompt
    token has no prefix) is that prompt token with null logprobs, as vLLM reports it.
    `text_offset` counts characters of the returned text; `offsets` carries on from
    earlier chunks when streaming."""
    body: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    starts = []
    for i, e in enumerate(entries):
        if e is None:
            tid, chosen, value, top_n = prompt_ids[i], None, None, None
        else:
            tid, chosen = next(iter(e.items()))
            value = chosen.logprob
            top_n = {display_text(raw(t, lp)): lp.logprob for t, lp in top(e, n)}
        token = raw(tid, chosen)
        starts.append(offsets.feed(token))
        body["tokens"].append(display_text(token))
        body["token_logprobs"].append(value)
        body["top_logprobs"].append(top_n)
    return {**body, "text_offset": starts}


def prompt_logprobs_body(entries: list[Entry | None] | None) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first), token id ->
    logprob (clamped at -9999 as vLLM does), rank and decoded token."""
    if entries is None:
        return None
    return [
        None
        if e is None
        else {
            str(t): {
                "logprob": max(lp.logprob, -9999.0),
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for t, lp in e.items()
        }
        for e in entries
    ]
