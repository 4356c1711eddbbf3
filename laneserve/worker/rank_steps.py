"""How the ranks of a tensor-parallel worker stay in step when something fails.

Every rank must run the same forwards in the same order, or their collectives pair up
wrongly (garbage) or wait forever. So rank 0 decides which requests of a step fail
alone, and the followers follow its decision:

```
 rank 0    decode + register the step's new requests   -> rejected handles R (or: skip)
           send RankStep(command bytes, R, skip) to each follower
 rank k    decode the same bytes, register all but R    -> a request rank 0 accepted
           and rank k cannot take is a failure of rank k
```
A failure that only one rank can see in the later stages (prepare, forward, sampling,
the device->host copy, a release) leaves that rank unable to run the next forward with
the others, so with N > 1 it ends that rank's process: the other ranks notice (rank 0
watches its followers; a follower sees rank 0's pipe close or a collective fail) and
the engine restarts the worker with every rank; the in-flight requests get an error.
With one rank none of this applies: failures stay per step and per request.
"""

from __future__ import annotations

import logging
import os
from typing import NoReturn

import msgspec

log = logging.getLogger(__name__)

BAD_FLAGS_EXIT = 2  # a rank's exit code when its node's flags differ from node 0's


class RankStep(msgspec.Struct, array_like=True, frozen=True):
    """What rank 0 sends each follower per step."""

    command: bytes  # the StepCommand as the engine encoded it
    rejected: list[int]  # handles rank 0 failed alone in this step: the followers skip them
    skip: bool = False  # rank 0 could not read the command: no rank runs this step


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(RankStep)


def encode_step(step: RankStep) -> bytes:
    return _ENCODER.encode(step)


def decode_step(data: bytes) -> RankStep:
    return _DECODER.decode(data)


def end_rank(rank: int, what: str) -> NoReturn:
    """A failure this rank alone may have: end the process so every rank restarts."""
    log.error("rank %d: %s; ending this rank so that every rank restarts", rank, what)
    logging.shutdown()
    os._exit(1)
