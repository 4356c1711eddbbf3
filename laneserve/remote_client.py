"""`RemoteClient`: the engine's client of a data-parallel rank whose worker runs on
another machine (docs/distributed.md#data-parallel-ranks-across-machines).

It offers what a `ProcessClient` offers (submit, get_result, result_ready, ready, alive,
death_message, restart, shutdown, on_death), so the lock-step core treats the ranks alike.
The frames travel over a `FrameChannel` (gloo, point to point) met through the engine's
store (distributed/remote_rendezvous.py). A receiver thread moves each frame from the
channel into a local pipe, so the results are read, polled and waited on (with the other
ranks' pipes) exactly as a local worker's; when the channel fails (the worker died, its
machine is gone or silent) the thread closes that pipe and calls `on_death`.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import threading
from multiprocessing.connection import Connection

import torch.distributed as dist

from laneserve.config import EngineConfig
from laneserve.distributed.frame_channel import FrameChannel
from laneserve.distributed.remote_rendezvous import ACCEPTED, meet
from laneserve.ipc import ProcessClient
from laneserve.obs.profiling import Tracer
from laneserve.worker.ranks import config_digest

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 900.0  # a remote rank's worker must join within this (its node starting)
_STOP_S = 10.0  # a stopped worker's channel must close within this


class RemoteClient(ProcessClient):
    """WorkerClient of data-parallel rank `config.parallel.data_parallel_rank`, whose
    worker runs on another machine (`serve --headless`) and meets this engine's store."""

    def __init__(
        self,
        config: EngineConfig,
        store: dist.Store,
        tracer: Tracer | None = None,
        cancel: threading.Event | None = None,
        join_timeout_s: float = JOIN_TIMEOUT_S,
    ) -> None:
        self.store = store
        self.rank = config.parallel.data_parallel_rank
        self.join_timeout_s = join_timeout_s
        self._arrival = 0  # the last arrival of this rank's worker that was met
        self._why = "not started"
        self._dead = threading.Event()  # set while no worker is met (before, between, after)
        self._dead.set()
        self._receiver: threading.Thread | None = None  # frames: channel -> pipe
        self.channel: FrameChannel | None = None  # the worker met last
        super().__init__(config, tracer, cancel)

    def _launch(self) -> None:
        self._stopping = False
        channel, self._arrival = meet(
            self.store, self.rank, self._arrival, self.join_timeout_s, self.cancel
        )
        self.channel, self._dead = channel, threading.Event()
        channel.start_heartbeat(lambda e: self._died(channel, f"{e}"))
        try:
            self._introduce(channel)
        except BaseException:
            self._close(channel)
            raise
        self._conn, pipe_in = mp.Pipe(duplex=False)
        self._send = channel
        self._receiver = threading.Thread(
            target=self._receive, args=(channel, pipe_in), name="remote-worker", daemon=True
        )
        self._receiver.start()

    def _introduce(self, channel: FrameChannel) -> None:
        """The worker's node must run the same model and flags (its digest first)."""
        try:
            theirs = channel.recv_bytes().decode(errors="replace")
        except EOFError as e:
            raise RuntimeError(f"{self.describe()} went away before its hello: {e}") from e
        if theirs != config_digest(self.config):
            message = (
                f"data-parallel rank {self.rank} (node {self._node()}) was started with "
                "another model or other flags than node 0: every node must get the same "
                "model path and engine flags"
            )
            with contextlib.suppress(OSError):
                channel.send_bytes(message.encode())
            raise ValueError(message)
        channel.send_bytes(ACCEPTED)

    def _node(self) -> int:
        p = self.config.parallel
        return self.rank // (p.data_parallel_size // p.nnodes)

    def _receive(self, channel: FrameChannel, pipe: Connection) -> None:
        why = "the worker stopped"
        try:
            while data := channel.recv_bytes():
                pipe.send_bytes(data)
        except (EOFError, OSError) as e:
            why = str(e)
        finally:
            pipe.close()  # the reader sees end-of-file: the worker is gone
        self._died(channel, why)

    def _died(self, channel: FrameChannel, why: str) -> None:
        if channel is not self.channel or self._dead.is_set():
            return
        self._why = why
        self._dead.set()
        channel.stop_heartbeat()
        if not self._stopping:
            log.error("%s is gone: %s", self.describe(), why)
            if self.on_death is not None:
                self.on_death()

    def describe(self) -> str:
        return f"data-parallel rank {self.rank}'s worker on node {self._node()}"

    def start_failure(self) -> str:
        return f"{self.describe()} ended during start-up ({self._why})"

    def _wait_exit(self) -> None:
        if self._receiver is not None:
            self._receiver.join(_STOP_S)

    def _alive(self) -> bool:
        return not self._dead.is_set()

    def death_message(self) -> str:
        return f"the {self.describe()} died ({self._why})"

    def _stop(self, kill: bool) -> None:
        """The stop frame (a remote process cannot be killed from here: it ends on the
        stop frame, or on its channel closing); then wait for its channel to close."""
        self._stopping = True
        channel = self.channel
        if channel is None:  # no worker was ever met
            return
        if self._alive():
            with contextlib.suppress(OSError):
                channel.send_bytes(b"")
        receiver, self._receiver = self._receiver, None
        if receiver is not None:
            receiver.join(_STOP_S)
            self._conn.close()
        self._close(channel)

    def _close(self, channel: FrameChannel) -> None:
        channel.stop_heartbeat()
        self._dead.set()
