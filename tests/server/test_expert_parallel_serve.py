"""`laneserve serve DEEPSEEK --data-parallel-size 2 --enable-expert-parallel` end to end:
concurrent greedy streams give one device's text with MTP speculation on; killing one
rank's worker ends every stream with an error (the other rank waits on its exchanges),
/health is 503 while both ranks restart, then 200, and the same text comes back."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from laneserve import LLM, SamplingParams
from tests.distributed.kill_streams import HealthLog
from tests.server.conftest import Server, start_server, stop_server, wait_for
from tests.server.test_data_parallel_serve import PROMPTS, run_streams, worker_pids

pytestmark = pytest.mark.slow  # a server of its own, with two worker processes

SPEC = json.dumps({"method": "mtp", "num_speculative_tokens": 2})


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tiny_models import add_mtp_layer, build_tiny_deepseek

    d = build_tiny_deepseek(tmp_path_factory.mktemp("ep_serve") / "v3", 3, seed=3)
    return add_mtp_layer(d, seed=4)


@pytest.fixture(scope="module")
def ep_server(deepseek: Path) -> Iterator[Server]:
    s = start_server(
        deepseek,
        "--data-parallel-size", "2", "--enable-expert-parallel", "--speculative-config", SPEC,
    )  # fmt: skip
    yield s
    stop_server(s)


def one_device(model: Path, max_tokens: int) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(str(model), dtype="float32", speculative_config=json.loads(SPEC)) as llm:
        return [o.outputs[0].text for o in llm.generate(PROMPTS, params)]


def test_streams_equal_one_device_then_a_killed_worker_restarts_both(
    ep_server: Server, deepseek: Path
) -> None:
    want = one_device(deepseek, 40)
    pids = worker_pids(ep_server)
    assert len(pids) == 2
    outs, threads = run_streams(ep_server, 40)
    for t in threads:
        t.join(120)
    assert [o["text"] for o in outs] == want
    assert all(o["finish"] == "length" and o["error"] is None for o in outs)

    outs, threads = run_streams(ep_server, 200)
    health = HealthLog(ep_server)
    os.kill(pids[1], signal.SIGKILL)
    for t in threads:
        t.join(120)
    for o in outs:  # every stream: its rank died, or waited on the rank that did
        assert o["error"] is not None and o["error"]["code"] >= 500, o
        assert "died" in o["error"]["message"] and o["finish"] is None
    wait_for(lambda: 503 in health.seen and health.seen[-1] == 200, "health 503, then 200")
    health.close()
    new = worker_pids(ep_server)
    assert len(new) == 2 and not set(new) & set(pids)  # both restarted
    outs, threads = run_streams(ep_server, 40)
    for t in threads:
        t.join(120)
    assert [o["text"] for o in outs] == want
