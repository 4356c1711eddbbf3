"""Traces of a tensor-parallel worker: one file per rank, each rank's summary and the
critical rank (the largest host gap of each decode step pair) in `profile analyze`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from laneserve.obs.profiling import Tracer, worker_role
from laneserve.obs.trace_analysis import critical_rank, rank_events, rank_of, report, step_spans
from laneserve.obs.trace_merge import merge_traces


def test_roles_name_their_rank() -> None:
    assert [worker_role(r) for r in (0, 1, 7)] == ["worker", "worker-rank1", "worker-rank7"]
    assert [rank_of(worker_role(r)) for r in (0, 1, 7)] == [0, 1, 7]
    assert rank_of("engine") is None and rank_of("worker-rankx") is None


def _write_rank(tmp: Path, rank: int, gaps_us: list[float], device_us: float = 1000.0) -> None:
    """A rank's trace: decode steps 0..len(gaps) with the given host gaps between them."""
    tracer = Tracer(tmp, role=worker_role(rank))
    t = 1_000_000.0 * (rank + 1)  # another clock per rank: gaps must not compare starts
    for step, gap in enumerate([0.0, *gaps_us]):
        t += gap
        start = int(t * 1000)
        tracer.add(
            "device", "device", start, start + int(device_us * 1000), {"step": step, "decode": True}
        )
        t += device_us
    tracer.flush()


def test_the_critical_rank_is_the_one_with_the_largest_gap(tmp_path: Path) -> None:
    _write_rank(tmp_path, 0, [100, 100, 500, 100])
    _write_rank(tmp_path, 1, [300, 400, 200, 300])
    per_rank = {r: step_spans(ev) for r, ev in rank_events([tmp_path]).items()}
    assert sorted(per_rank) == [0, 1]
    c = critical_rank(per_rank)
    assert c is not None and c.num_pairs == 4
    assert c.times_critical == {0: 1, 1: 3}
    assert c.mean_gap_us == pytest.approx((300 + 400 + 500 + 300) / 4)
    text = report([tmp_path])
    assert "rank 0: 4 decode step pairs" in text and "rank 1: 4 decode step pairs" in text
    assert "rank 0 in 1, rank 1 in 3" in text and "its gap mean 375 us" in text


def test_only_common_step_pairs_count(tmp_path: Path) -> None:
    _write_rank(tmp_path, 0, [100, 100])
    _write_rank(tmp_path, 1, [50])
    c = critical_rank({r: step_spans(ev) for r, ev in rank_events([tmp_path]).items()})
    assert c is not None and c.num_pairs == 1 and c.times_critical == {0: 1, 1: 0}


def test_one_rank_keeps_the_single_report(tmp_path: Path) -> None:
    _write_rank(tmp_path, 0, [100, 200])
    text = report([tmp_path])
    assert text.startswith("step  device_ms") and "summary: 2 decode step pairs" in text
    assert "critical rank" not in text


@pytest.mark.slow  # two rank processes
def test_two_ranks_write_a_trace_each(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    from laneserve import LLM, SamplingParams

    llm = LLM(
        str(tiny_models["llama"]),
        dtype="float32",
        tensor_parallel_size=2,
        worker_mode="process",
        profile_dir=str(tmp_path),
    )
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm.generate([[3, 4, 5], [6, 7, 8, 9]], params, use_tqdm=False)
    llm.shutdown()
    names = sorted(p.name for p in tmp_path.glob("trace-*.json"))
    assert any(n.startswith("trace-worker-rank1-") for n in names), names
    assert sum(n.startswith("trace-worker-") and "rank" not in n for n in names) == 1, names
    per_rank = {r: step_spans(ev) for r, ev in rank_events([tmp_path]).items()}
    assert sorted(per_rank) == [0, 1]
    c = critical_rank(per_rank)
    assert c is not None and c.num_pairs >= 10 and sum(c.times_critical.values()) == c.num_pairs
    out = subprocess.run(
        [sys.executable, "-m", "laneserve.entrypoints.cli", "profile", "analyze", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "rank 1:" in out.stdout and "critical rank" in out.stdout
    merged = merge_traces([tmp_path])["traceEvents"]
    processes = {e["args"]["name"] for e in merged if e.get("name") == "process_name"}
    assert {"worker", "worker-rank1"} <= processes, processes
    assert json.dumps(merged)
