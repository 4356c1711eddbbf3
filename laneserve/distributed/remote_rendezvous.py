"""Where the engine and a data-parallel rank's worker on another machine meet.

The engine process hosts a `TCPStore` at `master_addr:master_port` (`host_store`). A
remote rank's worker process connects to it, takes the next arrival number of its rank
(`dp<rank>/arrivals`, a counter in the store) and builds a two-rank gloo group under the
prefix `dp<rank>/<arrival>/`. The engine, to (re)start that rank, waits for an arrival
newer than the last one it used and builds the same group (it may skip an arrival whose
worker died before it was met: that group's set-up times out and the newer one is met).

```
 worker (node k)                    engine (node 0)
 connect store ── add arrivals ──▶  waits: arrivals > last used
 gloo pair "dp<r>/<n>/" rank 1 ◀──▶ gloo pair "dp<r>/<n>/" rank 0
 hello: config digest         ──▶   compares with its own
                              ◀──   ACCEPTED, or the refusal (the worker exits 2)
                              ◀──   config (with its rank and the experts' port) ...
```
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from laneserve.distributed.frame_channel import FrameChannel, gloo_pair

ACCEPTED = b"accepted"
MEET_S = 30.0  # an arrival's worker must set up its group within this


def host_store(addr: str, port: int) -> dist.TCPStore:
    """The engine's store (no default process group needed in the engine process)."""
    return dist.TCPStore(addr, port, is_master=True, wait_for_workers=False, use_libuv=True)


def join_store(addr: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A worker's connection to the engine's store (retried until `timeout_s`)."""
    return dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def _arrivals(rank: int) -> str:
    return f"dp{rank}/arrivals"


def arrive(store: dist.Store, rank: int) -> FrameChannel:
    """Worker side: a new arrival of `rank`'s worker, and its channel once the engine met it."""
    n = store.add(_arrivals(rank), 1)
    return FrameChannel(gloo_pair(store, f"dp{rank}/{n}/", 1, MEET_S))


def meet(
    store: dist.Store, rank: int, after: int, timeout_s: float, cancel: threading.Event
) -> tuple[FrameChannel, int]:
    """Engine side: the channel to the newest arrival of `rank`'s worker past `after`, and
    its number. TimeoutError when none comes within `timeout_s`; RuntimeError once
    `cancel` is set (another rank's worker failed to start)."""
    deadline = time.monotonic() + timeout_s
    while True:
        n = store.add(_arrivals(rank), 0)
        if n > after:
            try:
                return FrameChannel(gloo_pair(store, f"dp{rank}/{n}/", 0, MEET_S)), n
            except RuntimeError:  # that worker is gone before it was met: wait for the next
                after = n
        if cancel.is_set():
            raise RuntimeError("start cancelled: another rank's worker did not start")
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"data-parallel rank {rank}'s worker did not join within {timeout_s:g} s "
                "(start its node: laneserve serve ... --headless)"
            )
        time.sleep(0.1)
