"""Expert parallelism keeps the ranks' exchanges paired up, step by step.

Every rank runs every step the engine sends (in lock step, `core/data_parallel.py`), and
every step makes the same exchanges in the same order on every rank:

```
 the target's MoE layers, in forward order     once
 the MTP head's MoE layer                      k times (speculative method "mtp", k drafts)
```
A step that runs fewer (no rows on this rank, a prompt chunk that drafts nothing, rows
the worker rejected) takes part in the rest with no tokens (`idle`) after its forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from laneserve.distributed.expert_parallel import ExpertParallel


class ExchangingLayer(Protocol):
    local: range  # the routed experts (global ids) this rank holds

    def idle(self, dtype: torch.dtype, device: torch.device) -> None: ...


class ExpertSteps:
    def __init__(
        self,
        ep: ExpertParallel,
        target: Sequence[ExchangingLayer],  # the target's MoE layers, in forward order
        draft: Sequence[ExchangingLayer],  # the MTP head's (empty without one)
        num_drafts: int,  # MTP forwards per step
        dtype: torch.dtype,  # the activations' (every rank's rows travel in it)
        device: torch.device,
    ) -> None:
        self.ep, self.dtype, self.device = ep, dtype, device
        self.sequence = [*target, *(list(draft) * num_drafts)]

    def begin(self) -> None:
        self.ep.begin_step()

    def trace_args(self) -> dict[str, float]:
        """The step's exchanges for its trace span: count, bytes sent, time in them."""
        ep = self.ep
        return {"exchanges": ep.calls, "exchange_bytes": ep.sent_bytes,
                "exchange_ms": ep.wait_ns / 1e6}  # fmt: skip

    def finish(self) -> None:
        """The step's remaining exchanges, with no tokens of this rank."""
        done = self.ep.calls
        if done > len(self.sequence):
            raise RuntimeError(
                f"expert parallelism: this step made {done} exchanges, more than the "
                f"{len(self.sequence)} every step makes"
            )
        for layer in self.sequence[done:]:
            layer.idle(self.dtype, self.device)
