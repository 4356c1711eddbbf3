"""Step commands from rank 0 to every other rank over a torch.distributed group.

With ranks on several machines there is no pipe to a remote rank, so rank 0 broadcasts
each command on a gloo group of its own (apart from the model's collectives, which run
on another thread of rank 0): first its length, then its bytes. A length of -1 is a
heartbeat, sent when no command went out for `HEARTBEAT_S`: a rank that died on another
machine fails the broadcast within about that time even when no request runs, so the
worker's death (and /health) follow at once instead of at the next request. A length
of 0 tells the ranks to stop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from laneserve.distributed.heartbeat import Heartbeat

HEARTBEAT_S = 1.0
_BEAT = -1


class CommandBroadcast:
    """One gloo group carrying rank 0's commands; `send` on rank 0, `recv` elsewhere."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._heartbeat = Heartbeat(
            lambda: self._broadcast_length(_BEAT),
            HEARTBEAT_S,
            HEARTBEAT_S / 2,
            (RuntimeError,),  # gloo: a peer's connection closed
            "rank-heartbeat",
        )

    def send(self, data: bytes) -> None:
        """Rank 0: one command to every rank (b"" stops them). Raises when a rank is gone."""
        with self._heartbeat.lock:  # one broadcast at a time on rank 0
            self._broadcast_length(len(data))
            if data:
                payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                dist.broadcast(payload, 0, group=self.group)
            self._heartbeat.sent_now()

    def recv(self) -> bytes:
        """Ranks 1..N-1: the next command (heartbeats skipped); b"" means stop."""
        while True:
            n = torch.zeros(1, dtype=torch.int64)
            dist.broadcast(n, 0, group=self.group)
            size = int(n.item())
            if size == _BEAT:
                continue
            if size == 0:
                return b""
            payload = torch.empty(size, dtype=torch.uint8)
            dist.broadcast(payload, 0, group=self.group)
            return payload.numpy().tobytes()

    def start_heartbeat(self, on_failure: Callable[[BaseException], None]) -> None:
        """Rank 0: beat whenever no command went out for `HEARTBEAT_S`."""
        self._heartbeat.start(on_failure)

    def stop_heartbeat(self) -> None:
        self._heartbeat.stop()

    def _broadcast_length(self, n: int) -> None:
        dist.broadcast(torch.tensor([n], dtype=torch.int64), 0, group=self.group)
