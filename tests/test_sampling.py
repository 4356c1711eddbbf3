"""SamplingParams validation and the sampler's math (no model)."""

from __future__ import annotations

import pytest
import torch

from laneserve.sample import sampler
from laneserve.sample.sampler import RowSampling
from laneserve.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature must be in"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"top_p": 1.5}, "top_p must be in"),
        ({"top_k": -2}, "top_k must be"),
        ({"min_p": 1.2}, "min_p must be in"),
        ({"max_tokens": 0}, "max_tokens must be"),
        ({"max_tokens": -5}, "max_tokens must be"),
        ({"n": 0}, "n must be"),
        ({"presence_penalty": 3.0}, "presence_penalty must be in"),
        ({"frequency_penalty": -2.5}, "frequency_penalty must be in"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be in"),
        ({"logprobs": 50}, "logprobs must be"),
        ({"stop": [""]}, "stop must be"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be"),
        ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
        ({"temperature": "hot"}, "temperature must be in"),
    ],
)
def test_invalid_params_raise_precise_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_defaults_and_normalisation() -> None:
    p = SamplingParams(stop="###", top_k=-1)
    assert p.stop == ["###"] and p.top_k == 0 and p.temperature == 1.0 and p.max_tokens == 16
    assert SamplingParams(temperature=0).greedy


def batch_for(params: list[SamplingParams], vocab: int, seeds: list[int | None] | None = None):
    gens = []
    for s in seeds or [None] * len(params):
        g = None
        if s is not None:
            g = torch.Generator()
            g.manual_seed(s)
        gens.append(g)
    rows = [RowSampling(p, g, 1, [0]) for p, g in zip(params, gens, strict=True)]
    shared = torch.Generator()
    shared.manual_seed(123)
    return sampler.prepare(rows, vocab, torch.device("cpu"), shared)


def draw(params: SamplingParams, logits: torch.Tensor, n: int, seed: int = 0) -> torch.Tensor:
    b = batch_for([params] * n, logits.shape[-1], seeds=[seed + i for i in range(n)])
    return sampler.sample(logits.expand(n, -1).clone(), b)


def test_top_k_top_p_min_p_never_leave_their_support() -> None:
    torch.manual_seed(0)
    logits = torch.randn(50) * 2
    order = logits.argsort(descending=True)
    probs = torch.softmax(logits, -1)
    tokens = draw(SamplingParams(top_k=5), logits, 4000)
    assert set(tokens.tolist()) <= set(order[:5].tolist())
    assert len(set(tokens.tolist())) == 5  # and they do use the whole support
    cum = probs[order].cumsum(0)
    nucleus = set(order[: int((cum < 0.6).sum()) + 1].tolist())
    assert set(draw(SamplingParams(top_p=0.6), logits, 4000).tolist()) <= nucleus
    keep = set(torch.nonzero(probs >= 0.3 * probs.max()).flatten().tolist())
    assert set(draw(SamplingParams(min_p=0.3), logits, 4000).tolist()) <= keep


def test_temperature_sampling_matches_the_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    tokens = draw(SamplingParams(temperature=0.7), logits, 20000)
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    expected = torch.softmax(logits / 0.7, -1)
    assert torch.allclose(freq, expected, atol=0.015)


def test_seeded_rows_do_not_depend_on_companions() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 64)
    p = SamplingParams(temperature=1.0, seed=7)
    other = SamplingParams(temperature=1.3)
    alone = sampler.sample(logits[:1].clone(), batch_for([p], 64, [7]))
    mixed = torch.stack([logits[1], logits[0], logits[2]])
    with_company = sampler.sample(mixed, batch_for([other, p, other], 64, [None, 7, None]))
    assert alone[0] == with_company[1]
    again = [sampler.sample(logits[:1].clone(), batch_for([p], 64, [7]))[0] for _ in range(3)]
    assert all(a == alone[0] for a in again)


def test_greedy_rows_take_argmax_of_penalised_logits() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.5, 0.1, 0.2]])
    b = batch_for([SamplingParams(temperature=0), SamplingParams(temperature=0)], 3)
    assert sampler.sample(logits.clone(), b).tolist() == [1, 0]


def test_penalties_follow_their_definitions() -> None:
    # one sequence: prompt [0, 1], outputs [1, 2, 2] -> V = 4
    history = torch.tensor([[0, 1, 1, 2, 2]])
    known = torch.tensor([5])
    logits = torch.tensor([[2.0, -1.0, 1.0, 0.5]])
    p = SamplingParams(
        temperature=0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25
    )
    rows = [RowSampling(p, None, 2, [0])]
    b = sampler.prepare(rows, 4, torch.device("cpu"), torch.Generator())
    out = logits.clone()
    sampler.apply_penalties(out, b, history, known)
    # token 0: prompt only -> repetition: 2.0 / 2 = 1.0
    # token 1: prompt + output x1 -> -1 * 2 - 0.25 - 0.5 = -2.75
    # token 2: output x2 -> 1 / 2 - 0.5 - 0.5 = -0.5
    # token 3: unseen -> 0.5
    assert torch.allclose(out, torch.tensor([[1.0, -2.75, -0.5, 0.5]]))


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[3])
    rows = [RowSampling(p, None, 1, [1])]
    b = sampler.prepare(rows, 4, torch.device("cpu"), torch.Generator())
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0]])
    early = logits.clone()
    sampler.apply_min_tokens(early, b, torch.tensor([1]))
    assert early[0, 1] == float("-inf") and early[0, 3] == float("-inf")
    late = logits.clone()
    sampler.apply_min_tokens(late, b, torch.tensor([3]))
    assert torch.equal(late, logits)


def test_logprobs_of_raw_distribution() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    chosen, rank, top_ids, top_lp = sampler.compute_logprobs(logits, torch.tensor([1]), 2)
    lp = torch.log_softmax(logits, -1)
    assert torch.allclose(chosen, lp[:, 1]) and rank.tolist() == [2]
    assert top_ids.tolist() == [[2, 1]] and torch.allclose(top_lp, lp[:, [2, 1]])


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({5: 100.5}, "logit_bias: values must be in"),
        ({5: "x"}, "logit_bias: values must be in"),
        ({-1: 1.0}, "logit_bias: token ids"),
        ({2**40: 1.0}, "logit_bias: token ids"),
    ],
)
def test_invalid_logit_bias_names_the_field(bias: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=bias)


def test_logit_bias_is_added_to_its_rows_only() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, 0.1, 0.2, 0.3]])
    biased = SamplingParams(temperature=0, logit_bias={3: 100, 1: -100})
    b = batch_for([biased, SamplingParams(temperature=0)], 4)
    out = logits.clone()
    sampler.apply_logit_bias(out, b)
    assert torch.allclose(out[0], torch.tensor([1.0, -97.0, 2.0, 100.0]))
    assert torch.equal(out[1], logits[1])
    assert sampler.sample(out, b).tolist() == [3, 0]
    # through a logits-row map (the rows of a step that also verifies drafts)
    mapped = torch.zeros(3, 4)
    sampler.apply_logit_bias(mapped, b, torch.tensor([2, 0]))
    assert mapped[2, 3] == 100.0 and mapped[2, 1] == -100.0 and not mapped[:2].any()
    assert batch_for([SamplingParams(logit_bias={})], 4).logit_bias is None
