"""`LLM(model, tensor_parallel_size=2)`: the worker process is rank 0 of two gloo ranks
on 127.0.0.1; greedy tokens equal one device's, batched, sync and async."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from laneserve import SamplingParams
from tests.distributed.tp_engine import assert_two_ranks_generate_what_one_device_does
from tests.e2e.test_tiny_models import mixed_prompts

LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_two_ranks_generate_what_one_device_does(tiny_models: dict[str, Path], family: str) -> None:
    prompts = mixed_prompts(6, seed=2)  # different lengths, one batch
    assert_two_ranks_generate_what_one_device_does(str(tiny_models[family]), prompts)


def test_a_family_without_tensor_parallelism_is_refused(tmp_path: Path) -> None:
    import dataclasses

    from laneserve.model.registry import FAMILIES
    from laneserve.worker.ranks import check_supported

    toy = dataclasses.replace(FAMILIES[0], name="toy", parallel_sizes=None)
    with pytest.raises(ValueError, match="the toy family has no tensor-parallel model"):
        check_supported(toy, None, 2, False)  # type: ignore[arg-type]


def test_thread_mode_is_refused() -> None:
    from laneserve.engine_args import EngineArgs

    with pytest.raises(ValueError, match="worker mode 'process'"):
        EngineArgs(model="m", tensor_parallel_size=2, worker_mode="thread").create_config()


def _rank_pids(worker_pid: int) -> list[int]:
    """The worker's spawned rank processes (not multiprocessing's resource tracker)."""
    out = []
    for task in Path(f"/proc/{worker_pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"spawn_main" in cmdline:
                out.append(int(pid))
    return out


@pytest.mark.slow
def test_a_killed_rank_is_a_worker_death_then_every_rank_restarts(
    tiny_models: dict[str, Path],
) -> None:
    from tests.e2e.test_worker_process import process_engine
    from tests.tiny_models import hf_greedy

    model = tiny_models["llama"]
    eng = process_engine(model, tensor_parallel_size=2)
    try:
        old_worker = eng.client.process.pid
        (rank1,) = _rank_pids(old_worker)
        for i in range(3):
            eng.add_request(f"r{i}", [5 + i, 6, 7, 8], LONG)
        for _ in range(5):
            eng.step()
        os.kill(rank1, signal.SIGKILL)
        finished = []
        while eng.has_unfinished:
            finished += [d for d in eng.step() if d.finished]
        assert len(finished) == 3
        assert all(d.state.finish_reason == "error" for d in finished)
        short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        eng.add_request("after", [9, 10, 11], short)
        toks = []
        while eng.has_unfinished:
            for d in eng.step():
                toks += d.token_ids
        assert toks == hf_greedy(model, [9, 10, 11], 8)
        assert eng.core.num_worker_restarts == 1 and eng.client.process.pid != old_worker
        assert len(_rank_pids(eng.client.process.pid)) == 1  # rank 1 is back too
    finally:
        eng.shutdown()
