"""Speculative decoding end to end: greedy outputs identical across {no spec,
MTP k=1, MTP k=2, n-gram k=3} x {async on, off}, with drafts made and some
accepted; known 100% and 0% acceptance; seeded sampling reproducible."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from laneserve import LLM, SamplingParams
from laneserve.engine_args import EngineArgs
from laneserve.frontend.engine import LLMEngine
from laneserve.kernels import weights as kernels_mod
from laneserve.sample import step as sample_step
from tests.tiny_models import build_bigram_model, build_exact_mtp_head, hf_greedy


@pytest.fixture(scope="module")
def bigram(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, Path, Path]]:
    """(model, exact MTP head, half-vocabulary MTP head, noisy MTP head) per family."""
    root = tmp_path_factory.mktemp("bigram")
    out = {}
    for family in ("llama", "qwen3"):
        model = build_bigram_model(root / family, family, seed=4)
        exact = build_exact_mtp_head(model, root / f"{family}-exact.safetensors")
        half = build_exact_mtp_head(
            model, root / f"{family}-half.safetensors", list(range(0, 320, 2))
        )
        # often wrong at its best guess, often right at its second or third
        noisy = build_exact_mtp_head(model, root / f"{family}-noisy.safetensors", noise=0.06)
        out[family] = (model, exact, half, noisy)
    return out


def prompts(n: int, seed: int, lo: int = 3, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def spec(method: str | None, k: int, weights: Path | None = None) -> dict | None:
    if method is None:
        return None
    cfg = {"method": method, "num_speculative_tokens": k}
    if weights is not None:
        cfg["draft_weights"] = str(weights)
    return cfg


def tree(weights: Path, shape: str) -> dict:
    return {"method": "mtp", "speculative_token_tree": shape, "draft_weights": str(weights)}


def drive(
    model: Path, spec_cfg: dict | None, async_on: bool, work: list, **kw: object
) -> tuple[list, dict]:
    """Staggered arrivals through LLMEngine; per request (tokens, finish reason)."""
    args = EngineArgs(
        model=str(model),
        dtype="float32",
        async_scheduling=async_on,
        speculative_config=spec_cfg,
        **kw,
    )
    eng = LLMEngine(args.create_config())
    pending = sorted(enumerate(work), key=lambda x: x[1][0])
    got: dict[int, list[int]] = {}
    reason: dict[int, str] = {}
    step = 0
    while pending or eng.has_unfinished:
        while pending and pending[0][1][0] <= step:
            i, (_, p, sp) = pending.pop(0)
            eng.add_request(str(i), p, sp)
            got[i] = []
        for d in eng.step():
            i = int(d.state.group_id)
            assert i not in reason, "output after finish"
            got[i] += d.token_ids
            if d.finished:
                reason[i] = d.state.finish_reason
        step += 1
    stats = eng.stats()
    eng.shutdown()
    return [(got[i], reason[i]) for i in range(len(work))], stats


def workload(model: Path, seed: int) -> list:
    ps = prompts(6, seed)
    ps[0] = prompts(1, seed + 100, 36, 40)[0]  # two full blocks: the last request hits them
    refs = [hf_greedy(model, p, 40) for p in ps]
    return [
        (0, ps[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)),
        (
            0,
            ps[1],
            SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        ),  # max_tokens mid-run
        (
            1,
            ps[2],
            SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[refs[2][9]]),
        ),  # stop inside a run
        (3, ps[3], SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)),
        (4, ps[4], SamplingParams(temperature=0, max_tokens=33, ignore_eos=True)),
        (6, ps[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)),  # prefix hit
    ]


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_greedy_identical_across_the_matrix(bigram: dict, family: str) -> None:
    model, _, half, _ = bigram[family]
    work = workload(model, seed=1)
    base, _ = drive(model, None, False, work)
    for (_, p, sp), (toks, _) in zip(work, base, strict=True):
        ref = hf_greedy(model, p, sp.max_tokens)
        if sp.stop_token_ids:
            ref = ref[: ref.index(sp.stop_token_ids[0]) + 1]
        assert toks == ref
    configs = [("mtp", 1, half), ("mtp", 2, half), ("ngram", 3, None)]
    for method, k, weights in configs:
        for async_on in (False, True):
            got, stats = drive(model, spec(method, k, weights), async_on, work)
            assert got == base, f"{method} k={k} async={async_on} changed the output"
            assert stats["spec_num_drafts"] > 0, f"{method} k={k}: no drafts"
            assert stats["spec_num_accepted"] > 0, (method, k, stats)
            if method == "mtp":  # the half-vocabulary head must also miss (odd tokens)
                assert stats["spec_num_accepted"] < stats["spec_num_drafts"], (k, stats)
            assert stats["prefix_cache_hits"] > 0


def test_speculation_with_preemption_matches(bigram: dict) -> None:
    model, _, half, noisy = bigram["llama"]
    work = [
        (0, p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        for p in prompts(5, 7, 8, 16)
    ]
    small = {"block_size": 4, "num_kv_blocks": 40, "max_model_len": 64}
    base, _ = drive(model, None, False, work, **small)
    chain, branched = spec("mtp", 2, half), tree(noisy, "[(0,), (1,), (2,), (0, 0)]")
    looked_up = {**chain, "ngram_first": True}
    for cfg, async_on in ((chain, False), (chain, True), (branched, True), (looked_up, True)):
        got, stats = drive(model, cfg, async_on, work, **small)
        assert got == base and stats["num_preemptions"] > 0 and stats["spec_num_accepted"] > 0
        assert stats["num_free_blocks"] == 40


@pytest.mark.parametrize("async_on", [False, True])
def test_known_full_acceptance(bigram: dict, async_on: bool) -> None:
    model, exact, _, _ = bigram["llama"]
    work = [
        (0, p, SamplingParams(temperature=0, max_tokens=31, ignore_eos=True)) for p in prompts(4, 3)
    ]
    got, stats = drive(model, spec("mtp", 2, exact), async_on, work)
    for (_, p, _), (toks, _) in zip(work, got, strict=True):
        assert toks == hf_greedy(model, p, 31)
    assert stats["spec_num_drafts"] > 0 and stats["spec_num_accepted"] == stats["spec_num_drafts"]
    assert stats["spec_acceptance_per_position"] == [1.0, 1.0]
    per_pos = stats["spec_num_drafts_per_position"]
    assert sum(per_pos) == stats["spec_num_drafts"] and per_pos[0] >= per_pos[1] > 0
    assert stats["spec_num_accepted_per_position"] == per_pos
    # 31 tokens per request, all four in every step: 1 from the prefill, then 3 per step
    # (2 accepted drafts + bonus), so 1 + ceil(30 / 3) = 11 steps, plus 2 for the async
    # pipeline. Without speculation it takes 31 steps, with one draft a step 16.
    assert stats["num_steps"] <= 1 + math.ceil(30 / 3) + 2, stats["num_steps"]


@pytest.mark.parametrize("async_on", [False, True])
def test_known_zero_acceptance(bigram: dict, async_on: bool) -> None:
    model, _, _, _ = bigram["qwen3"]
    work = [
        (0, p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)) for p in prompts(3, 5)
    ]
    refs = [hf_greedy(model, p, 20) for _, p, _ in work]
    never = next(t for t in range(3, 320) if all(t not in r for r in refs))
    head = build_exact_mtp_head(model, model.parent / f"never-{never}.safetensors", [never])
    got, stats = drive(model, spec("mtp", 1, head), async_on, work)
    assert [t for t, _ in got] == refs
    assert stats["spec_num_drafts"] > 0 and stats["spec_num_accepted"] == 0


def test_ngram_full_acceptance_on_repetition(bigram: dict) -> None:
    """A bigram model that loops: once the cycle is in the history, every n-gram draft is right."""
    model, _, _, _ = bigram["llama"]
    p = prompts(1, 9)[0]
    ref = hf_greedy(model, p, 80)
    got, stats = drive(
        model,
        spec("ngram", 3),
        True,
        [(0, p, SamplingParams(temperature=0, max_tokens=80, ignore_eos=True))],
    )
    assert got[0][0] == ref
    assert stats["spec_num_accepted"] > 0.5 * stats["spec_num_drafts"] > 0


@pytest.mark.parametrize("k", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_mtp_ngram_first_exact_and_engaged(bigram: dict, k: int) -> None:
    """With "ngram_first": prompt-lookup drafts where the history repeats, the head's
    elsewhere. With a head that is never right, every accepted draft is a lookup draft;
    the workload (staggered arrivals, stop inside a run, max_tokens mid-run, a prefix hit)
    and the looping request must match plain decoding, async on and off."""
    model, _, _, _ = bigram["llama"]
    work = workload(model, seed=5)
    loop = prompts(1, 9)[0]  # the bigram model loops on it (see the n-gram test above)
    work.append((2, loop, SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)))
    refs = [hf_greedy(model, p, sp.max_tokens) for _, p, sp in work]
    never = next(t for t in range(3, 320) if all(t not in r for r in refs))
    head = build_exact_mtp_head(model, model.parent / f"never-{never}.safetensors", [never])
    base, _ = drive(model, None, False, work)
    assert base[-1][0] == refs[-1]
    cfg = {**spec("mtp", k, head), "ngram_first": True}
    for async_on in (False, True):
        got, stats = drive(model, cfg, async_on, work)
        assert got == base, f"ngram_first k={k} async={async_on} changed the output"
        assert stats["spec_num_drafts"] > stats["spec_num_accepted"] > 0, stats
        assert stats["prefix_cache_hits"] > 0
    alone, stats = drive(model, spec("mtp", k, head), True, work)  # the head alone: never
    assert alone == base and stats["spec_num_drafts"] > 0 == stats["spec_num_accepted"]


@pytest.mark.slow
def test_mtp_ngram_first_with_a_token_tree(bigram: dict) -> None:
    """A tree's alternatives stay the head's best tokens other than a lookup draft: exact
    (async on and off, and seeded sampling reproducible), and the lookup adds accepted
    drafts over the same tree without it."""
    model, _, _, noisy = bigram["llama"]
    work = workload(model, seed=6)
    loop = prompts(1, 9)[0]
    work.append((2, loop, SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)))
    base, _ = drive(model, None, False, work)
    cfg = tree(noisy, "[(0,), (1,), (2,), (0, 0)]")
    _, plain = drive(model, cfg, True, work)
    for async_on in (False, True):
        got, stats = drive(model, {**cfg, "ngram_first": True}, async_on, work)
        assert got == base, f"tree + ngram_first async={async_on} changed the output"
        assert stats["spec_num_accepted"] > plain["spec_num_accepted"], (stats, plain)
    params = SamplingParams(temperature=0.9, max_tokens=40, seed=7, ignore_eos=True)
    outs = []
    for _ in range(2):
        cfg_ng = {**cfg, "ngram_first": True}
        with LLM(str(model), dtype="float32", speculative_config=cfg_ng) as llm:
            out = llm.generate({"prompt_token_ids": loop}, params, use_tqdm=False)
            outs.append(out[0].outputs[0].token_ids)
            assert llm.get_stats()["spec_num_drafts"] > 0
    assert outs[0] == outs[1]


def test_seeded_sampling_reproducible_with_speculation(bigram: dict) -> None:
    model, _, half, _ = bigram["llama"]
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=1234, ignore_eos=True)
    p = {"prompt_token_ids": prompts(1, 11)[0]}
    outs = []
    for _ in range(2):
        with LLM(str(model), dtype="float32", speculative_config=spec("mtp", 2, half)) as llm:
            outs.append(
                llm.generate(
                    [p, {"prompt_token_ids": [5, 6, 7]}],
                    [params, SamplingParams(temperature=1.0)],
                    use_tqdm=False,
                )[0]
                .outputs[0]
                .token_ids
            )
            assert llm.get_stats()["spec_num_drafts"] > 0
    assert outs[0] == outs[1]


def test_bad_speculative_configs(bigram: dict, tmp_path: Path) -> None:
    model, _, _, _ = bigram["llama"]
    with pytest.raises(ValueError, match="carries no MTP layer"):
        LLM(str(model), speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match="does not exist"):
        LLM(
            str(model),
            speculative_config={
                "method": "mtp",
                "draft_weights": str(tmp_path / "nope.safetensors"),
            },
        )
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(str(model), speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="unknown speculative config keys"):
        LLM(str(model), speculative_config={"method": "ngram", "k": 2})
    with pytest.raises(ValueError, match="disable_by_batch_size must be >= 1"):
        LLM(str(model), speculative_config={"method": "ngram", "disable_by_batch_size": 0})
    with pytest.raises(ValueError, match='"quantization" only applies to method "mtp"'):
        LLM(str(model), speculative_config={"method": "ngram", "quantization": "int8"})
    with pytest.raises(ValueError, match="unknown quantization 'int4'"):
        LLM(str(model), speculative_config={"method": "mtp", "quantization": "int4"})
    with pytest.raises(ValueError, match='"ngram_first" only applies to method "mtp"'):
        LLM(str(model), speculative_config={"method": "ngram", "ngram_first": True})
    with pytest.raises(ValueError, match="invalid speculative config"):
        LLM(str(model), speculative_config={"method": "mtp", "ngram_first": "yes"})


@pytest.mark.slow
def test_int8_mtp_head_exact_and_engaged(bigram: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """ "quantization": "int8" packs the head's linears as int8 (counted): the drafts may
    change, the output may not; chain and tree, async on and off."""
    model, _, _, noisy = bigram["llama"]
    packed = {"int8": 0}
    quantize = kernels_mod.quantize_int8

    def counted(w: object) -> object:
        packed["int8"] += 1
        return quantize(w)

    monkeypatch.setattr(kernels_mod, "quantize_int8", counted)
    work = workload(model, seed=3)
    base, _ = drive(model, None, False, work)
    for cfg in (spec("mtp", 2, noisy), tree(noisy, "[(0,), (1,), (2,)]")):
        for async_on in (False, True):
            packed["int8"] = 0
            got, stats = drive(model, {**cfg, "quantization": "int8"}, async_on, work)
            assert got == base, f"int8 head {cfg} async={async_on} changed the output"
            # eh_proj, qkv, o_proj, gate_up, down (the noisy head has the full vocabulary)
            assert packed["int8"] == 5, packed
            assert stats["spec_num_drafts"] > 0 and stats["spec_num_accepted"] > 0, stats


@pytest.mark.slow
def test_penalty_requests_beside_speculation_keep_their_penalties(bigram: dict) -> None:
    """Requests with penalties never speculate, but they share steps with ones that do:
    their penalties must still apply there."""
    model, _, half, noisy = bigram["llama"]
    ps = prompts(3, 22, 10, 20)
    penal = SamplingParams(
        temperature=0, max_tokens=30, repetition_penalty=1.6, presence_penalty=0.8, ignore_eos=True
    )
    work = [
        (0, ps[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)),
        (0, ps[1], penal),
        (2, ps[2], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)),
    ]
    base, _ = drive(model, None, False, work)
    unpenalized, _ = drive(model, None, False, [work[0], (0, ps[1], work[0][2]), work[2]])
    assert base[1] != unpenalized[1]  # the penalties change this request's output
    for cfg in (spec("mtp", 1, half), tree(noisy, "[(0,), (1,), (2,)]")):
        got, stats = drive(model, cfg, True, work)
        assert got == base, cfg
        assert stats["spec_num_drafts"] > 0


@pytest.mark.slow
def test_disable_by_batch_size_pauses_drafts_in_large_batches(bigram: dict) -> None:
    model, _, half, _ = bigram["llama"]
    ps = prompts(4, 11)
    work = [(0, ps[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))] + [
        (0, p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)) for p in ps[1:]
    ]
    base, _ = drive(model, None, True, work)
    full, full_stats = drive(model, spec("mtp", 2, half), True, work)
    limited_cfg = {**spec("mtp", 2, half), "disable_by_batch_size": 2}
    limited, stats = drive(model, limited_cfg, True, work)
    assert full == base and limited == base
    # drafts only once the short requests are gone (one request left running)
    assert 0 < stats["spec_num_drafts"] < full_stats["spec_num_drafts"]


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_token_tree_alternatives_exact_and_engaged(bigram: dict, family: str) -> None:
    """Alternatives to the first draft (side rows): same greedy output, more accepted."""
    model, _, _, noisy = bigram[family]
    work = workload(model, seed=1)
    work[3] = (3, work[3][1], SamplingParams(temperature=0, max_tokens=25, logprobs=2))
    work[4] = (4, work[4][1], SamplingParams(temperature=0, max_tokens=33, min_tokens=20))
    base, _ = drive(model, None, False, work)
    _, chain = drive(model, spec("mtp", 1, noisy), True, work)
    for shape, depth in (("[(0,), (1,), (2,)]", 1), ("[(0,), (1,), (0, 0)]", 2)):
        for async_on in (False, True):
            got, stats = drive(model, tree(noisy, shape), async_on, work)
            assert got == base, f"tree {shape} async={async_on} changed the output"
            assert len(stats["spec_acceptance_per_position"]) == depth
            assert stats["prefix_cache_hits"] > 0
            # the alternatives were taken: more first-position acceptance than the chain
            first = stats["spec_acceptance_per_position"][0]
            assert first > chain["spec_acceptance_per_position"][0] + 0.05, (shape, stats)


@pytest.mark.slow
def test_token_tree_all_greedy_fast_path_exact_and_engaged(
    bigram: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps whose rows are all greedy, dense and with alternatives take the one-argmax
    path (`_verify_tree_greedy`); the test above covers the general one."""
    model, _, _, noisy = bigram["llama"]
    calls = {"fast": 0}
    fast = sample_step._verify_tree_greedy

    def counted(*args: object) -> object:
        calls["fast"] += 1
        return fast(*args)

    monkeypatch.setattr(sample_step, "_verify_tree_greedy", counted)
    work = workload(model, seed=2)
    base, _ = drive(model, None, False, work)
    for shape in ("[(0,), (1,), (2,)]", "[(0,), (1,), (0, 0)]"):
        for async_on in (False, True):
            calls["fast"] = 0
            got, stats = drive(model, tree(noisy, shape), async_on, work)
            assert got == base, f"tree {shape} async={async_on} changed the output"
            assert calls["fast"] > 0 and stats["spec_num_accepted"] > 0, (shape, calls, stats)


