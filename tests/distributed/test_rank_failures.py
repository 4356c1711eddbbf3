"""A failure on one rank only (worker/rank_steps.py): a request rank 0 fails alone is
skipped by every rank and the others go on; a failure only one rank sees in a later
stage ends that rank, and the other rank follows instead of waiting in a collective.
Two gloo ranks on 127.0.0.1, both spawned (a failing rank ends its process)."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import pytest

from tests.distributed.rank_faults import MAX_TOKENS, PROMPTS, REJECTED, leader
from tests.tiny_models import hf_greedy

_HANG_S = 300  # far past a healthy run: a rank waiting in a collective would block here


def _run_leader(model: Path, follower: str, fault: str, tmp_path: Path) -> tuple[int, dict]:
    out = tmp_path / "out.json"
    p = mp.get_context("spawn").Process(target=leader, args=(str(model), follower, fault, str(out)))
    p.start()
    p.join(_HANG_S)
    if p.is_alive():
        p.kill()
        pytest.fail("rank 0 hung after a one-rank failure")
    return p.exitcode or 0, json.loads(out.read_text()) if out.exists() else {}


@pytest.mark.slow
def test_a_request_rank_0_fails_alone_is_skipped_by_every_rank(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    model = tiny_models["llama"]
    code, got = _run_leader(model, "plain", "reject", tmp_path)
    assert code == 0 and got.pop("followers_alive") is True
    assert got.pop(REJECTED) == "error"
    assert got == {r: hf_greedy(model, PROMPTS[r], MAX_TOKENS) for r in got}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("follower", "fault"),
    [("forward", "none"), ("plain", "forward"), ("reject", "none")],
    ids=["rank1-forward", "rank0-forward", "rank1-rejects"],
)
def test_a_failure_one_rank_sees_ends_both(
    tiny_models: dict[str, Path], tmp_path: Path, follower: str, fault: str
) -> None:
    """Rank 1's forward fails / rank 0's forward fails / rank 1 cannot register a
    request rank 0 took: the worker ends (exit 1) instead of running on out of step."""
    code, got = _run_leader(tiny_models["llama"], follower, fault, tmp_path)
    assert code == 1 and got == {}
