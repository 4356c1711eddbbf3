"""Traces of a tensor-parallel worker: one file per rank, each rank's summary and the
critical rank (the largest host gap of each shared decode step pair) in `profile analyze`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from laneserve.obs.profiling import TP_ROLE, Tracer
from laneserve.obs.trace_analysis import critical_by_step, load_processes, report, step_spans
from laneserve.obs.trace_merge import merge_traces


def _write(tmp: Path, role: str, rank: int, gaps_us: list[float]) -> None:
    """A rank's trace: decode steps 0..len(gaps) with the given host gaps between them."""
    tracer = Tracer(tmp, role=role, rank=rank)
    t = 1_000_000.0 * (rank + 1)  # another clock per rank: only gaps may be compared
    for step, gap in enumerate([0.0, *gaps_us]):
        t += gap
        start = int(t * 1000)
        args = {"step": step, "decode": True}
        tracer.add("device", "device", start, start + 1_000_000, args)
        t += 1000.0
    tracer.flush()


def _per_process(tmp: Path) -> dict:
    return {n: step_spans(ev) for n, ev in load_processes([tmp]).items()}


def test_the_critical_rank_is_the_one_with_the_largest_gap(tmp_path: Path) -> None:
    _write(tmp_path, TP_ROLE, 0, [100, 100, 500, 100])
    _write(tmp_path, TP_ROLE, 1, [300, 400, 200, 300])
    per = _per_process(tmp_path)
    assert sorted(re.sub(r" \(.*", "", n) for n in per) == [
        f"{TP_ROLE} rank 0",
        f"{TP_ROLE} rank 1",
    ]
    c = critical_by_step(per)
    assert c is not None and c.num_pairs == 4
    by_rank = {re.sub(r" \(.*", "", n): k for n, k in c.times_critical.items()}
    assert by_rank == {f"{TP_ROLE} rank 0": 1, f"{TP_ROLE} rank 1": 3}
    assert c.mean_gap_us == pytest.approx((300 + 400 + 500 + 300) / 4)
    text = report([tmp_path])
    assert text.count("summary: 4 decode step pairs") == 2
    assert "largest host gap of each of 4 shared decode step pairs" in text
    assert "its gap mean 375 us" in text


def test_only_shared_step_pairs_count(tmp_path: Path) -> None:
    _write(tmp_path, TP_ROLE, 0, [100, 100])
    _write(tmp_path, TP_ROLE, 1, [50])
    c = critical_by_step(_per_process(tmp_path))
    assert c is not None and c.num_pairs == 1 and sorted(c.times_critical.values()) == [0, 1]


def test_data_parallel_ranks_are_not_compared_step_by_step(tmp_path: Path) -> None:
    """Data-parallel ranks number their own steps: the same step id is unrelated work."""
    _write(tmp_path, "worker", 0, [100, 100, 100])
    _write(tmp_path, "worker", 1, [900, 900, 900])
    text = report([tmp_path])
    assert "shared decode step pairs" not in text
    assert re.search(r"critical: worker rank 1 ", text), text


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
    names = sorted(re.sub(r"-\d+\.json$", "", p.name) for p in tmp_path.glob("trace-worker*"))
    assert names == [f"trace-{TP_ROLE}-r0", f"trace-{TP_ROLE}-r1"], names
    c = critical_by_step(_per_process(tmp_path))
    assert c is not None and c.num_pairs >= 10 and sum(c.times_critical.values()) == c.num_pairs
    out = subprocess.run(
        [sys.executable, "-m", "laneserve.entrypoints.cli", "profile", "analyze", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "shared decode step pairs" in out.stdout, out.stdout
    merged = merge_traces([tmp_path])["traceEvents"]
    processes = {e["args"]["name"] for e in merged if e.get("name") == "process_name"}
    assert {f"{TP_ROLE} rank 0", f"{TP_ROLE} rank 1"} <= processes, processes
