"""Worker-side request state and the host half of a step (the prepare lane).

`RequestTable` applies a `StepCommand` (register, block-table deltas,
preemptions) to persistent per-request state; `build_inputs` turns one command
into a complete `StepInputs` snapshot in one of two reusable `InputSlot`s.

Rows of a step are ordered decode-like first, then prefill chunks; inside the
snapshot everything is relative to the *planned* state. Values that depend on
the previous step's outcome (a decode's position and input token, draft
tokens) are resolved on the device by `ModelRunner`, from the committed state
that only the device lane writes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from laneserve.protocol import NewRequest, ScheduledRequest, StepCommand
from laneserve.sample.sampler import RowSampling, SamplingBatch
from laneserve.sample.sampler import prepare as prepare_sampling
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


@dataclass
class RowMeta:
    """What the output lane needs about one row (no lookups after prepare)."""

    handle: int
    slot: int
    gen: int
    sample: bool
    num_spec: int
    num_logprobs: int | None


@dataclass(frozen=True)
class PrefillRow:
    row: int
    token_start: int
    num_tokens: int
    context_len: int


@dataclass
class SideInputs:
    """Side rows of a step: the alternatives to first drafts (see side_rows.py)."""

    width: int  # alternatives per row (W)
    state_slots: torch.Tensor  # [Ra] state slots of the rows that carry alternatives
    sample: torch.Tensor  # [Ra] their sampling-row index
    every_row: bool  # every sampling row carries alternatives (rows == sampling rows)
    sample_host: list[int]
    slots: torch.Tensor  # [Ra, W] scratch KV slot per alternative
    tables: torch.Tensor  # [Ra * W, C] int32: each side row's own (request's) table
    query_start_loc: torch.Tensor  # [Sd + Ra * W + 1] int32: decode rows, then side rows
    last_slot: torch.Tensor  # [Sd + Ra * W] int64: -1 for decode rows, then the slots
    first_draft: torch.Tensor  # [Ra] token index of each row's d1


@dataclass
class StepInputs:
    step_id: int
    slot_index: int  # which InputSlot holds the buffers below
    rows: list[RowMeta]
    num_tokens: int
    num_decode_rows: int
    num_decode_tokens: int
    prefills: list[PrefillRow]
    prefill_block_ids: list[list[torch.Tensor]]  # per group, per prefill row (int64)
    new_prompts: list[tuple[int, torch.Tensor]]  # (slot, prompt ids) to write first
    releases: list[tuple[int, int]]  # (slot, gen) released after this step
    # device tensors, one entry per row / token / logits row
    row_slot: torch.Tensor  # [R] int64
    row_decode: torch.Tensor  # [R] bool
    row_start: torch.Tensor  # [R] int64 planned start (exact for prefill rows)
    row_qlen: torch.Tensor  # [R] int64
    block_tables: list[torch.Tensor]  # per group [R, max_blocks] int32 (as attention reads)
    token_row: torch.Tensor  # [T] int64
    token_offset: torch.Tensor  # [T] int64
    token_is_draft: torch.Tensor  # [T] bool
    token_draft_col: torch.Tensor  # [T] int64 drafts column of a draft token (clamped)
    decode_query_start_loc: torch.Tensor  # [Sd + 1] int32
    sample_rows: torch.Tensor  # [Rs] int64 rows that sample
    sample_slot: torch.Tensor  # [Rs] int64 their state slots
    token_slot: torch.Tensor  # [T] int64 state slot of each token's row
    sample_num_spec: torch.Tensor  # [Rs] int64
    logits_token_idx: torch.Tensor  # [N] int64 token rows to compute logits for
    logits_sample_row: torch.Tensor  # [N] int64 index into sample rows
    logits_offset: torch.Tensor  # [N] int64 0..k within the sampling row
    logits_sample_row_host: list[int]
    sample_logit_start: torch.Tensor  # [Rs] int64 first logits row of each sampling row
    max_spec: int
    max_len: int  # host upper bound on every row's length after this step
    sampling: SamplingBatch | None
    any_spec: bool
    dense_spec: bool = False  # every sampling row is a decode verifying max_spec drafts
    side: SideInputs | None = None  # alternatives to first drafts (token tree) this step


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


def build_inputs(
    cmd: StepCommand,
    table: RequestTable,
    slot: InputSlot,
    device: torch.device,
    vocab_size: int,
    shared_generator: torch.Generator,
    new_prompts: list[tuple[int, torch.Tensor]],
    releases: list[tuple[int, int]],
    scratch_blocks: list[int],
    pad_cols: int,
    side_width: int = 0,
    side_base: int = 0,
) -> StepInputs:
    order = sorted(range(len(cmd.scheduled)), key=lambda i: not cmd.scheduled[i].decode)
    sched = [cmd.scheduled[i] for i in order]
    reqs = [table.requests[s.handle] for s in sched]
    n_rows = len(sched)
    n_tokens = sum(s.num_tokens for s in sched)
    if n_tokens > slot.tokens.shape[1] or n_rows > slot.rows.shape[1]:
        raise CommandError(
            f"step {cmd.step_id} has {n_tokens} tokens / {n_rows} rows, over the limits"
        )
    tok, rows = slot.tokens[:, :n_tokens], slot.rows[:, :n_rows]
    meta, prefills = [], []
    prefill_blocks: list[list[torch.Tensor]] = [[] for _ in range(table.num_groups)]
    pos, n_decode_rows, n_decode_tokens = 0, 0, 0
    dec_qsl = [0]
    for r, (s, req) in enumerate(zip(sched, reqs, strict=True)):
        n = s.num_tokens
        tok[0, pos : pos + n] = r
        tok[1, pos : pos + n] = np.arange(n)
        tok[2, pos : pos + n] = 0
        if s.decode:
            tok[2, pos + n - s.num_spec : pos + n] = 1
            n_decode_rows += 1
            n_decode_tokens += n
            dec_qsl.append(dec_qsl[-1] + n)
        else:
            prefills.append(PrefillRow(r, pos, n, s.start))
            need = -(-(s.start + n) // table.block_size)
            for g, ids in enumerate(req.block_ids):
                prefill_blocks[g].append(torch.tensor(ids[:need], dtype=torch.int64).to(device))
        rows[:, r] = (req.slot, int(s.decode), s.start, n)
        logprobs = req.params.logprobs if s.sample else None
        meta.append(RowMeta(s.handle, req.slot, req.gen, s.sample, s.num_spec, logprobs))
        pos += n
    sample_idx = [r for r, s in enumerate(sched) if s.sample]
    logit_tok, logit_row, logit_off, logit_start = [], [], [], []
    starts = np.concatenate([[0], np.cumsum([s.num_tokens for s in sched])])
    for i, r in enumerate(sample_idx):
        s = sched[r]
        k = s.num_spec if s.decode else 0
        end = int(starts[r + 1])
        logit_start.append(len(logit_tok))
        logit_tok.extend(range(end - 1 - k, end))
        logit_row.extend([i] * (k + 1))
        logit_off.extend(range(k + 1))
    sampling = None
    if sample_idx:
        sampling = prepare_sampling(
            [_row_sampling(reqs[r]) for r in sample_idx], vocab_size, device, shared_generator
        )

    def dev(a: np.ndarray | list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        t = torch.from_numpy(a) if isinstance(a, np.ndarray) else torch.tensor(a, dtype=dtype)
        return t.to(device=device, dtype=dtype, non_blocking=True)

    max_spec = max((s.num_spec for s in sched), default=0)
    max_len = max((s.start + s.num_tokens + 1 for s in sched), default=1)
    tables = [_block_table(reqs, g, scratch_blocks[g], pad_cols) for g in range(table.num_groups)]
    side = None
    if side_width:
        side = _side_inputs(
            sched, reqs, sample_idx, tables[0], dec_qsl, starts, side_width, side_base, dev
        )
    return StepInputs(
        step_id=cmd.step_id,
        slot_index=slot.index,
        rows=meta,
        num_tokens=n_tokens,
        num_decode_rows=n_decode_rows,
        num_decode_tokens=n_decode_tokens,
        prefills=prefills,
        prefill_block_ids=prefill_blocks,
        new_prompts=new_prompts,
        releases=releases,
        row_slot=dev(rows[0]),
        row_decode=dev(rows[1], torch.bool),
        row_start=dev(rows[2]),
        row_qlen=dev(rows[3]),
        block_tables=[dev(t, torch.int32) for t in tables],
        token_row=dev(tok[0]),
        token_offset=dev(tok[1]),
        token_is_draft=dev(tok[2], torch.bool),
        token_draft_col=dev(np.clip(tok[1] - 1, 0, max(max_spec - 1, 0))),
        decode_query_start_loc=dev(dec_qsl, torch.int32),
        sample_rows=dev(sample_idx),
        sample_slot=dev(rows[0][sample_idx]),
        token_slot=dev(rows[0][tok[0]]),
        sample_num_spec=dev([sched[r].num_spec for r in sample_idx]),
        logits_token_idx=dev(logit_tok),
        logits_sample_row=dev(logit_row),
        logits_offset=dev(logit_off),
        logits_sample_row_host=logit_row,
        sample_logit_start=dev(logit_start),
        max_spec=max_spec,
        max_len=max_len,
        sampling=sampling,
        any_spec=max_spec > 0,
        dense_spec=max_spec > 0
        and all(sched[r].decode and sched[r].num_spec == max_spec for r in sample_idx),
        side=side,
    )


def _side_inputs(
    sched: list[ScheduledRequest],
    reqs: list[WorkerRequest],
    sample_idx: list[int],
    table: np.ndarray,  # [R, C] the main group's block table
    dec_qsl: list[int],
    starts: np.ndarray,  # [R + 1] first token of each row
    width: int,
    base: int,  # first scratch slot
    dev: Callable[..., torch.Tensor],
) -> SideInputs | None:
    """Side rows for speculative decodes without logprobs (a position-1 logprob would
    have to come from the alternative's row); None when the step has none."""
    side = [
        (r, i)
        for i, r in enumerate(sample_idx)
        if sched[r].decode and sched[r].num_spec and reqs[r].params.logprobs is None
    ]
    if not side:
        return None
    rows = [r for r, _ in side]
    slots = base + np.arange(len(side) * width).reshape(len(side), width)
    n_decode = len(dec_qsl) - 1
    return SideInputs(
        width=width,
        state_slots=dev([reqs[r].slot for r in rows]),
        sample=dev([i for _, i in side]),
        every_row=len(side) == len(sample_idx),
        sample_host=[i for _, i in side],
        slots=dev(slots),
        tables=dev(table[rows].repeat(width, 0), torch.int32),
        query_start_loc=dev(
            dec_qsl + [dec_qsl[-1] + j for j in range(1, slots.size + 1)], torch.int32
        ),
        last_slot=dev(np.concatenate([np.full(n_decode, -1), slots.reshape(-1)])),
        first_draft=dev([int(starts[r + 1]) - sched[r].num_spec for r in rows]),
    )


def _block_table(reqs: list[WorkerRequest], group: int, scratch: int, pad_cols: int) -> np.ndarray:
    """[R, max_blocks + pad_cols]; padding points at the group's scratch block."""
    width = max((len(r.block_ids[group]) for r in reqs), default=0) + pad_cols
    table = np.full((len(reqs), width), scratch, dtype=np.int64)
    for i, r in enumerate(reqs):
        ids = r.block_ids[group]
        table[i, : len(ids)] = ids
    return table


def _row_sampling(req: WorkerRequest) -> RowSampling:
    return RowSampling(req.params, req.generator, len(req.prompt_token_ids), req.eos_token_ids)
