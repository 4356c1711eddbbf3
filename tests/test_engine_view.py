"""`LLM.llm_engine` (vLLM's step-by-step calls) and `RequestOutputKind`: DELTA
outputs join to the CUMULATIVE / `LLM.generate` result, FINAL_ONLY reports once;
`stop_reason` in the outputs."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from laneserve import LLM, RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_models: dict[str, Path]) -> Iterator[LLM]:
    engine = LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=128)
    yield engine
    engine.shutdown()


def run(llm: LLM, kind: RequestOutputKind, n: int = 1) -> list:
    eng = llm.llm_engine
    params = SamplingParams(
        temperature=0.8, seed=5, n=n, max_tokens=12, ignore_eos=True, logprobs=1, output_kind=kind
    )
    eng.add_request("r", "The old lighthouse", params)
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    return outs


def test_delta_cumulative_final_only_agree(llm: LLM) -> None:
    ref = llm.generate(
        ["The old lighthouse"],
        SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=12, ignore_eos=True, logprobs=1),
    )[0]
    delta = run(llm, RequestOutputKind.DELTA, n=2)
    cumulative = run(llm, RequestOutputKind.CUMULATIVE, n=2)
    final = run(llm, RequestOutputKind.FINAL_ONLY, n=2)
    assert len(final) == 1 and final[0].finished
    assert len(delta) > 1 and delta[-1].finished and not delta[0].finished
    for i in range(2):
        want = ref.outputs[i]
        assert "".join(o.outputs[i].text for o in delta) == want.text
        assert [t for o in delta for t in o.outputs[i].token_ids] == want.token_ids
        assert sum(len(o.outputs[i].logprobs) for o in delta) == len(want.token_ids)
        assert cumulative[-1].outputs[i].text == want.text == final[0].outputs[i].text
        assert cumulative[-1].outputs[i].token_ids == want.token_ids
    texts = [o.outputs[0].text for o in cumulative]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))


def test_stop_reason_and_abort(llm: LLM) -> None:
    full = llm.generate(["The old"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    text = full[0].outputs[0].text
    stop = text[4:6]
    out = llm.generate(
        ["The old"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    eng = llm.llm_engine
    eng.add_request("a", "The old", SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    eng.abort_request("a")
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.get_num_unfinished_requests() == 0


def test_output_kind_is_checked() -> None:
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=7)  # type: ignore[arg-type]
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA  # type: ignore[arg-type]
