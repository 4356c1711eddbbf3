"""The rank processes of a tensor-parallel worker (docs/distributed.md).

The worker process is rank 0. With `tensor_parallel_size` N > 1 it spawns ranks
1..N-1 (`ipc.follower_main`) (multiprocessing `spawn`, like vLLM's mp executor), and all N join one
torch.distributed group (gloo on CPU, NCCL on CUDA) over 127.0.0.1, or over
`MASTER_ADDR` / `MASTER_PORT` where the environment sets them (torchrun's names).
Across machines (`nnodes` > 1) node k runs ranks k*L .. k*L+L-1 (L = N / nnodes; node 0
through the engine's worker, the others through `laneserve serve --headless`), the
group meets at `master_addr:master_port`, and the commands travel over a gloo group
(distributed/command_broadcast.py) instead of pipes.

```
 engine --cmd--> rank 0 --pipe--> rank 1 .. N-1     the step command, once per rank
         <-res--  rank 0                            results: rank 0 only
         all ranks: the same stages on the same commands; collectives inside the forward
```
Every rank registers the same requests, builds the same inputs and samples the same
tokens from the same (all-gathered) logits with the same generators, so their state
never diverges and nothing but the command crosses between steps. A follower that
dies takes rank 0 down with it (`os._exit`: the engine sees a worker death and
restarts every rank); rank 0's death closes the pipes and the group, and the
followers exit.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import multiprocessing as mp
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

import msgspec
import torch
import torch.distributed as dist

from laneserve.config import EngineConfig, SpeculativeConfig
from laneserve.distributed.command_broadcast import CommandBroadcast
from laneserve.distributed.parallel_state import TensorParallel
from laneserve.distributed.ports import free_port
from laneserve.model.arch import ArchConfig
from laneserve.model.registry import FAMILIES, ModelFamily
from laneserve.worker.rank_steps import end_rank

log = logging.getLogger(__name__)

_COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # a step's slowest collective, not idle time


@dataclass
class RankGroup:
    """This rank's group: its `TensorParallel` view and, on rank 0, the followers."""

    tp: TensorParallel
    pipes: list[Connection] = field(default_factory=list)  # rank 0: one per follower
    followers: Sequence[BaseProcess] = field(default_factory=list)  # rank 0: this node's
    broadcast: CommandBroadcast | None = None  # ranks on several nodes: the commands
    stopping: bool = False

    @property
    def leader(self) -> bool:
        return self.tp.rank == 0

    def send(self, data: bytes) -> None:
        """Rank 0: the step command (encoded) to every follower; b"" stops them.
        OSError when a follower is gone."""
        if self.broadcast is not None:
            try:
                self.broadcast.send(data)
            except RuntimeError as e:  # gloo: a peer's connection closed
                raise ConnectionError(str(e)) from e
        for pipe in self.pipes:
            pipe.send_bytes(data)

    def recv(self, pipe: Connection | None) -> bytes:
        """Ranks 1..N-1: the next command; b"" when rank 0 stopped or is gone."""
        try:
            if self.broadcast is not None:
                return self.broadcast.recv()
            assert pipe is not None, "a rank on one node reads its pipe"
            return pipe.recv_bytes()
        except (EOFError, OSError, RuntimeError):
            return b""  # rank 0 is gone

    def min_over_ranks(self, values: list[int], device: torch.device) -> list[int]:
        """The element-wise minimum over the ranks (e.g. KV blocks: the smallest budget)."""
        t = torch.tensor(values, dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.tp.group)
        return [int(v) for v in t.tolist()]

    def close(self) -> None:
        self.stopping = True
        if self.leader and self.broadcast is not None:
            self.broadcast.stop_heartbeat()
            with contextlib.suppress(OSError):
                self.send(b"")
        if self.leader:
            for pipe in self.pipes:
                with contextlib.suppress(OSError):
                    pipe.send_bytes(b"")
            for p in self.followers:
                p.join(10)
                if p.is_alive():
                    p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


def check_supported(
    family: ModelFamily,
    arch: ArchConfig,
    size: int,
    gguf: bool,
    spec: SpeculativeConfig | None = None,
) -> None:
    """ValueError, before anything loads, for what tensor parallelism does not cover."""
    if family.parallel_sizes is None:
        have = ", ".join(f.name for f in FAMILIES if f.parallel_sizes is not None)
        raise ValueError(
            f"tensor_parallel_size {size}: the {family.name} family has no tensor-parallel "
            f"model yet (supported families: {have})"
        )
    if gguf:
        raise ValueError(f"tensor_parallel_size {size}: GGUF-quantized weights cannot be sharded")
    if spec is not None and spec.method == "mtp" and not family.parallel_mtp:
        raise ValueError(
            f"tensor_parallel_size {size}: the {family.name} family's MTP draft head is not "
            'sharded yet; use "method": "ngram" or tensor_parallel_size 1'
        )
    for what, n in family.parallel_sizes(arch).items():
        TensorParallel(0, size).split(n, what)


def rendezvous() -> tuple[str, int]:
    """torchrun's MASTER_ADDR / MASTER_PORT if set, else 127.0.0.1 and a free port."""
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = os.environ.get("MASTER_PORT")
    if port is not None:
        return addr, int(port)
    return addr, free_port()


