"""logit_bias end to end (offline LLM): +100 on a token makes greedy pick it, -100
bans the greedy token, an empty bias changes nothing; with speculation on, biased
requests decode without drafts and the others keep their exact greedy output."""

from __future__ import annotations

from pathlib import Path

import pytest

from laneserve import LLM, SamplingParams

PROMPTS = [[5, 17, 42, 9, 100], [7, 7, 8, 250, 3, 11, 60]]


def greedy(**kw: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **kw)


def tokens(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_logit_bias_steers_greedy(tiny_models: dict[str, Path], spec: dict | None) -> None:
    with LLM(str(tiny_models["llama"]), dtype="float32", speculative_config=spec) as llm:
        plain = tokens(llm, [greedy(), greedy()])
        assert tokens(llm, [greedy(logit_bias={}), greedy(logit_bias={})]) == plain
        forced = tokens(llm, [greedy(logit_bias={123: 100}), greedy()])
        assert forced[0] == [123] * 8 and forced[1] == plain[1]
        first = plain[0][0]
        banned = tokens(llm, [greedy(), greedy(logit_bias={plain[1][0]: -100})])
        assert banned[0] == plain[0] and banned[1][0] != plain[1][0]
        assert first not in tokens(llm, [greedy(logit_bias={first: -100})] * 2)[0]
        with pytest.raises(ValueError, match="logit_bias: token id 320"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], greedy(logit_bias={320: 1}))
