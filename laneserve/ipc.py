"""The worker process: spawn, ready handshake, typed msgpack channels.

The worker is a fresh interpreter (`python -m laneserve.ipc`) talking over two
pipes, so user scripts need no `if __name__ == "__main__"` guard.
Engine -> worker: the `EngineConfig` once, then encoded `StepCommand`s (an
empty frame means "stop").
Worker -> engine: `WorkerReady` | `WorkerFailed` once, then `StepResult`s in
FIFO order. The engine polls for results and checks that the process is alive
between polls, so a dead worker is noticed within ~50 ms instead of hanging; a
watcher thread waits on the process too and calls `on_death` when it exits
unasked, so that a death is noticed while the engine is idle as well.
The same loop (`worker_main`) serves a data-parallel rank's worker on another machine,
with a `FrameChannel` for both pipes (worker/remote_worker.py, remote_client.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Protocol

import msgspec

from laneserve import protocol
from laneserve.config import EngineConfig
from laneserve.core.engine_core import WorkerDiedError
from laneserve.obs.profiling import Tracer
from laneserve.protocol import StepCommand, StepResult, WorkerFailed, WorkerReady
from laneserve.spawn import ignore_interrupts, spawn_helper
from laneserve.worker.rank_steps import BAD_FLAGS_EXIT

log = logging.getLogger(__name__)

_POLL_S = 0.05
_READY_TIMEOUT_S = 900.0  # first start may build the CPU kernels and convert a GGUF


class FrameSource(Protocol):
    def recv_bytes(self) -> bytes: ...


class FrameSink(Protocol):
    def send_bytes(self, data: bytes) -> None: ...


def worker_main(conn_in: FrameSource, conn: FrameSink, log_level: int) -> None:
    """Entry point of the spawned worker process (pipes), or of a data-parallel rank's
    worker on another machine (a `FrameChannel` both ways: worker/remote_worker.py)."""
    ignore_interrupts()
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s worker: %(message)s", datefmt="%H:%M:%S"
    )
    from laneserve.worker.lanes import Lanes
    from laneserve.worker.worker import Worker

    config = msgspec.msgpack.decode(conn_in.recv_bytes(), type=EngineConfig)
    lock = threading.Lock()
    group = None
    if config.parallel.tensor_parallel_size > 1:  # this process is rank 0
        from laneserve.model.loader import resolve_device
        from laneserve.worker.ranks import rank_device, start_leader

        device = rank_device(resolve_device(config.model.device), 0)
        try:
            group = start_leader(config, device, follower_main)
        except ValueError as e:  # another node's flags differ
            conn.send_bytes(protocol.encode(WorkerFailed(str(e), bad_input=True)))
            return

    def emit(result: StepResult) -> None:
        data = protocol.encode(result)
        with lock:
            conn.send_bytes(data)

    try:  # the worker is built on the device lane (see Lanes)
        lanes = Lanes(lambda: Worker(config, group), emit)
    except Exception as e:
        failed = WorkerFailed(str(e), bad_input=isinstance(e, ValueError))
        conn.send_bytes(protocol.encode(failed))
        return
    worker = lanes.worker
    with lock:
        conn.send_bytes(protocol.encode(worker.ready()))
    try:
        while True:
            try:
                data = conn_in.recv_bytes()
            except (EOFError, OSError):
                break
            if not data:
                break
            lanes.submit(data)
    finally:
        lanes.close()
        worker.shutdown()


def follower_main(
    data: bytes, rank: int, addr: str, port: int, pipe: Connection | None, log_level: int
) -> None:
    """Ranks 1..N-1 of a tensor-parallel worker: the same worker, fed every step command
    that rank 0 gets (worker/ranks.py); their results are dropped (rank 0 answers)."""
    logging.basicConfig(
        level=log_level,
        format=f"%(asctime)s %(levelname)s rank {rank}: %(message)s",
        datefmt="%H:%M:%S",
    )
    from laneserve.model.loader import resolve_device
    from laneserve.worker.ranks import join, rank_device
    from laneserve.worker.worker import Worker

    config = msgspec.msgpack.decode(data, type=EngineConfig)
    device = rank_device(resolve_device(config.model.device), rank)
    try:
        group = join(config, rank, addr, port, device)
    except ValueError as e:  # this node's flags differ from rank 0's
        log.error("%s", e)
        sys.exit(BAD_FLAGS_EXIT)
    worker = Worker(config, group)
    try:
        while cmd := group.recv(pipe):  # b"": rank 0 stopped or is gone
            worker.follow(cmd)
    finally:
        worker.shutdown()


class ProcessClient:
    """WorkerClient over a spawned process."""

    def __init__(
        self,
        config: EngineConfig,
        tracer: Tracer | None = None,
        cancel: threading.Event | None = None,
    ) -> None:
        self.config = config
        self.tracer = tracer or Tracer(None)
        self.on_death: Callable[[], None] | None = None
        # set while this worker starts: another rank's worker failed, stop waiting for this one
        self.cancel = cancel or threading.Event()
        self._start()

    def _start(self) -> None:
        self._launch()
        try:
            self._send.send_bytes(protocol.encode(self.config))
            msg = self._wait_ready()
        except BaseException:  # Ctrl-C during the start: the worker must not load on
            self._stop(kill=True)
            raise
        if isinstance(msg, WorkerFailed):
            self._wait_exit()
            raise (ValueError if msg.bad_input else RuntimeError)(msg.message)
        self.ready: WorkerReady = msg
        log.info("%s ready", self.describe())

    def _launch(self) -> None:
        """The worker process, its pipes (`_send`, `_conn`) and its watcher."""
        to_worker_r, to_worker_w = os.pipe()
        from_worker_r, from_worker_w = os.pipe()
        level = logging.getLogger("laneserve").getEffectiveLevel()
        cmd = [
            sys.executable,
            "-m",
            "laneserve.ipc",
            str(to_worker_r),
            str(from_worker_w),
            str(level),
        ]
        self.process = spawn_helper(cmd, pass_fds=(to_worker_r, from_worker_w))
        self._stopping = False
        threading.Thread(
            target=self._watch, args=(self.process,), name="worker-watch", daemon=True
        ).start()
        os.close(to_worker_r)
        os.close(from_worker_w)
        self._pipe = Connection(to_worker_w, readable=False)
        self._send: FrameSink = self._pipe
        self._conn = Connection(from_worker_r, writable=False)

    def describe(self) -> str:
        return f"worker process {self.process.pid}"

    def _wait_exit(self) -> None:
        """After a refusal: the worker ends on its own."""
        self.process.wait(10)

    def _wait_ready(self) -> WorkerReady | WorkerFailed:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._conn.poll(_POLL_S):
                try:
                    msg = protocol.decode_worker_message(self._conn.recv_bytes())
                except (EOFError, OSError):
                    break
                if isinstance(msg, StepResult):
                    raise RuntimeError("the worker sent a step result before it was ready")
                return msg
            if not self._alive():
                break
            if self.cancel.is_set():
                raise WorkerDiedError("start cancelled: another rank's worker did not start")
        raise WorkerDiedError(self.start_failure())

    def start_failure(self) -> str:
        return f"the worker process exited during start-up (code {self.process.poll()})"

    def _watch(self, process: subprocess.Popen) -> None:
        process.wait()
        if process is self.process and not self._stopping and self.on_death is not None:
            log.error("worker process %d exited (code %s)", process.pid, process.returncode)
            self.on_death()

    def _alive(self) -> bool:
        return self.process.poll() is None

    @property
    def alive(self) -> bool:
        return self._alive()

    def submit(self, cmd: StepCommand) -> None:
        with self.tracer.span("encode", "engine", step=cmd.step_id):
            data = protocol.encode(cmd)
        try:
            self._send.send_bytes(data)
        except (BrokenPipeError, OSError) as e:
            raise WorkerDiedError(self.death_message()) from e

    def result_ready(self, timeout: float) -> bool:
        """A result can be read now (a dead worker's read fails at once)."""
        return self._conn.poll(timeout) or not self._alive()

    @property
    def result_connection(self) -> Connection:
        """The pipe results arrive on (several ranks' pipes are waited on together)."""
        return self._conn

    def get_result(self) -> StepResult:
        while True:
            if self._conn.poll(_POLL_S):
                try:
                    msg = protocol.decode_worker_message(self._conn.recv_bytes())
                except (EOFError, OSError) as e:
                    raise WorkerDiedError(self.death_message()) from e
                if isinstance(msg, StepResult):
                    return msg
                continue
            if not self._alive():
                raise WorkerDiedError(self.death_message())

    def death_message(self) -> str:
        try:
            code = self.process.wait(0.5)
        except subprocess.TimeoutExpired:
            code = None
        return f"the worker process {self.process.pid} died (exit code {code})"

    def restart(self, config: EngineConfig | None = None) -> None:
        self._stop(kill=True)
        if config is not None:
            self.config = config
        self._start()

    def shutdown(self) -> None:
        self._stop(kill=False)

    def _stop(self, kill: bool) -> None:
        self._stopping = True
        if self._alive() and not kill:
            try:
                self._send.send_bytes(b"")
                self.process.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self._alive():
            self.process.kill()
            self.process.wait(5)
        self._pipe.close()
        self._conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="laneserve worker process (started by the engine)")
    parser.add_argument("in_fd", type=int)
    parser.add_argument("out_fd", type=int)
    parser.add_argument("log_level", type=int)
    ns = parser.parse_args()
    worker_main(
        Connection(ns.in_fd, writable=False), Connection(ns.out_fd, readable=False), ns.log_level
    )
    # NOTE: the worker has flushed its traces and answered its last message; skipping
    # the interpreter's teardown (torch's thread pools, module finalizers) saves about
    # a second on every engine shutdown.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
