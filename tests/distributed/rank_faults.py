"""What the processes of the one-rank-failure tests run (module-level functions: spawned
processes import them by name). Rank 0 is a spawned process too, because a rank that
fails alone ends its own process."""

from __future__ import annotations

import json
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from laneserve import SamplingParams
from laneserve.engine_args import EngineArgs
from laneserve.frontend.engine import LLMEngine
from laneserve.ipc import follower_main
from laneserve.worker.clients import InlineClient
from laneserve.worker.ranks import start_leader
from laneserve.worker.worker import Worker

PROMPTS = {"a": [5, 6, 7, 8], "b": [9, 10, 11], "c": [12, 13, 14, 15, 16]}
MAX_TOKENS = 12
REJECTED = "b"  # the request a rank fails alone


def _fail_register_of_b() -> None:
    """This process's workers fail request "b" at registration."""
    original = Worker._register_one

    def register_one(self: Worker, new):  # type: ignore[no-untyped-def]
        if list(new.prompt_token_ids) == PROMPTS[REJECTED]:
            raise ValueError("refused on this rank only")
        return original(self, new)

    Worker._register_one = register_one  # type: ignore[method-assign]


def _fail_forward_at(step_id: int) -> None:
    """This process's workers raise in the forward of step `step_id`."""
    original = Worker._execute

    def execute(self: Worker, inp):  # type: ignore[no-untyped-def]
        if inp.step_id == step_id:
            self.runner.execute = _raise  # type: ignore[method-assign]
        return original(self, inp)

    Worker._execute = execute  # type: ignore[method-assign]


def _raise(*args: object) -> None:
    raise RuntimeError("the forward failed on this rank only")


def follower_plain(
    data: bytes, rank: int, addr: str, port: int, pipe: Connection, level: int
) -> None:
    follower_main(data, rank, addr, port, pipe, level)


def follower_failing_forward(
    data: bytes, rank: int, addr: str, port: int, pipe: Connection, level: int
) -> None:
    _fail_forward_at(3)
    follower_main(data, rank, addr, port, pipe, level)


def follower_rejecting(
    data: bytes, rank: int, addr: str, port: int, pipe: Connection, level: int
) -> None:
    _fail_register_of_b()
    follower_main(data, rank, addr, port, pipe, level)


FOLLOWERS = {
    "plain": follower_plain,
    "forward": follower_failing_forward,
    "reject": follower_rejecting,
}


def leader(model_dir: str, follower: str, fault: str, out: str) -> None:
    """Rank 0 with an engine over it: the follower kind and rank 0's own fault
    ("none", "reject": fails request "b" at registration, "forward": its forward of step
    3 raises); writes each request's tokens or error to `out` if it gets that far."""
    torch.set_num_threads(1)
    if fault == "reject":
        _fail_register_of_b()
    elif fault == "forward":
        _fail_forward_at(3)
    config = EngineArgs(
        model=model_dir, dtype="float32", tensor_parallel_size=2, worker_mode="process"
    ).create_config()
    group = start_leader(config, torch.device("cpu"), FOLLOWERS[follower])
    eng = LLMEngine(config, InlineClient(config, Worker(config, group)))
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for rid, ids in PROMPTS.items():
        eng.add_request(rid, ids, sp)
    got: dict[str, object] = {rid: [] for rid in PROMPTS}
    while eng.has_unfinished:
        for d in eng.step():
            toks = got[d.state.group_id]
            assert isinstance(toks, list)
            toks += d.token_ids
            if d.finished and d.state.finish_reason == "error":
                got[d.state.group_id] = "error"
    got["followers_alive"] = all(p.is_alive() for p in group.followers)
    Path(out).write_text(json.dumps(got))
    eng.shutdown()
