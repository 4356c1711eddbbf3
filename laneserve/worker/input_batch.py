"""Worker-side request state: persistent across steps, written by the prepare lane.

`RequestTable` applies a `StepCommand` (register, block-table deltas,
preemptions) to persistent per-request state; `step_inputs.build_inputs` then
turns the command into a `StepInputs` snapshot in one of two reusable
`InputSlot`s (host buffers).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from laneserve.protocol import NewRequest, ScheduledRequest
from laneserve.sampling_params import SamplingParams


class SlotTable:
    """Stable state slots with generation tags (thread-safe).

    A slot index names the device-state rows of one live request. Releasing a
    slot bumps its generation, so anything still holding (slot, old gen) is
    recognisably stale.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gen: list[int] = []
        self._free: list[int] = []

    @property
    def capacity(self) -> int:
        return len(self._gen)

    def acquire(self) -> tuple[int, int]:
        with self._lock:
            if self._free:
                slot = self._free.pop()
            else:
                slot = len(self._gen)
                self._gen.append(0)
            return slot, self._gen[slot]

    def is_current(self, slot: int, gen: int) -> bool:
        return self._gen[slot] == gen

    def release(self, slot: int, gen: int) -> bool:
        with self._lock:
            if self._gen[slot] != gen:
                return False
            self._gen[slot] += 1
            self._free.append(slot)
            return True


@dataclass
class WorkerRequest:
    handle: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int]
    generator: torch.Generator | None
    slot: int
    gen: int
    block_ids: list[list[int]] = field(default_factory=list)  # per cache group


class CommandError(ValueError):
    """A command that does not fit the worker's state (a malformed command)."""


class RequestTable:
    def __init__(
        self, num_groups: int, block_size: int, device: torch.device, max_model_len: int
    ) -> None:
        self.num_groups = num_groups
        self.block_size = block_size
        self.device = device
        self.max_model_len = max_model_len
        self.slots = SlotTable()
        self.requests: dict[int, WorkerRequest] = {}

    def register(self, new: NewRequest) -> WorkerRequest:
        if new.handle in self.requests:
            raise CommandError(f"request handle {new.handle} is already registered")
        if not new.prompt_token_ids or len(new.prompt_token_ids) > self.max_model_len:
            raise CommandError(
                f"request {new.request_id}: bad prompt length {len(new.prompt_token_ids)}"
            )
        gen = None
        if new.sampling_params.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(new.sampling_params.seed)
        slot, tag = self.slots.acquire()
        req = WorkerRequest(
            handle=new.handle,
            request_id=new.request_id,
            prompt_token_ids=new.prompt_token_ids,
            params=new.sampling_params,
            eos_token_ids=new.eos_token_ids,
            generator=gen,
            slot=slot,
            gen=tag,
            block_ids=[[] for _ in range(self.num_groups)],
        )
        self.requests[new.handle] = req
        return req

    def apply_blocks(self, s: ScheduledRequest) -> WorkerRequest:
        req = self.requests.get(s.handle)
        if req is None:
            raise CommandError(f"step schedules unknown request handle {s.handle}")
        if s.new_block_ids:
            if len(s.new_block_ids) != self.num_groups:
                raise CommandError(
                    f"handle {s.handle}: block ids for {len(s.new_block_ids)} groups"
                )
            for group, ids in zip(req.block_ids, s.new_block_ids, strict=True):
                if s.resumed:
                    group.clear()
                group.extend(ids)
        return req

    def preempt(self, handle: int) -> None:
        req = self.requests.get(handle)
        if req is not None:
            for group in req.block_ids:
                group.clear()

    def pop_finished(self, handles: list[int]) -> list[tuple[int, int]]:
        """Forget finished requests; their (slot, gen) pairs go to the device lane."""
        out = []
        for handle in handles:
            req = self.requests.pop(handle, None)
            if req is not None:
                out.append((req.slot, req.gen))
        return out


class InputSlot:
    """Reusable host buffers for one in-flight step (two of them: ping-pong).

    NOTE: on the CPU the step's tensors are views of these buffers, so a slot
    must not be refilled until the output lane has reclaimed its step.
    """

    def __init__(self, index: int, max_tokens: int, max_rows: int) -> None:
        self.index = index
        self.tokens = np.zeros((3, max_tokens), dtype=np.int64)  # row, offset, is_draft
        self.rows = np.zeros((4, max_rows), dtype=np.int64)  # slot, decode, start, qlen
        self.busy = False
