"""Async (depth-2, worker lanes / worker process) == sync == transformers, on a
tiny real model, with staggered arrivals, stops in flight, aborts, preemption,
chunked prefill and prefix hits. No request may get a token after it finished."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from laneserve.engine_args import EngineArgs
from laneserve.frontend.engine import LLMEngine
from laneserve.sampling_params import SamplingParams
from tests.tiny_models import hf_greedy

MODES = {
    "sync": {"async_scheduling": False},
    "async": {"async_scheduling": True},
    "async-process": {"async_scheduling": True, "worker_mode": "process"},
}


def engine(model: Path, mode: str, **kw: object) -> LLMEngine:
    args = EngineArgs(model=str(model), dtype="float32", **MODES[mode], **kw)
    return LLMEngine(args.create_config())


def drive(
    eng: LLMEngine,
    arrivals: list[tuple[int, list[int], SamplingParams]],
    aborts: dict[int, int] | None = None,
) -> list[tuple[list[int], str | None, str]]:
    """Run to completion; per request: (token ids, finish reason, text)."""
    aborts = aborts or {}
    pending = sorted(enumerate(arrivals), key=lambda a: a[1][0])
    tokens: dict[str, list[int]] = {}
    texts: dict[str, str] = {}
    finish: dict[str, str | None] = {}
    states = {}
    step = 0
    while pending or eng.has_unfinished:
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, params) = pending.pop(0)
            (states[f"q{i}"],) = eng.add_request(f"q{i}", prompt, params)
            tokens[f"q{i}"], texts[f"q{i}"] = [], ""
        for i, at in aborts.items():
            rid = f"q{i}"
            if at == step and rid in tokens and rid not in finish:
                eng.abort(rid)
                # the engine's own verdict, not ours: the request must really be gone
                req = states[rid].request
                assert req.handle not in eng.core.scheduler.requests, f"{rid} still scheduled"
                finish[rid] = req.status.finish_reason
        for d in eng.step():
            rid = d.state.group_id
            assert rid not in finish, f"{rid} received output after it finished"
            tokens[rid] += d.token_ids
            texts[rid] += d.text
            if d.finished:
                finish[rid] = d.state.finish_reason
        step += 1
        assert step < 5000
    eng.shutdown()
    return [(tokens[f"q{i}"], finish[f"q{i}"], texts[f"q{i}"]) for i in range(len(arrivals))]


def prompts(n: int, seed: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def greedy(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def model(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


def staggered_workload(model: Path) -> list[tuple[int, list[int], SamplingParams]]:
    ps = prompts(7, seed=11)
    refs = [hf_greedy(model, p, 30) for p in ps]
    return [
        (0, ps[0], greedy(30)),
        (0, ps[1], greedy(1)),  # max_tokens = 1
        (2, ps[2], greedy(30, stop_token_ids=[refs[2][6]])),  # a stop token lands in flight
        (3, ps[3], greedy(12)),
        (5, ps[4], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[refs[4][3]])),
        (8, ps[5], greedy(20)),
        (9, ps[6], greedy(30)),  # aborted while in flight
    ]


@pytest.mark.parametrize("mode", ["async", pytest.param("async-process", marks=pytest.mark.slow)])
def test_staggered_async_equals_sync_equals_hf(model: Path, mode: str) -> None:
    work = staggered_workload(model)
    aborts = {6: 14}
    sync = drive(engine(model, "sync"), work, aborts)
    got = drive(engine(model, mode), work, aborts)
    for i, ((toks, reason, text), (stoks, sreason, stext)) in enumerate(
        zip(got, sync, strict=True)
    ):
        if i == 6:
            assert reason == sreason == "abort"
            ref = hf_greedy(model, work[i][1], 30)
            # cut short while running: some tokens, never all 30
            assert 0 < len(toks) < 30 and 0 < len(stoks) < 30, (len(toks), len(stoks))
            assert toks == ref[: len(toks)] and stoks == ref[: len(stoks)]
            continue
        assert (toks, reason, text) == (stoks, sreason, stext), f"request {i} differs"
        params = work[i][2]
        ref = hf_greedy(model, work[i][1], params.max_tokens)
        if params.stop_token_ids:
            ref = ref[: ref.index(params.stop_token_ids[0]) + 1]
            assert reason == "stop"
        assert toks == ref


def test_stop_strings_equal_across_modes(model: Path) -> None:
    ps = prompts(3, seed=12, lo=5, hi=20)
    eng = engine(model, "sync")
    base = drive(eng, [(0, p, greedy(24)) for p in ps])
    work, stops = [], []
    for p, (_, _, text) in zip(ps, base, strict=True):
        # a two-character stop string taken from the middle of the full output
        stop = next(
            (text[i : i + 2] for i in range(4, len(text) - 2) if text[i : i + 2].strip()), None
        )
        assert stop is not None, f"no stop string found in {text!r}"
        stops.append(stop)
        work.append((0, p, greedy(24, stop=[stop])))
    results = [drive(engine(model, m), work) for m in ("sync", "async")]
    assert results[0] == results[1]
    for (toks, reason, text), (full_toks, _, full), stop in zip(
        results[0], base, stops, strict=True
    ):
        assert reason == "stop"
        assert text == full[: full.index(stop)]
        assert len(toks) < len(full_toks) and toks == full_toks[: len(toks)]


@pytest.mark.parametrize("mode", [pytest.param("sync", marks=pytest.mark.slow), "async"])
def test_preemption_chunked_prefill_and_prefix_hits_in_flight(model: Path, mode: str) -> None:
    shared = prompts(1, seed=13, lo=24, hi=24)[0]
    ps = [shared + t for t in prompts(6, seed=14, lo=2, hi=10)]
    work = [(i, p, greedy(28)) for i, p in enumerate(ps)]
    eng = engine(
        model, mode, block_size=4, num_kv_blocks=48, max_model_len=64, max_num_batched_tokens=12
    )
    stats_engine = eng
    got = drive(eng, work)
    stats = stats_engine.stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_prefill_chunks"] > 0
    assert stats["prefix_cache_hits"] > 0
    assert stats["num_free_blocks"] == 48
    for (_, p, _), (toks, reason, _) in zip(work, got, strict=True):
        assert reason == "length" and toks == hf_greedy(model, p, 28)
