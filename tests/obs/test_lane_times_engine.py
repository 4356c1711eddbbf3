"""Lane spans on a real engine (tiny model, in-process worker): with `lane_times` on,
every step's spans reach the engine's LaneLog and equal the trace's events, and the
tokens are those of a run with it off (which sends no spans at all)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from laneserve.engine_args import EngineArgs
from laneserve.frontend.engine import LLMEngine
from laneserve.sampling_params import SamplingParams


def _run(model: Path, lane_times: bool, async_scheduling: bool, profile_dir: Path | None):
    cfg = EngineArgs(
        model=str(model),
        dtype="float32",
        worker_mode="thread",
        async_scheduling=async_scheduling,
        profile_dir=str(profile_dir) if profile_dir else None,
    ).create_config()
    cfg = msgspec.structs.replace(
        cfg, worker=msgspec.structs.replace(cfg.worker, lane_times=lane_times)
    )
    eng = LLMEngine(cfg)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i in range(3):
        eng.add_request(f"r{i}", [3 + i, 4, 5, 6], params)
    tokens: dict[str, list[int]] = {}
    while eng.has_unfinished:
        for d in eng.step():
            tokens.setdefault(d.state.request.request_id, []).extend(d.token_ids)
    log = eng.core.lane_log.recent(10_000)
    eng.shutdown()
    return tokens, log


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_lane_times_match_trace_and_change_no_token(
    tiny_models: dict[str, Path], tmp_path: Path, async_scheduling: bool
) -> None:
    model = tiny_models["llama"]
    plain, no_log = _run(model, False, async_scheduling, None)
    timed, log = _run(model, True, async_scheduling, tmp_path)
    assert timed == plain and no_log == []
    assert len(log) >= 12  # every step that ran (12 decode steps at least)
    events = json.loads(next(tmp_path.glob("trace-worker-*.json")).read_text())["traceEvents"]
    spans = {
        (e["name"], e["args"]["step"]): (e["ts"], e["dur"])
        for e in events
        if e.get("ph") == "X" and "step" in e.get("args", {})
    }
    for step, lt in log:
        for lane, name in (("prepare", "prepare"), ("device", "device"), ("output", "reclaim")):
            start, end = getattr(lt, lane)
            assert spans[(name, step)] == (start / 1000.0, (end - start) / 1000.0)
        assert lt.prepare[0] <= lt.device[0] and lt.device[1] <= lt.output[0]
