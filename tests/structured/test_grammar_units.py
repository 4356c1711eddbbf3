"""Structured output without a model: parameter checks, request-field translation,
the bitmask op, the commit fence, and the matchers' masks for drafts."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
import torch

from laneserve.protocol import RequestOutput
from laneserve.structured.bitmask import apply_bitmask, words_for
from laneserve.structured.fence import CommitFence
from laneserve.structured.matchers import GrammarBook, MaskRow
from laneserve.structured.params import StructuredOutputsParams as S
from laneserve.structured.request_fields import from_request


@pytest.mark.parametrize(
    ("kw", "fragment"),
    [
        ({"regex": "[a-z"}, "invalid regex"),
        ({"regex": "a(b"}, "unclosed group"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": {"type": "objekt"}}, "invalid json"),
        ({"grammar": "start: undefined_rule"}, "invalid grammar"),
        ({}, "exactly one"),
        ({"regex": "a", "choice": ["b"]}, "exactly one"),
        ({"choice": []}, "non-empty"),
        ({"regex": 5}, "must be a string"),
    ],
)
def test_bad_constraints_are_value_errors(kw: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match="structured_outputs") as e:
        S(**kw)
    assert fragment in str(e.value)


def test_good_constraints_compile() -> None:
    for kw in [
        {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}},
        {"json": '{"type": "string"}'},
        {"json_object": True},
        {"regex": r"\d+"},
        {"choice": ["yes", "no"]},
        {"grammar": 'start: "a" | "b"'},  # Lark
        {"grammar": 'root ::= "a" | "b"'},  # GBNF
    ]:
        assert S(**kw).kind in kw


def test_request_fields_translate() -> None:
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "m", "schema": schema, "strict": True}}
    assert from_request(rf, None, {}) == S(json=schema)
    assert from_request({"type": "json_object"}, None, {}) == S(json_object=True)
    assert from_request({"type": "text"}, None, {}) is None
    assert from_request(None, {"regex": "a+"}, {}) == S(regex="a+")
    options = {"disable_any_whitespace": True}  # vLLM: response_format fills these in
    assert from_request(rf, options, {}) == S(json=schema, disable_any_whitespace=True)
    assert from_request(None, None, {"guided_choice": ["a"], "guided_json": None}) == S(
        choice=["a"]
    )
    for bad, fragment in [
        (({"type": "json_schema"}, None, {}), "needs a `schema`"),
        (({"type": "xml"}, None, {}), "type must be"),
        ((None, {"regex": "a", "bogus": 1}, {}), "structured_outputs"),
        (({"type": "json_object"}, {"regex": "a"}, {}), "one kind"),
        ((None, None, {"guided_regex": "(("}), "invalid regex"),
        ((None, {"disable_any_whitespace": True}, {}), "exactly one"),
        ((None, {"choice": []}, {}), "non-empty"),
    ]:
        with pytest.raises(ValueError, match=re.escape(fragment)):
            from_request(*bad)


def test_apply_bitmask_keeps_only_set_bits() -> None:
    vocab = 70
    logits = torch.zeros(2, vocab)
    mask = torch.zeros(2, words_for(vocab), dtype=torch.int32)
    mask[0, 0] = 1 << 3
    mask[0, 2] = 1 << 5  # token 69
    mask[1, :] = -1  # all allowed (sign bit included: token 31)
    apply_bitmask(logits, mask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [3, 69]
    assert torch.isfinite(logits[1]).all()


def test_fence_waits_for_every_step_handed_on() -> None:
    fence = CommitFence()
    fence.wait()  # nothing in flight
    fence.handed_on()
    fence.handed_on()
    done = threading.Event()

    def waiter() -> None:
        fence.wait()
        done.set()

    t = threading.Thread(target=waiter)
    t.start()
    fence.reclaimed()
    assert not done.wait(0.05)  # one step still unreclaimed
    fence.reclaimed()
    t.join(5)
    assert done.is_set()


def _allowed(mask: torch.Tensor, row: int, vocab: int) -> set[int]:
    bits = [(int(mask[row, t // 32]) >> (t % 32)) & 1 for t in range(vocab)]
    return {t for t, b in enumerate(bits) if b}


def test_matcher_masks_drafts_and_advances_on_commits_only(tiny_models: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    model = tiny_models["llama"]
    tok = AutoTokenizer.from_pretrained(model)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    book = GrammarBook(model / "tokenizer.json", 320, [eos])
    book.add(7, S(choice=["The old", "A computer"]))
    the, old = tok.encode("The")[0], tok.encode(" old")
    bad = tok.encode("Zürich")[0]
    # position 0 + drafts ["The", bad]: row 2 follows a rejected draft, so it is all-ones
    mask = book.bitmask([MaskRow(7, 1, [the, bad])], 4)
    assert _allowed(mask, 0, 320) == set(range(320))  # not a grammar row
    assert the in _allowed(mask, 1, 320) and bad not in _allowed(mask, 1, 320)
    assert bad not in _allowed(mask, 2, 320) and old[0] in _allowed(mask, 2, 320)
    assert _allowed(mask, 3, 320) == set(range(320))
    # the drafts were rolled back: position 0 is unchanged until a commit
    again = book.bitmask([MaskRow(7, 0)], 1)
    assert torch.equal(again[0], mask[1])
    book.commit([RequestOutput(7, [the, *old])])
    assert _allowed(book.bitmask([MaskRow(7, 0)], 1), 0, 320) == {eos}  # complete: EOS only
    book.drop([7])
    assert not book.constrains([7])
