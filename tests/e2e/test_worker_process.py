"""The spawned worker process: faults fail requests fast, the engine restarts the
worker (or reports itself unhealthy), and --profile-dir traces are analyzable."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from laneserve.core.engine_core import EngineDeadError
from laneserve.engine_args import EngineArgs
from laneserve.frontend.engine import LLMEngine
from laneserve.obs.trace_analysis import step_spans, summarize
from laneserve.sampling_params import SamplingParams
from tests.tiny_models import hf_greedy

LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


def process_engine(model: Path, **kw: object) -> LLMEngine:
    args = EngineArgs(model=str(model), dtype="float32", worker_mode="process", **kw)
    return LLMEngine(args.create_config())


def kill_worker_while_decoding(eng: LLMEngine) -> tuple[list, int]:
    """Kill the worker mid-decode; run until every request ended. Returns the
    finished outputs and how many engine steps that took after the kill."""
    for i in range(3):
        eng.add_request(f"r{i}", [5 + i, 6, 7, 8], LONG)
    for _ in range(5):
        eng.step()
    os.kill(eng.client.process.pid, signal.SIGKILL)
    finished, steps = [], 0
    while eng.has_unfinished:
        finished += [d for d in eng.step() if d.finished]
        steps += 1
    return finished, steps


@pytest.mark.slow
def test_killed_worker_fails_in_flight_requests_then_restarts(tiny_models: dict[str, Path]) -> None:
    model = tiny_models["qwen2"]
    eng = process_engine(model)
    try:
        old_pid = eng.client.process.pid
        finished, steps = kill_worker_while_decoding(eng)
        # the results already sent come first (at most one per step in flight);
        # the first step that needs a result the dead worker never sent fails all
        assert len(finished) == 3 and steps <= eng.core.depth + 1
        for d in finished:
            assert d.state.finish_reason == "error"
            assert "worker process" in d.state.error and "died" in d.state.error
            assert len(d.state.token_ids) < 20  # far from LONG.max_tokens: it failed
        eng.add_request(
            "after", [9, 10, 11], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        )
        toks = []
        while eng.has_unfinished:
            for d in eng.step():
                toks += d.token_ids
        assert toks == hf_greedy(model, [9, 10, 11], 8)
        assert eng.client.process.pid != old_pid and eng.core.num_worker_restarts == 1
    finally:
        eng.shutdown()


def test_without_restart_the_engine_reports_unhealthy(tiny_models: dict[str, Path]) -> None:
    eng = process_engine(tiny_models["qwen2"], restart_worker=False)
    try:
        finished, _ = kill_worker_while_decoding(eng)
        assert all(d.state.finish_reason == "error" for d in finished)
        assert not eng.core.healthy
        with pytest.raises(EngineDeadError, match="not restarted"):
            eng.add_request("x", [1, 2, 3], SamplingParams())
    finally:
        eng.shutdown()


def test_bad_model_in_worker_process_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture"):
        process_engine(tmp_path)


@pytest.mark.parametrize("mode", ["thread", pytest.param("process", marks=pytest.mark.slow)])
def test_profile_dir_traces_and_analyzer(
    tiny_models: dict[str, Path], tmp_path: Path, mode: str
) -> None:
    args = EngineArgs(
        model=str(tiny_models["llama"]),
        dtype="float32",
        worker_mode=mode,
        profile_dir=str(tmp_path),
    )
    eng = LLMEngine(args.create_config())
    for i in range(4):
        eng.add_request(
            f"p{i}", [3 + i, 4, 5], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        )
    while eng.has_unfinished:
        eng.step()
    eng.shutdown()
    files = sorted(p.name for p in tmp_path.glob("trace-*.json"))
    assert any(f.startswith("trace-engine") for f in files) and any(
        f.startswith("trace-worker") for f in files
    )
    from laneserve.obs.trace_analysis import load_events

    events = load_events([tmp_path])
    names = {e["name"] for e in events}
    assert {"schedule", "command", "prepare", "device", "reclaim", "release", "detokenize"} <= names
    summary = summarize(step_spans(events))
    assert summary is not None and summary.num_pairs >= 10
    proc = subprocess.run(
        [sys.executable, "-m", "laneserve.entrypoints.cli", "profile", "analyze", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "summary:" in proc.stdout and "overlapped" in proc.stdout
    _check_merge(tmp_path, mode)


def _check_merge(trace_dir: Path, mode: str) -> None:
    """The merged file is one timeline: every span sits on a named thread of
    one role, in thread mode both roles share the pid, and analyze still reads it."""
    out = trace_dir / "merged.json"
    proc = subprocess.run(
        [sys.executable, "-m", "laneserve.entrypoints.cli", "profile", "merge", str(trace_dir), "-o", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    events = json.loads(out.read_text())["traceEvents"]
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"
    }
    spans = [e for e in events if e["ph"] == "X"]
    roles = {threads[(e["pid"], e["tid"])].split("/")[0] for e in spans}
    assert roles == {"engine", "worker"}
    worker_spans = {"command", "prepare", "device", "release", "reclaim"}
    for e in spans:
        role = threads[(e["pid"], e["tid"])].split("/")[0]
        assert role == ("worker" if e["name"] in worker_spans else "engine"), e
    pids = {e["pid"] for e in spans}
    assert len(pids) == (1 if mode == "thread" else 2)
    summary = summarize(step_spans(spans))
    assert summary is not None and summary.num_pairs >= 10


def test_analyzer_on_synthetic_trace(tmp_path: Path) -> None:
    def ev(name: str, ts: float, dur: float, step: int) -> dict:
        return {
            "name": name,
            "ph": "X",
            "ts": ts,
            "dur": dur,
            "pid": 1,
            "tid": 1,
            "args": {"step": step, "decode": True},
        }

    events = [
        ev("device", 0, 100, 0),
        ev("prepare", 50, 40, 1),  # done at 90 < 100: overlapped
        ev("device", 110, 100, 1),  # gap 10
        ev("prepare", 215, 20, 2),  # done at 235 > 210: not overlapped
        ev("device", 240, 100, 2),  # gap 30
    ]
    (tmp_path / "trace-x-1.json").write_text(json.dumps({"traceEvents": events}))
    from laneserve.obs.trace_analysis import load_events

    s = summarize(step_spans(load_events([tmp_path])))
    assert (
        s.num_pairs == 2 and s.overlapped == 1 and s.mean_gap_us == 20 and s.median_device_us == 100
    )


def test_merge_refuses_conflicting_thread_names(tmp_path: Path) -> None:
    """Two files that name one (pid, tid) differently cannot be one timeline."""
    from laneserve.obs.trace_merge import merge_traces

    for i, name in enumerate(["engine/schedule", "worker/device"]):
        meta = {"name": "thread_name", "ph": "M", "pid": 1, "tid": 7, "args": {"name": name}}
        (tmp_path / f"trace-r{i}-1.json").write_text(json.dumps({"traceEvents": [meta]}))
    with pytest.raises(ValueError, match="named both"):
        merge_traces([tmp_path])
