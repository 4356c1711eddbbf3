"""Data parallelism at the engine core: the router's choices and D cores behind one
interface, over fake workers (a real paged-KV check per rank, tests/fakes.py)."""

from __future__ import annotations

import pytest

from laneserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from laneserve.core.data_parallel import DataParallelCore
from laneserve.core.engine_core import EngineDeadError, WorkerDiedError
from laneserve.core.request import Request
from laneserve.core.router import AFFINITY_BOUND_TOKENS, RankView, Router, prompt_hashes
from laneserve.protocol import StepResult
from laneserve.sampling_params import SamplingParams
from tests.core.test_scheduler import prompts
from tests.fakes import FakeWorker, reference

BS = 4  # FakeWorker's block size


def make_dp(
    blocks: tuple[int, ...] = (256, 256), budget: int = 64, bound: int = AFFINITY_BOUND_TOKENS
) -> tuple[DataParallelCore, list[FakeWorker]]:
    workers = [FakeWorker(n, block_size=BS) for n in blocks]
    cfg = EngineConfig(
        model=ModelConfig(model="fake"),
        cache=CacheConfig(block_size=BS),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget),
    )
    return DataParallelCore(cfg, workers, router=Router(bound)), workers


def run(core: DataParallelCore, reqs: dict[str, Request] | None = None) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    for _ in range(10_000):
        if not core.has_unfinished:
            return got
        for out in core.step():
            got.setdefault(out.request.request_id, []).extend(out.new_token_ids)
    raise AssertionError("the engine did not finish")


def add(core: DataParallelCore, rid: str, prompt: list[int], max_tokens: int) -> Request:
    return core.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens), ())


def handles_seen(worker: FakeWorker) -> set[int]:
    return {s.handle for cmd in worker.commands for s in cmd.scheduled}


# -- the router alone ---------------------------------------------------------------
def test_router_least_pending_without_a_cached_prefix() -> None:
    r = Router()
    assert r.choose([RankView(0, 500, 0), RankView(1, 20, 0), RankView(2, 20, 0)]) == 1
    assert r.routed == [0, 1] and r.by_prefix == 0


def test_router_prefix_holder_wins_within_the_bound_only() -> None:
    r = Router(bound=100)
    assert r.choose([RankView(0, 0, 0), RankView(1, 100, 64)]) == 1  # 100 over: within
    assert r.choose([RankView(0, 0, 0), RankView(1, 101, 64)]) == 0  # 101 over: beyond
    assert r.choose([RankView(0, 0, 32), RankView(1, 50, 64)]) == 1  # the longer prefix
    assert r.by_prefix == 2
    with pytest.raises(ValueError, match="no rank"):
        r.choose([])


def test_prompt_hashes_are_the_cache_lookup_chain() -> None:
    core, _ = make_dp()
    p = prompts(1, 30, 30, seed=1)[0]
    req = add(core, "a", p, 1)
    kv = core.ranks[req.dp_rank].kv
    assert prompt_hashes(p, BS) == kv.block_hashes(req, len(p) - 1)


# -- D cores ------------------------------------------------------------------------
def test_two_ranks_match_the_reference_and_both_serve() -> None:
    core, workers = make_dp()
    ps = prompts(8, 3, 30, seed=2)
    reqs = {f"r{i}": add(core, f"r{i}", p, 12) for i, p in enumerate(ps)}
    got = run(core)
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == reference(p, 12)
    assert {r.dp_rank for r in reqs.values()} == {0, 1}
    assert all(handles_seen(w) for w in workers)
    assert len({r.handle for r in reqs.values()}) == len(reqs)  # engine-unique handles
    for r in reqs.values():  # each ran only on its own rank's worker
        assert r.handle in handles_seen(workers[r.dp_rank])
        assert r.handle not in handles_seen(workers[1 - r.dp_rank])


def test_shared_prefix_goes_to_the_rank_holding_it() -> None:
    core, _ = make_dp()
    shared = prompts(1, 40, 40, seed=5)[0]
    add(core, "other", prompts(1, 20, 20, seed=7)[0], 30)  # rank 0 (both empty)
    first = add(core, "first", [*shared, 1, 2], 3)  # rank 1: less pending
    assert first.dp_rank == 1
    run(core)
    holder = core.ranks[1].kv
    hits = holder.prefix_hits
    # rank 0 is idle, rank 1 too: no load difference, and only rank 1 holds the prefix
    later = [add(core, f"s{i}", [*shared, 9, i], 3) for i in range(3)]
    assert [r.dp_rank for r in later] == [1, 1, 1]
    got = run(core)
    assert holder.prefix_hits == hits + 3 * 40  # each found the 40 shared tokens
    assert core.ranks[0].kv.prefix_hits == 0 and core.router.by_prefix == 3
    for i, r in enumerate(later):
        assert got[r.request_id] == reference([*shared, 9, i], 3)


