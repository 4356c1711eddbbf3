"""Draft-state slots and generation tags; release racing with a reused request id;
n-gram proposals; fewer drafts near max_model_len."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from laneserve.engine_args import EngineArgs
from laneserve.frontend.engine import LLMEngine
from laneserve.kernels import CpuKernels, TorchKernels, load_kernels
from laneserve.sampling_params import SamplingParams
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


def _kernel_sets() -> list[object]:
    lib = load_kernels()
    return [TorchKernels()] + ([CpuKernels(lib)] if lib is not None else [])


@pytest.mark.parametrize("kernels", _kernel_sets(), ids=lambda k: k.name)
def test_ngram_proposes_what_followed_the_latest_match(kernels: object) -> None:
    hist = torch.tensor(
        [[1, 2, 3, 9, 1, 2, 3, 8, 7, 1, 2, 3, 0, 0], [4, 5, 6, 7, 8, 0, 0, 0, 0, 0, 0, 0, 0, 0]]
    )
    rows = torch.tensor([0, 1])
    drafts, num = kernels.ngram_lookup(hist, torch.tensor([12, 5]), rows, 14, 3, 1, 3)
    # row 0: suffix [1,2,3] last seen at 4..6 -> proposes [8, 7, 1]; row 1: no repeat
    assert drafts[0].tolist() == [8, 7, 1] and num.tolist() == [3, 0]
    drafts, num = kernels.ngram_lookup(hist, torch.tensor([8, 5]), rows, 14, 3, 1, 3)
    # row 0 of length 8: suffix [..3, 8]; 8 never seen before; n=1 "8" none -> no draft
    assert num.tolist()[0] == 0
    # [6, 5, 5]: the latest earlier "5" ends right before the suffix; one token follows it
    short = torch.tensor([[6, 5, 5, 0]])
    drafts, num = kernels.ngram_lookup(short, torch.tensor([3]), rows[:1], 4, 3, 1, 2)
    assert num.tolist() == [1] and drafts[0, 0].item() == 5


def _lookup_reference(seq: list[int], k: int, n_min: int, n_max: int) -> tuple[list[int], int]:
    for n in range(n_max, n_min - 1, -1):
        for s in range(len(seq) - n - 1, -1, -1):
            if len(seq) >= n + 1 and seq[s : s + n] == seq[len(seq) - n :]:
                follow = seq[s + n : s + n + k]
                return follow, len(follow)
    return [], 0


def test_ngram_lookup_kernels_agree_with_a_plain_search() -> None:
    """Random short-alphabet histories (many matches, of every n): both kernel sets give
    what a plain Python search gives, through a slot indirection and a width bound."""
    g = torch.Generator().manual_seed(0)
    sets = _kernel_sets()
    for trial in range(60):
        slots_total, width = 7, 40
        hist = torch.randint(0, 4 if trial % 2 else 9, (slots_total, 48), generator=g)
        committed = torch.randint(0, width + 1, (slots_total,), generator=g)
        slots = torch.randperm(slots_total, generator=g)[:5]
        k, n_min = 1 + trial % 4, 1 + trial % 3
        n_max = n_min + trial % 3
        got = [kern.ngram_lookup(hist, committed, slots, width, k, n_min, n_max) for kern in sets]
        for r, slot in enumerate(slots.tolist()):
            seq = hist[slot, : int(committed[slot])].tolist()
            follow, num = _lookup_reference(seq, k, n_min, n_max)
            for drafts, nums in got:
                assert int(nums[r]) == num, (trial, r)
                assert drafts[r, :num].tolist() == follow, (trial, r)
        assert torch.equal(got[0][0], got[-1][0]) and torch.equal(got[0][1], got[-1][1])


def _top_reference(row: list[float], n: int) -> list[int]:
    """Best first: NaN highest, then larger values, ties to the lower column."""
    key = [(0 if v != v else 1, -v if v == v else 0.0, j) for j, v in enumerate(row)]
    return [j for _, _, j in sorted(key)[:n]]


def test_top_tokens_kernels_agree_with_a_plain_sort() -> None:
    """Ties (few distinct values), NaNs and a vocabulary map, for n = 1 (the draft) and
    n > 1 (a token tree's candidates): the C++ op gives the plain sort's order; the torch
    composite the same values in the same order (its ties follow torch.topk for n > 1)."""
    g = torch.Generator().manual_seed(0)
    sets = _kernel_sets()
    for trial in range(40):
        rows, cols = 1 + trial % 3, 5 + 7 * (trial % 5)
        logits = torch.randint(-3, 3, (rows, cols), generator=g).float() / 2
        if trial % 4 == 3:
            logits[0, cols // 2] = float("nan")
        vocab = torch.randperm(1000, generator=g)[:cols] if trial % 2 else None
        for n in (1, 2, min(3, cols), cols):
            want = torch.tensor([_top_reference(r, n) for r in logits.tolist()])
            if vocab is not None:
                want = vocab[want]
            for kern in sets:
                got = kern.top_tokens(logits, n, vocab)
                if kern.name == "cpu" or n == 1:
                    assert torch.equal(got, want), (trial, n, kern.name)
                cols = got if vocab is None else _columns(vocab, got)
                values = logits.gather(1, cols)
                ref = logits.gather(1, want if vocab is None else _columns(vocab, want))
                assert torch.equal(values.nan_to_num(9), ref.nan_to_num(9)), (trial, n)
    for kern in sets:
        with pytest.raises((ValueError, RuntimeError), match="outside"):
            kern.top_tokens(torch.zeros(2, 4), 5)


def _columns(vocab: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Token ids back to draft-vocabulary columns."""
    index = {int(t): j for j, t in enumerate(vocab)}
    return torch.tensor([[index[int(t)] for t in row] for row in tokens])


@pytest.mark.parametrize("kernels", _kernel_sets(), ids=lambda k: k.name)
def test_write_drafts_prefers_the_lookup_and_keeps_candidates_distinct(kernels: object) -> None:
    drafts, num_drafts = torch.full((5, 3), -1), torch.full((5,), -1)
    side = torch.full((5, 2), -1)
    slots = torch.tensor([3, 0, 4])
    chain = torch.tensor([[5, 50], [6, 60], [7, 70]])
    top = torch.tensor([[5, 7, 9], [6, 7, 9], [7, 3, 5]])  # the head's best first tokens
    found = torch.tensor([[7, 71], [0, 0], [3, 31]])
    num = torch.tensor([1, 0, 2])  # rows 0 and 2: the lookup found drafts
    kernels.write_drafts(drafts, num_drafts, side, slots, chain, top, found, num)
    assert drafts[[3, 0, 4]].tolist() == [[7, 71, -1], [6, 60, -1], [3, 31, -1]]
    assert num_drafts.tolist() == [2, -1, -1, 1, 2]
    # alternatives: the head's best tokens other than the row's first draft
    assert side[[3, 0, 4]].tolist() == [[5, 9], [7, 9], [7, 5]]
    assert drafts[[1, 2]].eq(-1).all() and side[[1, 2]].eq(-1).all()  # other slots untouched
    kernels.write_drafts(drafts, num_drafts, side, slots[:2], chain[:2, :1])  # head only
    assert drafts[[3, 0], :1].tolist() == [[5], [6]] and num_drafts[[3, 0]].tolist() == [1, 1]
    with pytest.raises((ValueError, RuntimeError), match="together"):
        kernels.write_drafts(drafts, num_drafts, side, slots, chain, None, found, None)


def test_fewer_drafts_near_max_model_len() -> None:
    core, worker = make_core(max_model_len=24, spec=4, budget=64)
    drive_core(core, [(0, list(range(1, 15)), SamplingParams(max_tokens=100, ignore_eos=True))])
    spec = [(s.start, s.num_spec) for c in worker.commands for s in c.scheduled if s.decode]
    assert spec, "no decode steps"
    for start, k in spec:
        assert start + 1 + k <= 24  # never schedules KV beyond max_model_len
    assert any(k < 4 for _, k in spec[1:]), "drafts were not reduced near the end"
