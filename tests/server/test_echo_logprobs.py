"""`/v1/completions` with `echo` + `logprobs` (what lm-evaluation-harness sends):
the prompt tokens' logprobs (first None), then the generated ones, with text
offsets; `max_tokens=0` allowed with `echo`. Checked with the real `openai` client
against transformers fp32 on the same tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from tests.server.conftest import Server
from tests.tiny_models import _cached_model

DATA = Path(__file__).parent / "data"
PROMPTS = ["The old lighthouse stood at the end", "A cat sat on the mat and"]


def hf_logprobs(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """[L, V] log_softmax of the logits at every prompt position (fp32)."""
    with torch.no_grad():
        logits = _cached_model(str(model_dir))(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def prompt_ids(model_dir: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))(text)["input_ids"]


def check_prompt_part(lp, text: str, ref: torch.Tensor, ids: list[int]) -> None:
    n = len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens[:n]) == text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    for pos in range(1, n):
        assert lp.token_logprobs[pos] == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-4)
        (top,) = lp.top_logprobs[pos].values()
        assert top == pytest.approx(ref[pos - 1].max().item(), abs=1e-4)


def test_echo_max_tokens_0_and_1(server: Server, tiny_models: dict[str, Path]) -> None:
    d = tiny_models["llama"]
    c = server.client()
    for max_tokens in (0, 1):
        res = c.completions.create(
            model="tiny",
            prompt=PROMPTS,
            max_tokens=max_tokens,
            temperature=0,
            echo=True,
            logprobs=1,
        )
        assert len(res.choices) == len(PROMPTS)
        for choice, text in zip(res.choices, PROMPTS, strict=True):
            ids = prompt_ids(d, text)
            ref = hf_logprobs(d, ids)
            lp = choice.logprobs
            assert len(lp.token_logprobs) == len(ids) + max_tokens
            check_prompt_part(lp, text, ref, ids)
            # NOTE: a generated token's text may be a raw byte piece; the prompt's is exact
            assert choice.text == text if max_tokens == 0 else choice.text.startswith(text)
            if max_tokens == 1:  # the generated token: greedy, its logprob from the last row
                assert lp.token_logprobs[-1] == pytest.approx(ref[-1].max().item(), abs=1e-4)
                assert lp.text_offset[-1] == len(text)
        assert res.usage.completion_tokens == max_tokens * len(PROMPTS)


def test_max_tokens_0_needs_echo(server: Server) -> None:
    r = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 0, "logprobs": 1}
    )
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


def test_echo_without_logprobs_is_unchanged(server: Server) -> None:
    c = server.client()
    res = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=0, echo=True)
    assert res.choices[0].text == PROMPTS[0] and res.choices[0].logprobs is None


def test_lm_eval_loglikelihood_requests(server: Server, tiny_models: dict[str, Path]) -> None:
    """lm-evaluation-harness `local-completions` scoring of a multiple-choice task,
    reproduced request for request: token-id prompts (context + continuation) in one
    batch, `echo`, `logprobs=1`, `max_tokens=1`; the loglikelihood of a continuation
    is `sum(token_logprobs[ctxlen:-1])`. It must equal transformers fp32's."""
    from transformers import AutoTokenizer

    d = tiny_models["llama"]
    tok = AutoTokenizer.from_pretrained(str(d))
    items = [json.loads(line) for line in (DATA / "tiny_mc.jsonl").read_text().splitlines()]
    pairs = []  # (context ids, continuation ids), split as lm-eval splits them
    for item in items:
        for choice in item["choices"]:
            whole = tok(item["context"] + choice)["input_ids"]
            ctx = tok(item["context"])["input_ids"]
            pairs.append((ctx, whole[len(ctx) :]))
    body = {
        "model": "tiny",
        "prompt": [c + x for c, x in pairs],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == len(pairs)
    for (ctx, cont), choice in zip(pairs, choices, strict=True):
        lps = choice["logprobs"]["token_logprobs"][len(ctx) : -1]
        tops = choice["logprobs"]["top_logprobs"][len(ctx) : -1]
        ref = hf_logprobs(d, ctx + cont)
        want = [ref[len(ctx) + i - 1, t].item() for i, t in enumerate(cont)]
        assert len(lps) == len(cont)
        assert sum(lps) == pytest.approx(sum(want), abs=1e-4)
        greedy = all(ref[len(ctx) + i - 1].argmax().item() == t for i, t in enumerate(cont))
        assert greedy == all(v == max(t.values()) for v, t in zip(lps, tops, strict=True))
