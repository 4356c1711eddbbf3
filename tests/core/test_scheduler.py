"""Scheduler / engine-core tests on the fake worker (no model, seconds)."""

from __future__ import annotations

import random

import pytest

from laneserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from laneserve.core.engine_core import EngineCore
from laneserve.core.request import Request
from laneserve.sampling_params import SamplingParams
from tests.fakes import FakeWorker, reference, wrong_drafter


def make_core(
    num_blocks: int = 256,
    *,
    async_scheduling: bool = True,
    budget: int = 64,
    max_num_seqs: int = 8,
    prefix: bool = True,
    spec: int = 0,
    **worker_kw: object,
) -> tuple[EngineCore, FakeWorker]:
    worker = FakeWorker(num_blocks, exact_plans=not async_scheduling, **worker_kw)
    cfg = EngineConfig(
        model=ModelConfig(model="fake"),
        cache=CacheConfig(block_size=worker.block_size, enable_prefix_caching=prefix),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            async_scheduling=async_scheduling,
        ),
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=spec)
        if spec
        else None,
    )
    return EngineCore(cfg, worker), worker


def drive(
    core: EngineCore,
    arrivals: list[tuple[int, list[int], SamplingParams]],
    check: bool = True,
) -> dict[str, list[int]]:
    """Add requests at their arrival step; run to completion; tokens per request."""
    pending = sorted(arrivals, key=lambda a: a[0])
    reqs: dict[str, Request] = {}
    got: dict[str, list[int]] = {}
    finished: set[str] = set()
    step = 0
    while pending or core.has_unfinished:
        while pending and pending[0][0] <= step:
            _, prompt, params = pending.pop(0)
            rid = f"r{len(reqs)}"
            reqs[rid] = core.add_request(rid, prompt, params, ())
            got[rid] = []
        for out in core.step():
            rid = out.request.request_id
            assert rid not in finished, f"{rid} received tokens after it finished"
            got[rid].extend(out.new_token_ids)
            if out.finished:
                finished.add(rid)
        if check:
            for r in reqs.values():
                assert r.num_output_placeholders >= 0
                assert r.num_computed_tokens >= 0
        step += 1
        assert step < 10_000, "engine did not finish"
    return got