def rank_device(device: torch.device, rank: int) -> torch.device:
    """A CUDA rank's own device (cuda:rank); CPU ranks share the host."""
    if device.type != "cuda":
        return device
    count = torch.cuda.device_count()
    if rank >= count:
        raise ValueError(
            f"rank {rank} needs its own CUDA device (cuda:{rank}) but {count} are visible: "
            "tensor_parallel_size x data_parallel_size devices are needed"
        )
    return torch.device("cuda", rank)


def rendezvous_of(config: EngineConfig) -> tuple[str, int]:
    """Where the ranks meet: node 0's address and port across machines, else `rendezvous`."""
    p = config.parallel
    return (p.master_addr, p.master_port) if p.nnodes > 1 else rendezvous()


def join(config: EngineConfig, rank: int, addr: str, port: int, device: torch.device) -> RankGroup:
    """A rank's group; across machines also the command group, after checking that every
    node was started with the same model and flags."""
    tp = join_group(rank, config.parallel.tensor_parallel_size, addr, port, device)
    if config.parallel.nnodes == 1:
        return RankGroup(tp)
    broadcast = CommandBroadcast(dist.new_group(backend="gloo"))
    _check_same_config(config, rank, broadcast.group)
    return RankGroup(tp, broadcast=broadcast)


def config_digest(config: EngineConfig) -> str:
    """What must be equal on every node: the model, cache, speculation and parallel
    settings (each node names its own node_rank; worker settings are per node; the engine
    sets a data-parallel rank's index and experts' port)."""
    same = msgspec.structs.replace(
        config.parallel, node_rank=0, data_parallel_rank=0, data_parallel_master_port=0
    )
    parts = (config.model, config.cache, config.speculative, same)
    return hashlib.sha256(msgspec.msgpack.encode(parts)).hexdigest()


def _check_same_config(config: EngineConfig, rank: int, group: dist.ProcessGroup) -> None:
    digests: list[object] = [None] * config.parallel.tensor_parallel_size
    dist.all_gather_object(digests, config_digest(config), group=group)
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise ValueError(
            f"rank(s) {differ} were started with another model or other flags than rank 0: "
            "every node must get the same model path and engine flags"
        )


def join_group(rank: int, size: int, addr: str, port: int, device: torch.device) -> TensorParallel:
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{addr}:{port}",
        rank=rank,
        world_size=size,
        timeout=_COLLECTIVE_TIMEOUT,
    )
    return TensorParallel(rank, size, dist.group.WORLD)


FollowerMain = Callable[[bytes, int, str, int, Connection | None, int], None]


def start_leader(config: EngineConfig, device: torch.device, target: FollowerMain) -> RankGroup:
    """Rank 0: spawn the followers (`target(config bytes, rank, addr, port, pipe, log
    level)`, a module-level function: spawn pickles it by name), join the group, watch
    the followers."""
    size = config.parallel.tensor_parallel_size
    addr, port = rendezvous_of(config)
    local = config.parallel.nnodes == 1  # followers on this node only: one pipe each
    pipes, followers = [], []
    for rank in config.parallel.node_ranks()[1:]:
        pipe = spawn_follower(config, rank, addr, port, target, with_pipe=local)
        followers.append(pipe[0])
        if pipe[1] is not None:
            pipes.append(pipe[1])
    group = join(config, 0, addr, port, device)
    group.pipes, group.followers = pipes, followers
    if group.broadcast is not None:
        group.broadcast.start_heartbeat(lambda e: end_rank(0, f"a rank on another node: {e}"))
    if followers:
        threading.Thread(target=_watch, args=(group,), name="rank-watch", daemon=True).start()
    log.info("tensor parallel: %d ranks joined over %s:%d", size, addr, port)
    return group


def spawn_follower(
    config: EngineConfig, rank: int, addr: str, port: int, target: FollowerMain, with_pipe: bool
) -> tuple[BaseProcess, Connection | None]:
    """Start one rank process (`target(config bytes, rank, addr, port, pipe or None, log
    level)`, a module-level function: spawn pickles it by name); with_pipe: the pipe
    rank 0 writes its commands to."""
    ctx = mp.get_context("spawn")
    level = logging.getLogger("laneserve").getEffectiveLevel()
    recv, send = ctx.Pipe(duplex=False) if with_pipe else (None, None)
    p = ctx.Process(
        target=target,
        args=(msgspec.msgpack.encode(config), rank, addr, port, recv, level),
        name=f"laneserve-rank{rank}",
        daemon=True,
    )
    p.start()
    if recv is not None:
        recv.close()
    return p, send


def _watch(group: RankGroup) -> None:
    """Any follower's death is the worker's death: end rank 0 so that the engine restarts
    every rank (its requests get an error, /health reports it)."""
    wait([p.sentinel for p in group.followers])
    if group.stopping:
        return
    dead = [p.name for p in group.followers if not p.is_alive()]
    log.error("tensor-parallel rank(s) %s died: ending the worker", ", ".join(dead))
    logging.shutdown()
    os._exit(1)