def test_skewed_load_beats_a_cached_prefix_beyond_the_bound() -> None:
    core, _ = make_dp(bound=50)
    shared = prompts(1, 40, 40, seed=5)[0]
    first = add(core, "first", [*shared, 1], 2)
    run(core)
    holder, other = first.dp_rank, 1 - first.dp_rank
    hashes = prompt_hashes([*shared, 2], BS)
    assert core.ranks[holder].kv.cached_prefix_tokens(hashes) == 40
    assert core.ranks[other].kv.cached_prefix_tokens(hashes) == 0
    # skew the load: 3 prompt + 37 output tokens pending on the holder (within the bound)
    core.ranks[holder].add_request("w", [1, 2, 3], SamplingParams(max_tokens=37), ())
    near = add(core, "near", [*shared, 2], 2)
    assert near.dp_rank == holder
    # now 40 + 42 + 2 = 84 pending tokens on the holder, 0 on the other: beyond 50
    far = add(core, "far", [*shared, 3], 2)
    assert far.dp_rank == other
    got = run(core)
    assert got["near"] == reference([*shared, 2], 2) and got["far"] == reference([*shared, 3], 2)
    assert core.ranks[other].kv.prefix_hits == 0


def test_preempted_request_resumes_on_its_rank() -> None:
    core, workers = make_dp(blocks=(14, 256), budget=32)
    ps = prompts(6, 6, 14, seed=3)
    reqs = [add(core, f"r{i}", p, 20) for i, p in enumerate(ps)]
    got = run(core)
    preempted = [r for r in reqs if r.num_preemptions]
    assert preempted and all(r.dp_rank == 0 for r in preempted)
    for r in preempted:
        assert r.handle in handles_seen(workers[0])
        assert r.handle not in handles_seen(workers[1])
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == reference(p, 20)


def test_abort_reaches_the_owning_rank() -> None:
    core, _ = make_dp()
    a = add(core, "a", [1, 2, 3], 50)
    b = add(core, "b", [4, 5, 6], 50)
    assert {a.dp_rank, b.dp_rank} == {0, 1}
    first = [t for out in core.step() if out.request is a for t in out.new_token_ids]
    core.abort(b)
    got = run(core)
    assert first + got["a"] == reference([1, 2, 3], 50) and b.status.finish_reason == "abort"
    assert not core.ranks[b.dp_rank].has_unfinished


class DyingWorker(FakeWorker):
    """A fake worker process that dies at its `die_at`-th result."""

    def __init__(self, die_at: int) -> None:
        super().__init__(256, block_size=BS)
        self.die_at, self.results = die_at, 0
        self.alive = True

    def get_result(self) -> StepResult:
        self.results += 1
        if self.results >= self.die_at:
            self.alive = False
            raise WorkerDiedError("the worker process 1234 died (exit code -9)")
        return super().get_result()

    def death_message(self) -> str:
        return "the worker process 1234 died (exit code -9)"

    def restart(self) -> None:
        FakeWorker.__init__(self, 256, block_size=BS)
        self.alive, self.die_at = True, 10**9


def test_a_dead_rank_fails_its_requests_only_and_restarts() -> None:
    workers = [FakeWorker(256, block_size=BS), DyingWorker(die_at=4)]
    cfg = EngineConfig(model=ModelConfig(model="fake"), cache=CacheConfig(block_size=BS))
    core = DataParallelCore(cfg, workers)
    reqs = [add(core, f"r{i}", [7 + i, 8, 9], 30) for i in range(4)]
    assert [r.dp_rank for r in reqs] == [0, 1, 0, 1]
    got = run(core)
    for r in reqs:
        if r.dp_rank == 0:
            assert got[r.request_id] == reference(r.prompt_token_ids, 30)
        else:
            assert r.status.finish_reason == "error" and "died" in (r.error or "")
            assert len(got.get(r.request_id, [])) < 30
    # rank 0's work went on after the death, so the next step restarted rank 1
    assert core.num_worker_restarts == 1 and core.ranks[0].num_worker_restarts == 0
    assert core.healthy and not core.restart_pending
    late = [add(core, f"l{i}", [3, 4, i], 5) for i in range(2)]
    got = run(core)
    assert {r.dp_rank for r in late} == {0, 1}
    for r in late:
        assert got[r.request_id] == reference(r.prompt_token_ids, 5)


def test_a_rank_that_cannot_serve_takes_no_requests() -> None:
    core, _ = make_dp()
    core.ranks[1].healthy = False  # as after a death with --no-restart-worker
    assert not core.healthy
    assert {add(core, f"x{i}", [1, 2, i], 2).dp_rank for i in range(3)} == {0}
    core.ranks[0].healthy = False
    with pytest.raises(EngineDeadError, match="every rank"):
        add(core, "y", [1, 2], 2)


def test_prompt_logprobs_request_is_routed_by_load_alone() -> None:
    """It computes every prompt position (no prefix hit), so the holder of its prefix
    has nothing to offer it: the least loaded rank (lowest index on a tie) takes it."""
    core, _ = make_dp()
    shared = prompts(1, 40, 40, seed=5)[0]
    add(core, "other", prompts(1, 20, 20, seed=7)[0], 30)  # rank 0
    assert add(core, "first", [*shared, 1, 2], 3).dp_rank == 1
    run(core)
    logprobs = SamplingParams(max_tokens=2, prompt_logprobs=1)
    assert core.add_request("lp", [*shared, 5], logprobs, ()).dp_rank == 0
    assert add(core, "plain", [*shared, 6], 2).dp_rank == 1  # the holder, for comparison
