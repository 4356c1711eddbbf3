"""A real worker (tiny model) whose steps fail in each stage, driven through
both paths that share the failure handling: `run_step` (synchronous) and the
lanes. Each failed step answers exactly its requests with the stage's error,
still releases what it was told to release, and the worker keeps serving."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from laneserve.engine_args import EngineArgs
from laneserve.protocol import NewRequest, ScheduledRequest, StepCommand, StepResult
from laneserve.sampling_params import SamplingParams
from laneserve.worker.lanes import Lanes
from laneserve.worker.worker import Worker
from tests.tiny_models import hf_greedy

PROMPTS = {1: [5, 6, 7, 8], 2: [9, 10, 11], 3: [12, 13, 14, 15, 16]}
FAIL_EXECUTE = {1, 2}


def prefill(handle: int, block: int) -> tuple[NewRequest, ScheduledRequest]:
    prompt = PROMPTS[handle]
    new = NewRequest(handle, f"r{handle}", prompt, SamplingParams(temperature=0))
    return new, ScheduledRequest(handle, len(prompt), 0, new_block_ids=[[block]])


def decode(handle: int) -> ScheduledRequest:
    return ScheduledRequest(handle, 1, len(PROMPTS[handle]), decode=True)


def script() -> list[StepCommand | bytes]:
    (n1, s1), (n2, s2), (n3, s3) = prefill(1, 0), prefill(2, 1), prefill(3, 2)
    return [
        StepCommand(0, [s1, s2], [n1, n2]),
        StepCommand(1, [decode(1), decode(2)]),  # its device step fails
        StepCommand(2, [decode(1)], finished=[2]),  # fails, and releases request 2
        StepCommand(3, [ScheduledRequest(99, 1, 4, decode=True)], finished=[1]),  # unknown
        b"\xc1 not msgpack",
        StepCommand(5, [s3], [n3]),  # the worker still serves
    ]


@pytest.fixture(scope="module")
def model(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


def failing_worker(model: Path) -> Worker:
    args = EngineArgs(model=str(model), dtype="float32", num_kv_blocks=8, max_model_len=64)
    worker = Worker(args.create_config())
    execute = worker.runner.execute

    def failing_execute(inp: object) -> object:
        if inp.step_id in FAIL_EXECUTE:
            raise RuntimeError(f"injected failure in step {inp.step_id}")
        return execute(inp)

    worker.runner.execute = failing_execute
    register = worker.table.register
    worker.registered = {}  # handle -> (slot, gen) it was given

    def recording_register(new: NewRequest) -> object:
        req = register(new)
        worker.registered[new.handle] = (req.slot, req.gen)
        return req

    worker.table.register = recording_register
    return worker


def run_sync(worker: Worker, items: list) -> Iterator[StepResult]:
    for item in items:
        yield worker.run_step(item)


def run_lanes(worker: Worker, items: list) -> Iterator[StepResult]:
    results: queue.SimpleQueue = queue.SimpleQueue()
    lanes = Lanes(lambda: worker, results.put)
    try:
        for item in items:  # all at once: later steps are prepared while earlier ones fail
            lanes.submit(item)
        for _ in items:
            yield results.get(timeout=120)
    finally:
        lanes.close()


@pytest.mark.parametrize("run", [run_sync, run_lanes], ids=["run_step", "lanes"])
def test_each_failed_stage_fails_its_requests_and_still_releases(
    model: Path, run: Callable[[Worker, list], Iterator[StepResult]]
) -> None:
    worker = failing_worker(model)
    results = list(run(worker, script()))
    assert [r.step_id for r in results] == [0, 1, 2, 3, -1, 5]

    def errors(i: int) -> list[tuple[int, str]]:
        assert not results[i].outputs
        return [(e.handle, e.message) for e in results[i].errors]

    assert {o.handle for o in results[0].outputs} == {1, 2} and not results[0].errors
    assert errors(1) == [(h, "step failed: injected failure in step 1") for h in (1, 2)]
    assert errors(2) == [(1, "step failed: injected failure in step 2")]
    [(handle, message)] = errors(3)
    # NOTE: a handle the worker does not know fails alone (the step itself runs)
    assert handle == 99 and "not known to the worker" in message
    assert errors(4) == []
    # the failed steps 2 and 3 still released requests 2 and 1
    slots, registered = worker.table.slots, worker.registered
    assert not slots.is_current(*registered[2]) and not slots.is_current(*registered[1])
    assert 1 not in worker.table.requests and 2 not in worker.table.requests
    [out] = results[5].outputs
    assert out.handle == 3 and out.token_ids == hf_greedy(model, PROMPTS[3], 1)
