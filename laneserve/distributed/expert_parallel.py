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
        dist.all_to_all_single(back, out, group=self.group)
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
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=self.group)
        return out


NO_EXPERTS = ExpertParallel()


def join_experts(
    rank: int, size: int, addr: str, port: int, device: torch.device
) -> ExpertParallel:
    """Join the data-parallel ranks' group (this process's default group)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=size)
    return ExpertParallel(rank, size, dist.group.WORLD, device=device)
