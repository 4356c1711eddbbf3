"""The engine <-> remote worker channel (distributed/frame_channel.py, remote_rendezvous.py):
frames both ways over a two-rank gloo group met through a TCPStore, heartbeats skipped,
a killed peer and a silent peer raising instead of hanging."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed as dist

from laneserve.distributed import frame_channel
from laneserve.distributed.frame_channel import FrameChannel
from laneserve.distributed.ports import free_port
from laneserve.distributed.remote_rendezvous import arrive, host_store, join_store, meet

# a remote worker that echoes every frame reversed until the empty frame
_ECHO = """
import sys
from laneserve.distributed.remote_rendezvous import arrive, join_store
ch = arrive(join_store("127.0.0.1", int(sys.argv[1]), 30), 3)
ch.start_heartbeat(lambda e: None)
print("joined", flush=True)
while data := ch.recv_bytes():
    ch.send_bytes(data[::-1])
ch.send_bytes(b"bye")
"""


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    yield host_store("127.0.0.1", free_port())


def _pair(store: dist.TCPStore) -> tuple[FrameChannel, FrameChannel]:
    """Both sides in this process (two threads: each side's set-up waits for the other;
    the worker's side has its own connection to the store, as on another machine)."""
    client = join_store("127.0.0.1", store.port, 10)
    with ThreadPoolExecutor(2) as pool:
        engine = pool.submit(meet, store, 0, 0, 30.0, threading.Event())
        worker = pool.submit(arrive, client, 0)
        (ours, n), theirs = engine.result(), worker.result()
    assert n == 1
    return ours, theirs


def test_frames_both_ways_and_heartbeats_are_skipped(
    store: dist.TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(frame_channel, "HEARTBEAT_S", 0.05)
    engine, worker = _pair(store)
    failures: list[BaseException] = []
    engine.start_heartbeat(failures.append)
    worker.start_heartbeat(failures.append)
    big = bytes(range(256)) * 4096
    with ThreadPoolExecutor(1) as pool:  # a send waits for the peer's receive
        got = pool.submit(lambda: [worker.recv_bytes() for _ in range(3)])
        engine.send_bytes(b"config")
        time.sleep(0.5)  # several beats each way between the frames
        engine.send_bytes(big)
        engine.send_bytes(b"")  # the empty frame: "stop"
        assert got.result(30) == [b"config", big, b""]
        got = pool.submit(engine.recv_bytes)
        time.sleep(0.3)
        worker.send_bytes(b"ready")
        assert got.result(30) == b"ready"
    engine.stop_heartbeat()
    worker.stop_heartbeat()
    assert failures == []
    assert engine.beats_sent > 0 and worker.beats_seen > 0
    assert worker.beats_sent > 0 and engine.beats_seen > 0


def test_a_silent_peer_times_out_instead_of_hanging(
    store: dist.TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(frame_channel, "TIMEOUT_S", 0.5)
    engine, worker = _pair(store)  # neither side beats nor sends
    start = time.monotonic()
    with pytest.raises(EOFError, match="peer is gone"):
        engine.recv_bytes()
    assert time.monotonic() - start < 30
    with pytest.raises(EOFError):  # the worker's side: as silent
        worker.recv_bytes()


@pytest.mark.slow
def test_a_killed_peer_fails_receive_send_and_heartbeat(store: dist.TCPStore) -> None:
    port = store.port
    proc = subprocess.Popen(
        [sys.executable, "-c", _ECHO, str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        engine, n = meet(store, 3, 0, 60.0, threading.Event())
        assert n == 1 and proc.stdout is not None and proc.stdout.readline() == "joined\n"
        engine.send_bytes(b"abc")
        assert engine.recv_bytes() == b"cba"
        beat_failed = threading.Event()
        engine.start_heartbeat(lambda e: beat_failed.set())
        os.kill(proc.pid, signal.SIGKILL)
        with pytest.raises(EOFError, match="peer is gone"):
            engine.recv_bytes()
        with pytest.raises(OSError, match="peer is gone"):
            engine.send_bytes(b"more")
        assert beat_failed.wait(10)
    finally:
        proc.kill()
        proc.wait()


def test_the_engine_meets_only_a_new_arrival(store: dist.TCPStore) -> None:
    cancel = threading.Event()
    with pytest.raises(TimeoutError, match="rank 2's worker did not join"):
        meet(store, 2, 0, 0.2, cancel)
    store.add("dp2/arrivals", 1)  # an arrival already met (its worker gone)
    with pytest.raises(TimeoutError):
        meet(store, 2, 1, 0.2, cancel)
    cancel.set()
    with pytest.raises(RuntimeError, match="start cancelled"):
        meet(store, 2, 1, 30.0, cancel)


def test_a_worker_without_an_engine_fails_to_join() -> None:
    with pytest.raises(RuntimeError):
        join_store("127.0.0.1", free_port(), 0.5)
