"""`--profile-dir` with `data_parallel_size` 2: each rank's worker writes its own trace
(named by rank, in either worker mode), and `laneserve profile analyze` pairs steps within
each rank (each numbers its own steps), reports each rank's host gap and names the
critical rank."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from laneserve.engine_args import EngineArgs
from laneserve.frontend.engine import LLMEngine
from laneserve.obs.trace_analysis import load_processes, report, step_spans, summarize
from laneserve.obs.trace_merge import write_merged
from laneserve.sampling_params import SamplingParams


def profile(model: Path, out: Path, mode: str) -> None:
    args = EngineArgs(
        model=str(model), dtype="float32", worker_mode=mode, profile_dir=str(out),
        data_parallel_size=2,
    )  # fmt: skip
    eng = LLMEngine(args.create_config())
    try:
        for i in range(4):
            params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
            eng.add_request(f"p{i}", [3 + i, 4, 5], params)
        while eng.has_unfinished:
            eng.step()
    finally:
        eng.shutdown()


@pytest.mark.slow  # two workers per mode, traced
@pytest.mark.parametrize("mode", ["process", "thread"])
def test_each_rank_traced_and_analyzed_apart(
    tiny_models: dict[str, Path], tmp_path: Path, mode: str
) -> None:
    profile(tiny_models["llama"], tmp_path, mode)
    workers = sorted(p.name for p in tmp_path.glob("trace-worker-*.json"))
    assert [re.sub(r"-\d+\.json$", "", f) for f in workers] == [
        "trace-worker-r0",
        "trace-worker-r1",
    ]
    processes = load_processes([tmp_path])
    assert len(processes) == 2 and all("worker rank" in name for name in processes)
    text = report([tmp_path])
    for name, events in processes.items():
        alone = summarize(step_spans(events))  # this rank's steps only
        assert alone is not None and alone.num_pairs >= 10
        section = text.split(f"== {name}\n")[1].split("\n== ")[0]
        assert f"summary: {alone.num_pairs} decode step pairs" in section
    assert text.count("summary:") == 2
    critical = re.search(r"critical: (worker rank \d)", text)
    assert critical is not None and critical.group(1) in " ".join(processes)
    if mode == "process":  # the merged file keeps the ranks apart by pid
        merged = write_merged([tmp_path], tmp_path / "merged.json")
        assert len(load_processes([merged])) == 2
