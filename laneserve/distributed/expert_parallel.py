"""A rank's view of its expert-parallel group: which routed experts it holds and the
all-to-all exchanges that move (token, expert) rows to them and back.

No global state: an `ExpertParallel` is built once per worker process (the data-parallel
ranks' group, gloo on CPU / NCCL on CUDA) and handed to the MoE layers. `NO_EXPERTS` is
the one-rank value: every expert local, no exchange.

Every exchange is a collective, so the ranks must make the same exchanges in the same
order. The worker keeps that order per step (`worker/expert_steps.py`); each exchange
also carries its position in the step (`calls`), and ranks that disagree raise
`OutOfStepError` instead of mixing two layers' rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


class OutOfStepError(RuntimeError):
    """The ranks reached different exchanges (a bug: the rank ends, every rank restarts)."""


@dataclass
class ExpertParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # the ranks' process group; None for one rank
    # where the counts travel (NCCL: the GPU)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    calls: int = 0  # exchanges made in the current step (worker/expert_steps.py)
    sent_bytes: int = 0  # ... the bytes this rank sent in them (to itself included)
    wait_ns: int = 0  # ... and the time spent in their collectives (waiting included)

    def begin_step(self) -> None:
        self.calls = self.sent_bytes = self.wait_ns = 0

    def experts(self, n: int) -> range:
        """The global ids of the routed experts this rank holds (n / size of them)."""
        if n % self.size:
            raise ValueError(
                f"data_parallel_size {self.size} does not divide the model's {n} routed "
                "experts (enable_expert_parallel needs a size that divides them)"
            )
        per = n // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def counts(self, send: list[int]) -> list[int]:
        """How many rows each rank sends this one, given how many it sends each rank; the
        exchange's position in the step travels along and must agree on every rank."""
        tag = self.calls
        self.calls += 1
        out = torch.tensor([[n, tag] for n in send], dtype=torch.int64, device=self.device)
        back = torch.empty_like(out)
        self._timed(back, out, None, None)
        tags = back[:, 1].tolist()
        if any(t != tag for t in tags):
            raise OutOfStepError(
                f"expert-parallel rank {self.rank} is at exchange {tag} of the step, "
                f"the ranks at {tags}"
            )
        return [int(n) for n in back[:, 0].tolist()]

    def all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Rows of `x` split by `send` (rank order) out; rows split by `recv` in."""
        out = x.new_empty((sum(recv), *x.shape[1:]))
        self._timed(out, x.contiguous(), recv, send)
        return out

    def _timed(
        self, out: torch.Tensor, x: torch.Tensor, recv: list[int] | None, send: list[int] | None
    ) -> None:
        start = time.perf_counter_ns()
        dist.all_to_all_single(out, x, recv, send, group=self.group)
        self.wait_ns += time.perf_counter_ns() - start
        self.sent_bytes += x.numel() * x.element_size()


NO_EXPERTS = ExpertParallel()


def join_experts(
    rank: int, size: int, addr: str, port: int, device: torch.device
) -> ExpertParallel:
    """Join the data-parallel ranks' group (this process's default group)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=size)
    return ExpertParallel(rank, size, dist.group.WORLD, device=device)
