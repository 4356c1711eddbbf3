"""`RemoteClient` (laneserve/remote_client.py) against a stand-in remote worker (no model):
the handshake (digest, config, WorkerReady), a death seen while idle, restart meeting
the worker's next arrival, shutdown's stop frame, and a node with other flags refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from laneserve.config import EngineConfig, ModelConfig, ParallelConfig, WorkerConfig
from laneserve.core.engine_core import WorkerDiedError
from laneserve.distributed.ports import free_port
from laneserve.distributed.remote_rendezvous import host_store
from laneserve.remote_client import RemoteClient
from laneserve.worker.ranks import config_digest

# rank 1's worker as a remote node runs it, minus the model: it answers the config with
# a WorkerReady naming its rank, then reads frames until the stop frame
_FAKE = """
import os, sys
import msgspec
from laneserve import protocol
from laneserve.config import EngineConfig
from laneserve.distributed.remote_rendezvous import ACCEPTED, arrive, join_store
ch = arrive(join_store("127.0.0.1", int(sys.argv[1]), 30), 1)
ch.start_heartbeat(lambda e: None)
ch.send_bytes(sys.argv[2].encode())
reply = ch.recv_bytes()
if reply != ACCEPTED:
    print(reply.decode(), flush=True)
    os._exit(2)
config = msgspec.msgpack.decode(ch.recv_bytes(), type=EngineConfig)
ready = protocol.WorkerReady(
    cache_groups=[], block_size=16, max_model_len=64, vocab_size=10, eos_token_ids=[0],
    model_dir="m", device="cpu", weight_dtype="float32", kernels="none", load_s=0.0,
    local_experts=[config.parallel.data_parallel_rank],
)
ch.send_bytes(protocol.encode(ready))
while ch.recv_bytes():
    pass
os._exit(0)
"""


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def store(port: int) -> Iterator[dist.TCPStore]:
    yield host_store("127.0.0.1", port)


def _config(port: int) -> EngineConfig:
    parallel = ParallelConfig(
        data_parallel_size=2,
        enable_expert_parallel=True,
        nnodes=2,
        master_port=port,
        data_parallel_rank=1,
    )
    return EngineConfig(
        model=ModelConfig(model="m"), worker=WorkerConfig(mode="process"), parallel=parallel
    )


def _fake(port: int, digest: str) -> subprocess.Popen:
    cmd = [sys.executable, "-c", _FAKE, str(port), digest]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_ready_idle_death_restart_and_shutdown(port: int, store: dist.TCPStore) -> None:
    config = _config(port)
    first = _fake(port, config_digest(config))
    second = None
    try:
        client = RemoteClient(config, store, join_timeout_s=60)
        assert client.alive and client.ready.local_experts == [1]
        died = threading.Event()
        client.on_death = died.set
        os.kill(first.pid, signal.SIGKILL)  # no step in flight: the channel notices
        assert died.wait(20)
        assert not client.alive and client.result_ready(0)
        assert "data-parallel rank 1's worker on node 1 died" in client.death_message()
        with pytest.raises(WorkerDiedError):
            client.get_result()
        second = _fake(port, config_digest(config))  # node 1 starts it again
        client.restart(config)
        assert client.alive and client.ready.local_experts == [1]
        died.clear()
        client.shutdown()  # the stop frame: the worker ends on its own
        assert second.wait(30) == 0
        assert not died.is_set()  # a stop asked for is no death
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()


def test_a_node_with_other_flags_is_refused(port: int, store: dist.TCPStore) -> None:
    fake = _fake(port, "another digest")
    try:
        with pytest.raises(ValueError, match="other flags than node 0"):
            RemoteClient(_config(port), store, join_timeout_s=60)
        assert fake.wait(30) == 2
        assert fake.stdout is not None and "other flags than node 0" in fake.stdout.read()
    finally:
        fake.kill()


def test_no_worker_joining_is_a_start_failure(port: int, store: dist.TCPStore) -> None:
    with pytest.raises(TimeoutError, match=r"rank 1.s worker did not join within 0\.3 s"):
        RemoteClient(_config(port), store, join_timeout_s=0.3)