def test_token_tree_seeded_sampling_reproducible(bigram: dict) -> None:
    model, _, _, noisy = bigram["llama"]
    params = SamplingParams(temperature=0.8, max_tokens=30, seed=99, ignore_eos=True)
    p = {"prompt_token_ids": prompts(1, 12)[0]}
    outs = []
    for _ in range(2):
        with LLM(
            str(model), dtype="float32", speculative_config=tree(noisy, "[(0,), (1,)]")
        ) as llm:
            out = llm.generate([p, p], [params, SamplingParams(temperature=0.5)], use_tqdm=False)
            outs.append(out[0].outputs[0].token_ids)
            assert llm.get_stats()["spec_num_accepted"] > 0
    assert outs[0] == outs[1]


def test_bad_token_trees(bigram: dict) -> None:
    model, _, _, noisy = bigram["llama"]
    cases = [
        ("[(0,), (1,), (1, 0)]", "only alternatives at the root"),
        ("[(0,), (2,)]", "only alternatives at the root"),
        ("(0, 1)", "list of index tuples"),
        ("[(0,), (0,)]", "list of index tuples"),
        ("not python", "list of index tuples"),
    ]
    for shape, message in cases:
        with pytest.raises(ValueError, match=message):
            LLM(str(model), speculative_config=tree(noisy, shape))
    with pytest.raises(ValueError, match="must equal the number of nodes"):
        LLM(
            str(model),
            speculative_config={**tree(noisy, "[(0,), (1,)]"), "num_speculative_tokens": 1},
        )
    with pytest.raises(ValueError, match='needs method "mtp"'):
        LLM(
            str(model),
            speculative_config={"method": "ngram", "speculative_token_tree": "[(0,), (1,)]"},
        )
