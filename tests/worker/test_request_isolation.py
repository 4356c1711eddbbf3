"""A real worker (tiny model) given steps in which one request is wrong: a field
that does not decode, a grammar the engine cannot follow, a grammar that panics
while compiling. Only that request fails; the other requests of the step and
of the next (pipelined) step get exactly transformers' greedy tokens."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest

from laneserve import protocol
from laneserve.engine_args import EngineArgs
from laneserve.protocol import NewRequest, ScheduledRequest, StepCommand, StepResult
from laneserve.sampling_params import SamplingParams
from laneserve.structured import limits, matchers
from laneserve.structured.params import StructuredOutputsParams
from laneserve.worker.worker import Worker
from tests.tiny_models import hf_greedy
from tests.worker.test_worker_failures import run_lanes, run_sync

PROMPTS = {1: [5, 6, 7, 8], 2: [9, 10, 11], 3: [12, 13, 14], 4: [15, 16, 17, 18], 5: [19, 20]}


def new(handle: int, structured: StructuredOutputsParams | None = None) -> NewRequest:
    params = SamplingParams(temperature=0, structured_outputs=structured)
    return NewRequest(handle, f"r{handle}", PROMPTS[handle], params)


def prefill(handle: int) -> ScheduledRequest:
    return ScheduledRequest(handle, len(PROMPTS[handle]), 0, new_block_ids=[[handle]])


def decode(handle: int) -> ScheduledRequest:
    return ScheduledRequest(handle, 1, len(PROMPTS[handle]), decode=True)


def mistyped(cmd: StepCommand, handle: int) -> bytes:
    """`cmd` encoded, with request `handle`'s json_object set to a string (a field
    the server would have refused: here it reaches the worker anyway)."""
    raw = msgspec.msgpack.decode(protocol.encode(cmd))
    for entry in raw[2]:
        if entry[0] == handle:
            entry[3]["structured_outputs"]["json_object"] = "x"
    return msgspec.msgpack.encode(raw)


@pytest.mark.parametrize("run", [run_sync, run_lanes], ids=["run_step", "lanes"])
def test_one_wrong_request_fails_alone(
    tiny_models: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    run: Callable[[Worker, list], Iterator[StepResult]],
) -> None:
    model = tiny_models["llama"]
    args = EngineArgs(model=str(model), dtype="float32", num_kv_blocks=16, max_model_len=64)
    worker = Worker(args.create_config())
    # a constraint over the host's limits (the host would refuse it): the worker's
    # grammar engine runs out of its lexer fuel at the first token
    monkeypatch.setattr(limits, "MAX_REPEAT", 10**7)
    monkeypatch.setattr(limits, "MAX_REGEX_EXPANSION", 10**7)
    too_big = StructuredOutputsParams(regex="a{1000000}")
    panics = StructuredOutputsParams(regex="b+")
    real = matchers.LLMatcher

    def panicking(tokenizer: object, text: str, **kw: object) -> object:
        if "b+" in text:
            raise BaseException("injected panic in the grammar engine")  # as pyo3's are
        return real(tokenizer, text, **kw)

    monkeypatch.setattr(matchers, "LLMatcher", panicking)
    json_object = StructuredOutputsParams(json_object=True)
    step0 = StepCommand(
        0,
        [prefill(h) for h in (1, 2, 3, 4, 5)],
        [new(1), new(2, json_object), new(3, too_big), new(4), new(5, panics)],
    )
    step1 = StepCommand(1, [decode(h) for h in (1, 2, 4, 5)])
    results = list(run(worker, [mistyped(step0, 2), step1]))
    assert [r.step_id for r in results] == [0, 1]
    errors0 = {e.handle: e.message for e in results[0].errors}
    assert set(errors0) == {2, 3, 5}, errors0
    assert "could not be read" in errors0[2] and "json_object" in errors0[2]
    assert "could not follow the constraint" in errors0[3]
    assert "injected panic" in errors0[5]
    errors1 = {e.handle: e.message for e in results[1].errors}
    assert set(errors1) == {2, 5} and all("not known" in m for m in errors1.values())
    tokens: dict[int, list[int]] = {1: [], 4: []}
    for r in results:
        assert {o.handle for o in r.outputs} == {1, 4}
        for o in r.outputs:
            tokens[o.handle] += o.token_ids
    for h in (1, 4):
        assert tokens[h] == hf_greedy(model, PROMPTS[h], 2), h