def prompts(n: int, lo: int = 3, hi: int = 40, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_staggered_requests_match_reference(async_scheduling: bool) -> None:
    core, worker = make_core(async_scheduling=async_scheduling)
    free0 = core.kv.num_free_blocks
    ps = prompts(8)
    arrivals = [
        (i * 3, p, SamplingParams(temperature=0, max_tokens=5 + i)) for i, p in enumerate(ps)
    ]
    got = drive(core, arrivals)
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == reference(p, 5 + i)
    assert core.kv.num_free_blocks == free0, "KV blocks leaked"
    assert worker.max_in_flight == (2 if async_scheduling else 1)


def test_budget_and_max_num_seqs_respected() -> None:
    core, worker = make_core(budget=16, max_num_seqs=3)
    drive(core, [(0, p, SamplingParams(max_tokens=6)) for p in prompts(7)])
    for cmd in worker.commands:
        assert sum(s.num_tokens for s in cmd.scheduled) <= 16
        assert len(cmd.scheduled) <= 3


def test_chunked_prefill() -> None:
    core, _ = make_core(budget=8)
    p = prompts(1, 30, 30)[0]
    got = drive(core, [(0, p, SamplingParams(max_tokens=4))])
    assert got["r0"] == reference(p, 4)
    assert core.scheduler.stats.num_prefill_chunks >= 3


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_async_does_not_over_schedule(async_scheduling: bool) -> None:
    core, _ = make_core(async_scheduling=async_scheduling, prefix=False)
    ps = prompts(4)
    drive(core, [(0, p, SamplingParams(max_tokens=7, ignore_eos=True)) for p in ps])
    expected = sum(len(p) + 7 - 1 for p in ps)
    assert core.scheduler.stats.num_scheduled_tokens == expected


def test_prefix_cache_hits_second_run() -> None:
    core, _ = make_core(budget=256)
    shared = prompts(1, 24, 24, seed=5)[0]
    ps = [shared + q for q in prompts(4, 2, 9, seed=6)]
    first = drive(core, [(0, ps[0], SamplingParams(max_tokens=3))])
    assert core.kv.prefix_hits == 0
    rest = drive(core, [(0, p, SamplingParams(max_tokens=3)) for p in ps[1:]])
    assert core.kv.prefix_hits > 0
    assert first["r0"] == reference(ps[0], 3)
    for i, p in enumerate(ps[1:]):
        assert rest[f"r{i}"] == reference(p, 3)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_replays_prompt_and_outputs(async_scheduling: bool) -> None:
    core, _ = make_core(num_blocks=20, async_scheduling=async_scheduling, budget=32)
    free0 = core.kv.num_free_blocks
    ps = prompts(6, 6, 14, seed=3)
    got = drive(core, [(0, p, SamplingParams(max_tokens=20)) for p in ps])
    assert core.scheduler.stats.num_preemptions > 0
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == reference(p, 20)
    assert core.kv.num_free_blocks == free0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_in_flight_frees_everything(async_scheduling: bool) -> None:
    core, worker = make_core(async_scheduling=async_scheduling)
    free0 = core.kv.num_free_blocks
    ps = prompts(3)
    reqs = [
        core.add_request(f"a{i}", p, SamplingParams(max_tokens=50), ()) for i, p in enumerate(ps)
    ]
    got: dict[str, list[int]] = {r.request_id: [] for r in reqs}

    def collect(outs: list) -> None:
        for out in outs:
            got[out.request.request_id].extend(out.new_token_ids)

    for _ in range(4):
        collect(core.step())
    core.abort(reqs[1])
    before_abort = list(got["a1"])
    while core.has_unfinished:
        outs = core.step()
        assert all(out.request is not reqs[1] for out in outs), "aborted request produced output"
        collect(outs)
    assert got["a1"] == before_abort and 0 < len(before_abort) < 50
    assert got["a1"] == reference(ps[1], 50)[: len(before_abort)]
    # the survivors are untouched by their neighbour's abort
    assert got["a0"] == reference(ps[0], 50) and got["a2"] == reference(ps[2], 50)
    assert core.kv.num_free_blocks == free0
    assert reqs[1].handle in worker.released


def test_stop_token_in_flight_drops_the_extra_token() -> None:
    core, _ = make_core(async_scheduling=True)
    p = prompts(1, seed=11)[0]
    ref = reference(p, 30)
    stop_at = ref[5]
    got = drive(core, [(0, p, SamplingParams(max_tokens=30, stop_token_ids=[stop_at]))])
    assert got["r0"] == ref[: ref.index(stop_at) + 1]


def test_max_tokens_one() -> None:
    for mode in (False, True):
        core, _ = make_core(async_scheduling=mode)
        ps = prompts(3)
        got = drive(core, [(0, p, SamplingParams(max_tokens=1)) for p in ps])
        assert all(got[f"r{i}"] == reference(p, 1) for i, p in enumerate(ps))


def test_step_error_fails_only_that_steps_requests() -> None:
    """Step 2 fails: both requests in it end with the error; one that waited (max_num_seqs)
    and one that arrives later are served exactly."""
    core, worker = make_core(async_scheduling=False, fail_steps={2}, max_num_seqs=2)
    pa, pc, pd, pb = prompts(4, seed=1)
    a = core.add_request("a", pa, SamplingParams(max_tokens=10), ())
    c = core.add_request("c", pc, SamplingParams(max_tokens=10), ())
    d = core.add_request("d", pd, SamplingParams(max_tokens=4), ())  # waits for a slot
    got: dict[str, list[int]] = {"a": [], "b": [], "c": [], "d": []}
    for _ in range(3):
        for out in core.step():
            got[out.request.request_id].extend(out.new_token_ids)
    failing = worker.commands[2]
    assert failing.step_id == 2
    assert {s.handle for s in failing.scheduled} == {a.handle, c.handle}
    for r in (a, c):
        assert r.status.finish_reason == "error" and r.error == "injected failure"
    # what they produced before the failure was right
    assert got["a"] == reference(pa, 10)[: len(got["a"])] and got["a"]
    assert got["c"] == reference(pc, 10)[: len(got["c"])] and got["c"]
    assert d.status.finish_reason is None
    b = core.add_request("b", pb, SamplingParams(max_tokens=4), ())
    while core.has_unfinished:
        for out in core.step():
            got[out.request.request_id].extend(out.new_token_ids)
    assert d.status.finish_reason == "length" and got["d"] == reference(pd, 4)
    assert b.status.finish_reason == "length" and got["b"] == reference(pb, 4)
    assert core.kv.num_free_blocks == worker.ready.cache_groups[0].num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_speculation_full_acceptance(async_scheduling: bool) -> None:
    core, _ = make_core(async_scheduling=async_scheduling, spec=3)
    ps = prompts(3, seed=8)
    got = drive(core, [(0, p, SamplingParams(max_tokens=17, ignore_eos=True)) for p in ps])
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == reference(p, 17)
    st = core.scheduler.stats
    assert st.num_drafts > 0 and st.num_accepted == st.num_drafts


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_speculation_zero_acceptance(async_scheduling: bool) -> None:
    core, _ = make_core(async_scheduling=async_scheduling, spec=2, drafter=wrong_drafter)
    free0 = core.kv.num_free_blocks
    ps = prompts(3, seed=9)
    got = drive(core, [(0, p, SamplingParams(max_tokens=12)) for p in ps])
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == reference(p, 12)
    st = core.scheduler.stats
    assert st.num_drafts > 0 and st.num_accepted == 0
    assert core.kv.num_free_blocks == free0


def test_speculation_with_preemption_and_stop() -> None:
    core, _ = make_core(num_blocks=24, spec=2, budget=24)
    ps = prompts(5, 5, 12, seed=10)
    refs = [reference(p, 25) for p in ps]
    params = [SamplingParams(max_tokens=25, stop_token_ids=[r[9]]) for r in refs]
    got = drive(core, [(0, p, sp) for p, sp in zip(ps, params, strict=True)])
    st = core.scheduler.stats
    assert st.num_preemptions > 0
    # speculation was engaged (the perfect drafter: every draft accepted)
    assert st.num_drafts > 0 and st.num_accepted == st.num_drafts
    for i, r in enumerate(refs):
        assert got[f"r{i}"] == r[: r.index(r[9]) + 1]
