"""bf16 (the default dtype) with the CPU kernels: greedy output is token-identical
with speculation (MTP chain, n-gram) and without, async scheduling on and off, over
staggered arrivals, a prefix hit and a looping request; speculation is engaged
(drafts made and accepted; the MTP head's also rejected)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from laneserve.engine_args import EngineArgs
from laneserve.frontend.engine import LLMEngine
from laneserve.sampling_params import SamplingParams
from tests.tiny_models import build_bigram_model, build_exact_mtp_head

Work = list[tuple[int, list[int], SamplingParams]]


@pytest.fixture(scope="module")
def bigram(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A bigram model and an MTP head that only knows even tokens (accepts and rejects)."""
    root = tmp_path_factory.mktemp("bf16")
    model = build_bigram_model(root / "llama", "llama", seed=4)
    half = build_exact_mtp_head(model, root / "half.safetensors", list(range(0, 320, 2)))
    return model, half


def drive(model: Path, spec: dict | None, async_on: bool, work: Work) -> tuple[list, dict]:
    args = EngineArgs(
        model=str(model), dtype="bfloat16", async_scheduling=async_on, speculative_config=spec
    )
    eng = LLMEngine(args.create_config())
    ready = eng.client.ready
    assert ready.weight_dtype == "bfloat16" and "torch" not in ready.kernels.lower(), ready
    pending = sorted(enumerate(work), key=lambda x: x[1][0])
    got: dict[int, list[int]] = {}
    step = 0
    while pending or eng.has_unfinished:
        while pending and pending[0][1][0] <= step:
            i, (_, p, sp) = pending.pop(0)
            eng.add_request(str(i), p, sp)
            got[i] = []
        for d in eng.step():
            got[int(d.state.group_id)] += d.token_ids
        step += 1
        assert step < 2000
    stats = eng.stats()
    eng.shutdown()
    return [got[i] for i in range(len(work))], stats


def workload() -> Work:
    rng = random.Random(3)
    ps = [[rng.randrange(3, 320) for _ in range(rng.randint(3, 30))] for _ in range(4)]
    shared = [rng.randrange(3, 320) for _ in range(36)]  # two full blocks: a prefix hit
    loop = [rng.randrange(3, 320) for _ in range(12)]

    def greedy(n: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    return [
        (0, shared + ps[0][:3], greedy(40)),
        (0, ps[1], greedy(7)),
        (1, ps[2], greedy(33)),
        (3, ps[3], greedy(25)),
        (5, shared + ps[0][3:6], greedy(20)),
        (2, loop, greedy(80)),  # the bigram model falls into a cycle: n-gram drafts hit
    ]


@pytest.mark.slow
def test_bf16_greedy_identical_with_speculation_and_async(bigram: tuple[Path, Path]) -> None:
    model, half = bigram
    work = workload()
    base, base_stats = drive(model, None, False, work)
    assert [len(t) for t in base] == [sp.max_tokens for _, _, sp in work]
    assert base_stats["prefix_cache_hits"] > 0
    configs = [
        None,
        {"method": "mtp", "num_speculative_tokens": 2, "draft_weights": str(half)},
        {"method": "ngram", "num_speculative_tokens": 3},
    ]
    for spec in configs:
        for async_on in (False, True):
            if spec is None and not async_on:
                continue  # the baseline
            got, stats = drive(model, spec, async_on, work)
            assert got == base, f"{spec} async={async_on} changed the bf16 output"
            if spec is not None:
                drafts, accepted = stats["spec_num_drafts"], stats["spec_num_accepted"]
                assert drafts >= accepted > 0, (spec, async_on, stats)
                if spec["method"] == "mtp":  # the odd tokens it cannot draft: rollbacks
                    assert drafts > accepted, (async_on, stats)


@pytest.mark.slow
def test_bf16_ngram_identical_on_a_model_with_attention(tiny_models: dict[str, Path]) -> None:
    """The bigram model's attention output is zero; this 3-layer model's is not. It
    never loops, so nearly all of its one-token-lookup drafts are rejected: each verify
    step must give the token a plain decode gives (bf16) and undo the drafts' KV."""
    model = tiny_models["llama"]
    work = workload()
    base, _ = drive(model, None, False, work)
    # one-token lookups: drafts in most steps, a few right by chance
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}
    for async_on in (False, True):
        got, stats = drive(model, spec, async_on, work)
        assert got == base, f"n-gram async={async_on} changed the bf16 output"
        assert stats["spec_num_drafts"] > 0, stats
