"""Draft-state slots and generation tags; release racing with a reused request id;
n-gram proposals; fewer drafts near max_model_len."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from laneserve.engine_args import EngineArgs
from laneserve.frontend.engine import LLMEngine
from laneserve.sampling_params import SamplingParams
from laneserve.spec_decode.ngram import propose_ngram
from laneserve.worker.input_batch import SlotTable
from laneserve.worker.model_runner import DeviceState, ModelRunner
from tests.core.test_scheduler import drive as drive_core
from tests.core.test_scheduler import make_core
from tests.tiny_models import hf_greedy


def test_slot_reuse_bumps_the_generation() -> None:
    slots = SlotTable()
    a = slots.acquire()
    assert slots.is_current(*a)
    assert slots.release(*a)
    assert not slots.is_current(*a)
    assert not slots.release(*a), "a stale release must not free the slot twice"
    b = slots.acquire()
    assert b[0] == a[0] and b[1] == a[1] + 1 and slots.is_current(*b)


@dataclass
class _Row:
    handle: int
    slot: int
    gen: int


@dataclass
class _Inputs:
    step_id: int
    rows: list


def test_generation_mismatch_rejects_a_stale_step() -> None:
    slots = SlotTable()
    slot, gen = slots.acquire()
    runner = ModelRunner.__new__(ModelRunner)  # only the slot check is exercised
    runner.slots = slots
    runner.state = DeviceState(torch.device("cpu"), 16, 1)
    slots.release(slot, gen)
    slots.acquire()  # the slot now belongs to another request
    out = runner.execute(_Inputs(7, [_Row(42, slot, gen)]))
    assert out.tokens is None and out.errors[0].handle == 42
    assert "stale step 7" in out.errors[0].message


def test_release_racing_with_a_new_request_of_the_same_id(tiny_models: dict[str, Path]) -> None:
    model = tiny_models["llama"]
    cfg = EngineArgs(model=str(model), dtype="float32", async_scheduling=True).create_config()
    eng = LLMEngine(cfg)
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    eng.add_request("same", [5, 6, 7], long)
    for _ in range(3):
        eng.step()
    eng.abort("same")  # the old request is still in flight on the lanes
    eng.add_request(
        "same", [9, 10, 11, 12], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    got = []
    while eng.has_unfinished:
        for d in eng.step():
            got += d.token_ids
    eng.shutdown()
    assert got == hf_greedy(model, [9, 10, 11, 12], 12)


def test_ngram_proposes_what_followed_the_latest_match() -> None:
    hist = torch.tensor(
        [[1, 2, 3, 9, 1, 2, 3, 8, 7, 1, 2, 3, 0, 0], [4, 5, 6, 7, 8, 0, 0, 0, 0, 0, 0, 0, 0, 0]]
    )
    lengths = torch.tensor([12, 5])
    drafts, num = propose_ngram(hist, lengths, k=3, n_min=1, n_max=3)
    # row 0: suffix [1,2,3] last seen at 4..6 -> proposes [8, 7, 1]; row 1: no repeat
    assert drafts[0].tolist() == [8, 7, 1] and num.tolist() == [3, 0]
    drafts, num = propose_ngram(hist, torch.tensor([8, 5]), k=3, n_min=1, n_max=3)
    # row 0 of length 8: suffix [..3, 8]; 8 never seen before; n=1 "8" none -> no draft
    assert num.tolist()[0] == 0


def test_fewer_drafts_near_max_model_len() -> None:
    core, worker = make_core(max_model_len=24, spec=4, budget=64)
    drive_core(core, [(0, list(range(1, 15)), SamplingParams(max_tokens=100, ignore_eos=True))])
    spec = [(s.start, s.num_spec) for c in worker.commands for s in c.scheduled if s.decode]
    assert spec, "no decode steps"
    for start, k in spec:
        assert start + 1 + k <= 24  # never schedules KV beyond max_model_len
    assert any(k < 4 for _, k in spec[1:]), "drafts were not reduced near the end"
