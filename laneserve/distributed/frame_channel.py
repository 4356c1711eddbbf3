"""A two-party channel of byte frames over a gloo process group (point to point).

The engine process and a data-parallel rank's worker on another machine talk over one of
these (docs/distributed.md#data-parallel-ranks-across-machines): the engine hosts a
`TCPStore` at `master_addr:master_port`, and for each remote rank's worker the two build
a two-rank `ProcessGroupGloo` on it (under a prefix of their own), with no default
process group in the engine process.

```
 frame:   send int64 [n] ── then, for n > 0, send uint8 [n] (the bytes)
          n = -1: a heartbeat (skipped by `recv_bytes`); n = 0: the empty frame ("stop")
```
A gloo send completes only once the peer has posted the matching receive, so each side
keeps one posted at all times: a reader thread receives every frame into a queue that
`recv_bytes` reads (a worker loading its model still takes the engine's beats). Each side
sends a heartbeat whenever it sent nothing for `HEARTBEAT_S`, and a receive waits at most
`timeout_s` for the next frame (a beat included). So a peer whose process
died (its connection closes: gloo fails the receive at once) or whose machine went away
(nothing arrives: the receive times out) is noticed within seconds, idle or not.
`recv_bytes` / `send_bytes` have `multiprocessing.Connection`'s shape (EOFError / OSError
when the peer is gone), so the worker's loop (`ipc.worker_main`) reads a channel as it
reads its pipes.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist

from laneserve.distributed.heartbeat import Heartbeat

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
TIMEOUT_S = 15.0  # no frame (not even a beat) for this long: the peer is gone
_BEAT = -1
_TAG = 0


def gloo_pair(store: dist.Store, prefix: str, rank: int, timeout_s: float) -> dist.ProcessGroup:
    """A two-rank gloo group on `store` under `prefix` (rank 0: the engine's side).
    Waits up to `timeout_s` for the other side; RuntimeError when it does not come."""
    group = dist.ProcessGroupGloo(
        dist.PrefixStore(prefix, store), rank, 2, timedelta(seconds=timeout_s)
    )
    return cast(dist.ProcessGroup, group)  # NOTE: typed as a backend; it has send / recv


class FrameChannel:
    """Length-prefixed frames to and from the other rank of a two-rank gloo group."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float | None = None) -> None:
        self.group = group
        self.peer = 1 - group.rank()
        self.timeout = timedelta(seconds=TIMEOUT_S if timeout_s is None else timeout_s)
        self._heartbeat = Heartbeat(
            lambda: self._send_length(_BEAT),
            HEARTBEAT_S,
            HEARTBEAT_S / 4,
            (OSError,),
            "frame-heartbeat",
        )
        self.beats_seen = 0
        # a gloo send completes once the peer has posted its receive, so a receive is
        # always posted here (a reader thread), whatever this side is busy with
        self._frames: queue.SimpleQueue[bytes | EOFError] = queue.SimpleQueue()
        threading.Thread(target=self._read, name="frame-reader", daemon=True).start()

    def send_bytes(self, data: bytes) -> None:
        """One frame (b"": the empty frame). OSError when the peer is gone."""
        with self._heartbeat.lock:
            self._send_length(len(data))
            if data:
                payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                self._transfer(payload, send=True)
            self._heartbeat.sent_now()

    @property
    def beats_sent(self) -> int:
        return self._heartbeat.sent

    def recv_bytes(self) -> bytes:
        """The next frame (heartbeats skipped). EOFError when the peer is gone or silent."""
        frame = self._frames.get()
        if isinstance(frame, EOFError):
            self._frames.put(frame)  # every later read fails too
            raise EOFError(str(frame))
        return frame

    def _read(self) -> None:
        try:
            while True:
                self._frames.put(self._next_frame())
        except EOFError as e:
            self._frames.put(e)

    def _next_frame(self) -> bytes:
        while True:
            n = torch.zeros(1, dtype=torch.int64)
            self._transfer(n, send=False)
            size = int(n.item())
            if size == _BEAT:
                self.beats_seen += 1
                continue
            if size <= 0:
                return b""
            payload = torch.empty(size, dtype=torch.uint8)
            self._transfer(payload, send=False)
            return payload.numpy().tobytes()

    def start_heartbeat(self, on_failure: Callable[[BaseException], None]) -> None:
        """Beat whenever no frame went out for `HEARTBEAT_S`; `on_failure` when one fails."""
        self._heartbeat.start(on_failure)

    def stop_heartbeat(self) -> None:
        self._heartbeat.stop()

    def _send_length(self, n: int) -> None:
        length = torch.tensor([n], dtype=torch.int64)
        self._transfer(length, send=True)

    def _transfer(self, t: torch.Tensor, send: bool) -> None:
        """Send or receive one tensor and wait for it: OSError (send) / EOFError
        (receive) when gloo fails it (the peer's connection closed, or a timeout)."""
        try:
            op = self.group.send if send else self.group.recv
            op([t], self.peer, _TAG).wait(self.timeout)
        except RuntimeError as e:
            error = OSError if send else EOFError
            raise error(f"the channel's peer is gone: {e}") from e
