"""A data-parallel rank's worker on a machine other than the engine's (`serve --headless`
with `--data-parallel-size` over `--nnodes`; docs/distributed.md).

The process joins the engine's store (distributed/remote_rendezvous.py), says which
model and flags its node was started with (`config_digest`), and, once accepted, runs
the same loop as a worker process on the engine's machine (`ipc.worker_main`) with a
`FrameChannel` in place of its two pipes: the engine's config (with this rank's index
and the experts' port), then step commands in, `WorkerReady` and step results out.
It ends when the engine stops it, when the engine is gone (or silent), or when a step's
exchange with the other ranks fails; its node starts it again (worker/headless.py).
"""

from __future__ import annotations

import logging
import os
import sys
from multiprocessing.connection import Connection

import msgspec

from laneserve.config import EngineConfig
from laneserve.distributed.frame_channel import FrameChannel
from laneserve.distributed.remote_rendezvous import ACCEPTED, arrive, join_store
from laneserve.worker.rank_steps import BAD_FLAGS_EXIT
from laneserve.worker.ranks import config_digest

log = logging.getLogger(__name__)

JOIN_S = 60.0  # the engine's store must answer within this (the node retries after)


def remote_worker_main(
    data: bytes, rank: int, addr: str, port: int, pipe: Connection | None, log_level: int
) -> None:
    """Data-parallel rank `rank`'s worker (a `FollowerMain`: the node spawns it)."""
    logging.basicConfig(
        level=log_level,
        format=f"%(asctime)s %(levelname)s dp rank {rank}: %(message)s",
        datefmt="%H:%M:%S",
    )
    config = msgspec.msgpack.decode(data, type=EngineConfig)
    try:
        store = join_store(addr, port, JOIN_S)
        channel = arrive(store, rank)
    except RuntimeError as e:  # no engine there (yet): the node tries again
        log.error("could not meet the engine at %s:%d: %s", addr, port, e)
        _exit(1)
    code = serve_channel(channel, config, log_level)
    _exit(code)


def serve_channel(channel: FrameChannel, config: EngineConfig, log_level: int) -> int:
    """Introduce this node's flags, then run the worker loop; the process's exit code."""
    from laneserve.ipc import worker_main

    channel.start_heartbeat(lambda e: log.error("the engine is gone: %s", e))
    try:
        channel.send_bytes(config_digest(config).encode())
        reply = channel.recv_bytes()
    except (EOFError, OSError) as e:
        log.error("the engine went away during the handshake: %s", e)
        return 1
    if reply != ACCEPTED:
        log.error("%s", reply.decode(errors="replace"))
        return BAD_FLAGS_EXIT
    worker_main(channel, channel, log_level)
    channel.stop_heartbeat()
    return 0


def _exit(code: int) -> None:
    """Leave at once: gloo's threads and torch's pools need no teardown (ipc.main)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
